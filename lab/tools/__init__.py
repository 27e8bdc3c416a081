"""Research tooling (not the product): see README.md here."""
import argparse


def ab_args(doc, argv):
    """The arguments every A/B script here takes (``--rounds``, ``--only``, ``--no-vendor``),
    parsed from ``argv``, with ``doc`` as the help text."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="only the rows whose shape contains this text")
    p.add_argument("--no-vendor", action="store_true", help="skip FlashMLA")
    return p.parse_args(argv)
