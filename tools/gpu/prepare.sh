#!/usr/bin/env bash
# Prepare the one device call of `moecomm validate-gpu --quick`; run here, before the call:
#
#   tools/gpu/prepare.sh [NCCL_SRC_DIR]
#
# - puts an NCCL >= 2.30 (which takes two ranks on one GPU) at .gpu-run/lib/libnccl.so.2, which the
#   quick check preloads into every rank:
#   - without an argument, the prebuilt one of the shared folder when it is there
#     (MOECOMM_SHARED_NCCL, default ../shared/gpu/libnccl.so.2 from the repository root: NCCL 2.30.7
#     for sm_90, built by tools/gpu/build_nccl.sh), after checking its sha256 against the one its
#     README.md names (or MOECOMM_SHARED_NCCL_SHA256); a mismatch stops here. So the first device
#     call is the quick check itself, with no build;
#   - given an NCCL source tree (>= 2.30, fetched beforehand: the device has no network), builds it
#     once into .gpu-run/nccl (tools/gpu/build_nccl.sh; 47 minutes on 2 cores) and takes that;
#   - neither: no library (the image's NCCL, 2.28.9 on the H200 image, refuses two ranks on one GPU:
#     the quick check then runs ipc alone);
# - writes .gpu-run/commit.json: the commit and whether the tree differs from it (the device machine
#   gets the working tree without its git history; the record names the code from this file), and
#   the carried NCCL's origin, sha256 and version (ncclGetVersion), also printed.
#
# Then the device command is `bash tools/gpu/quick.sh`, carrying .gpu-run/lib and .gpu-run/commit.json
# (.gpu-run/ is git-ignored, so it travels only when named in the call's carry).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu-run
lib=.gpu-run/lib/libnccl.so.2
shared=${MOECOMM_SHARED_NCCL:-../shared/gpu/libnccl.so.2}
origin=""
if [ $# -ge 1 ]; then
    if ! ls .gpu-run/nccl/lib/libnccl.so.* >/dev/null 2>&1; then
        tools/gpu/build_nccl.sh "$1" .gpu-run/nccl
    fi
    mkdir -p .gpu-run/lib
    rm -f "$lib"  # an earlier copy may be read-only (the shared file is)
    cp -L "$(ls .gpu-run/nccl/lib/libnccl.so.2.* | sort | tail -1)" "$lib"
    origin="built from $1 by tools/gpu/build_nccl.sh"
elif [ -f "$shared" ]; then
    want=${MOECOMM_SHARED_NCCL_SHA256:-} said=MOECOMM_SHARED_NCCL_SHA256
    readme="$(dirname "$shared")/README.md"
    if [ -z "$want" ] && [ -f "$readme" ]; then
        want=$(grep -o 'sha256 `[0-9a-f]\{64\}`' "$readme" | head -1 | tr -d '`' | cut -d' ' -f2 || true)
        said=$readme
    fi
    if [ -z "$want" ]; then
        echo "$0: no sha256 to check $shared against (no README.md beside it naming one, no MOECOMM_SHARED_NCCL_SHA256)" >&2
        exit 1
    fi
    got=$(sha256sum "$shared" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "$0: $shared has sha256 $got, not the $want that $said names: not used" >&2
        exit 1
    fi
    mkdir -p .gpu-run/lib
    rm -f "$lib"
    cp -L "$shared" "$lib"
    origin="$shared (prebuilt, sha256 checked)"
elif [ -f "$lib" ]; then
    origin="left from an earlier prepare"
fi
NCCL_ORIGIN="$origin" python3 - "$lib" <<'PY'
import ctypes, datetime, hashlib, json, os, subprocess, sys
run = lambda *a: subprocess.run(a, capture_output=True, text=True, check=True).stdout.strip()
info = {"commit": run("git", "rev-parse", "HEAD"),
        "dirty": bool(run("git", "status", "--porcelain", "--untracked-files=no")),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
lib = sys.argv[1]
if os.environ["NCCL_ORIGIN"]:
    nccl = {"lib": lib, "from": os.environ["NCCL_ORIGIN"],
            "sha256": hashlib.sha256(open(lib, "rb").read()).hexdigest()}
    try:  # needs no GPU: ncclGetVersion only reads the library's constant
        v = ctypes.c_int()
        if ctypes.CDLL(os.path.abspath(lib)).ncclGetVersion(ctypes.byref(v)) != 0:
            raise OSError("ncclGetVersion failed")
        nccl["version"] = f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}"
    except (OSError, AttributeError) as e:
        nccl["version"] = f"unknown ({type(e).__name__}: {e})"
    info["nccl"] = nccl
    print(f"{lib}: NCCL {nccl['version']}, {os.path.getsize(lib) >> 20} MiB, sha256 {nccl['sha256']}, "
          f"from {nccl['from']}")
else:
    print("no NCCL carried: the quick check runs with the image's NCCL (ipc alone if it refuses two ranks "
          "on one GPU)")
open(".gpu-run/commit.json", "w").write(json.dumps(info) + "\n")
print(f".gpu-run/commit.json: {info}")
PY
echo 'device command: bash tools/gpu/quick.sh   carry: [".gpu-run/lib", ".gpu-run/commit.json"]'
