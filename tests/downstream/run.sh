#!/usr/bin/env bash
# Vendoring proven (issue 43): this downstream workspace declares
# local_repository(name = "sparse_mla", path = "../.."), runs a test calling the vendored op,
# then builds every wheel again here (another output base; the sources sit under
# external/sparse_mla) and checks each is byte-identical to the main workspace's wheel.
# Run from anywhere after Bazel is set up (../../bazelw does that); .ci/run calls it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
main=$(cd "$here/../.." && pwd)

"$main/bazelw" build //:wheels
main_dir="$(cd "$main" && bazel info bazel-bin 2>/dev/null)/wheels"

cd "$here"
status=0
bazel test //... || status=1
bazel build @sparse_mla//:wheels
ds_dir="$(bazel info bazel-bin 2>/dev/null)/external/sparse_mla/wheels"

n=0
for whl in "$main_dir"/*.whl; do
  other="$ds_dir/$(basename "$whl")"
  if cmp -s "$whl" "$other"; then
    n=$((n + 1))
  else
    echo "downstream: $(basename "$whl") differs between the two builds (or is missing)" >&2
    status=1
  fi
done
extra=$(comm -13 <(ls "$main_dir") <(ls "$ds_dir") || true)
if [ -n "$extra" ] || [ "$n" = 0 ]; then
  echo "downstream: wheel sets differ (only downstream: ${extra:-none}; identical: $n)" >&2
  status=1
fi
echo "downstream: vendored test $([ $status = 0 ] && echo passed || echo FAILED); $n wheels byte-identical across the two workspaces"
bazel shutdown  # this workspace's own Bazel server; the main one keeps running
exit $status
