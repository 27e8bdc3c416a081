#!/usr/bin/env bash
# Makes the checkout importable as `sparse_mla` without Bazel (e.g. on the GPU machine) and
# prints the directory to put on PYTHONPATH:  export PYTHONPATH=$(bash tools/pyroot.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.pyroot"
ln -sfn "$root" "$root/.pyroot/sparse_mla"
echo "$root/.pyroot"
