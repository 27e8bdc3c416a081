"""Runs pytest on the test files a `py_pytest` target names (tools/bazel/pytest.bzl).

Under `bazel test` the junit XML goes where Bazel asks (XML_OUTPUT_FILE), so .ci/run can add
up passed/failed/skipped across targets. Exit code 5 (nothing collected) counts as failure: a
target that runs no test is a defect.
"""
import os
import sys

import pytest


def main(argv):
    args = list(argv) + ["-q", "-rs", "-p", "no:cacheprovider"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    code = pytest.main(args)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("no tests were collected: failing the target", file=sys.stderr)
        return 1
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
