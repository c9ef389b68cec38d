#!/usr/bin/env bash
# The single device command of a GPU session (after tools/gpu/prepare.sh here):
#
#   bash tools/gpu/quick.sh [validate-gpu options]      carry: .gpu-run/lib, .gpu-run/commit.json
#
# On the device image (its python3 holds torch, cupy, triton and click; nothing is installed there):
# builds the shm helper in place (optional, seconds), then runs `moecomm validate-gpu --quick` with
# the carried NCCL if there is one, writing the record to $OUT (the device tool's folder that comes
# back) or benchmarks/results. Prints where the record went; exits with validate-gpu's code.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-benchmarks/results}
start=$(date +%s)
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "# note: the shm helper (transports/_shmfast.c) was not built"
args=()
if [ -f .gpu-run/lib/libnccl.so.2 ]; then
    args=(--nccl-lib .gpu-run/lib/libnccl.so.2)
fi
python3 -m benchmarks.cli validate-gpu --quick "${args[@]}" --results-dir "$out" "$@"
rc=$?
echo "# tools/gpu/quick.sh: $(( $(date +%s) - start )) s in all; record in $out (exit code $rc):"
ls -l "$out"
exit $rc
