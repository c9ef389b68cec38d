#!/usr/bin/env bash
# Build an NCCL that lets several ranks share one GPU (>= 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1)
# for Hopper (sm_90) only, with the function set moecomm and torch.distributed use on one node.
#
#   tools/gpu/build_nccl.sh SRC_DIR OUT_DIR      # -> OUT_DIR/lib/libnccl.so (prints its path last)
#
# SRC_DIR is an NCCL source tree (NVIDIA/nccl, v2.30 or newer), fetched beforehand: the device
# machine has no network. The function set drops what one node of GPUs never runs (NVLS,
# CollNet and PAT algorithms, and the fp8 types). Measured: 126-143 s on the device's 15 cores
# (2026-11-23 notes); 47 minutes on the 2-core development machine beside other work (2026-11-27,
# 2.30.7: a 16 MB library once stripped). Environment: CUDA_HOME (default /usr/local/cuda), JOBS
# (default nproc), NCCL_GENCODE (default sm_90).
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SRC_DIR OUT_DIR" >&2
    exit 2
fi
src=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
version_mk="$src/makefiles/version.mk"
if [ ! -f "$version_mk" ]; then
    echo "$0: $src is not an NCCL source tree (no makefiles/version.mk)" >&2
    exit 2
fi
major=$(awk '/^NCCL_MAJOR/ {print $3}' "$version_mk")
minor=$(awk '/^NCCL_MINOR/ {print $3}' "$version_mk")
patch=$(awk '/^NCCL_PATCH/ {print $3}' "$version_mk")
if [ "$major" -lt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -lt 30 ]; }; then
    echo "$0: NCCL $major.$minor.$patch in $src is older than 2.30, which refuses two ranks on one GPU" >&2
    exit 2
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
jobs=${JOBS:-$(nproc)}
gencode=${NCCL_GENCODE:--gencode=arch=compute_90,code=sm_90}
# generate.py's filter: "SendRecv" | "<coll> <algo> <proto>" | "<coll> <redop> <type> <algo> <proto>"
funcs='(AllGather|AllGatherV|Broadcast) (RING|TREE) *|(AllReduce|Reduce|ReduceScatter) * (i8|u8|i32|u32|i64|u64|f16|f32|f64|bf16) (RING|TREE) *|SendRecv'

echo "building NCCL $major.$minor.$patch from $src into $out ($jobs jobs, $gencode)"
start=$(date +%s)
make -C "$src" -j"$jobs" src.build BUILDDIR="$out" NVCC_GENCODE="$gencode" ONLY_FUNCS="$funcs" \
    CUDA_HOME="$CUDA_HOME" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log" >&2; exit 1; }
lib=$(ls "$out"/lib/libnccl.so.* | sort | tail -1)
strip --strip-unneeded "$lib" 2>/dev/null || true
echo "built in $(( $(date +%s) - start )) s: $(du -h "$lib" | cut -f1)"
echo "$out/lib/libnccl.so"
