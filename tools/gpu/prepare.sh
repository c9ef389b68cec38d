#!/usr/bin/env bash
# Prepare the one device call of `moecomm validate-gpu --quick`; run here, before the call:
#
#   tools/gpu/prepare.sh [NCCL_SRC_DIR]
#
# - writes .gpu-run/commit.json: the commit and whether the tree differs from it (the device machine
#   gets the working tree without its git history; the record names the code from this file);
# - given an NCCL source tree (>= 2.30, fetched beforehand: the device has no network), builds it
#   once into .gpu-run/nccl (tools/gpu/build_nccl.sh; 47 minutes on 2 cores) and puts the
#   library at .gpu-run/lib/libnccl.so.2, which the quick check preloads into every rank.
#
# Then the device command is `bash tools/gpu/quick.sh`, carrying .gpu-run/lib and .gpu-run/commit.json
# (.gpu-run/ is git-ignored, so it travels only when named in the call's carry).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu-run
python3 - <<'PY'
import datetime, json, subprocess
run = lambda *a: subprocess.run(a, capture_output=True, text=True, check=True).stdout.strip()
info = {"commit": run("git", "rev-parse", "HEAD"),
        "dirty": bool(run("git", "status", "--porcelain", "--untracked-files=no")),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
open(".gpu-run/commit.json", "w").write(json.dumps(info) + "\n")
print(f".gpu-run/commit.json: {info}")
PY
if [ $# -ge 1 ]; then
    if ! ls .gpu-run/nccl/lib/libnccl.so.* >/dev/null 2>&1; then
        tools/gpu/build_nccl.sh "$1" .gpu-run/nccl
    fi
    mkdir -p .gpu-run/lib
    cp -L "$(ls .gpu-run/nccl/lib/libnccl.so.2.* | sort | tail -1)" .gpu-run/lib/libnccl.so.2
    echo ".gpu-run/lib/libnccl.so.2: $(du -h .gpu-run/lib/libnccl.so.2 | cut -f1)"
fi
echo 'device command: bash tools/gpu/quick.sh   carry: [".gpu-run/lib", ".gpu-run/commit.json"]'
