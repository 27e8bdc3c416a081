"""Exception types shared by every op family."""
from __future__ import annotations

from typing import Optional


class ImplementationUnavailable(RuntimeError):
    """A forced implementation cannot run on these inputs (the message says why).

    ``reason`` is the implementation's own reason, without the op / forcing context of the
    message (the main job prints it as the table's "n/a" cell)."""

    def __init__(self, message: str, reason: Optional[str] = None):
        super().__init__(message)
        self.reason = message if reason is None else reason
