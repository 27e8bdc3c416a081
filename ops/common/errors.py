"""Exception types shared by every op family."""


class ImplementationUnavailable(RuntimeError):
    """A forced implementation cannot run on these inputs (the message says why)."""
