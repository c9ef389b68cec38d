"""``moecomm validate-gpu --quick``: the GPU check that fits one device call of a 15-minute lease.

A GPU reaches this project by chance and for 15 minutes of device time, a machine start included,
so the whole check runs as one process tree of at most 8 minutes (:data:`QUICK_BUDGET_S`):

1. setup (in this process, :func:`setup`): start MPS, so that two ranks sharing the GPU run their
   kernels at once instead of in time slices (stopped at exit if we started it); load the NCCL of
   ``--nccl-lib`` (``MOECOMM_NCCL_LIBRARY``), e.g. one built by ``tools/gpu/build_nccl.sh``, which
   every later step preloads (``LD_PRELOAD``); read which code runs (:func:`gpu_steps.source_identity`);
2. environment: versions and ``moecomm topo --json``;
3. the GPU test files (collectives, device binding, topology, MoE, TP);
4. every collective x dtype x op at 2 ranks on the one GPU through nccl (where the NCCL allows two
   ranks on one GPU: >= 2.30), ipc and auto, with the sizes 0, 1001 elements and 256 MiB and zero
   counts in the uneven all_to_all;
5. an all_reduce captured in a CUDA graph, 100 checked replays, through nccl and ipc; the
   low-latency MoE dispatcher (bf16 and FP8, eager and 100 captured replays) against the CPU reference;
6. the sweep 8 B to 64 MiB (factor 8) of moecomm's nccl and ipc against torch.distributed NCCL,
   eagerly and 7. under CUDA graphs (``bench --cuda-graph``);
8. ``bench-moe`` (prefill shape), ``bench-moe --mode low_latency`` (decoding shape: bf16 and FP8,
   eager and CUDA graphs) and ``bench-tp`` (with and without sequence parallel) on the GPU.

Without an NCCL that takes two ranks on one GPU, the steps that need one say so in their titles and
run through ipc alone (``--transport ipc``, no torch.distributed baseline); nothing else changes.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .gpu_checks import MULTI_RANK_ENV, MULTI_RANK_NCCL
from .gpu_steps import (
    GPU_TEST_FILES,
    LOW_LATENCY_TEST_FILE,
    Outcome,
    Step,
    cli_argv,
    source_identity,
)

# Wall time of the whole quick check, setup included: 8 of the lease's 15 minutes, leaving a machine
# start (1-2 minutes), the transfers and a short rerun.
QUICK_BUDGET_S = 8 * 60

# Step budgets (s): about 3x what each step took on the GPU where the sum allows it, else less; the
# record keeps every step's time against its budget. Measured on an H200, 2026-11-27: environment
# 7 s, the older GPU test files 19 s, the MoE and TP GPU test files 69 s (as 14 launches; now 8), the
# 2-rank collectives 76 s (ipc and auto, with the 256 MiB cases), graphs 10 s
# (benchmarks/results/gpu-nvidia-h200-2026-11-27-35a6dca.txt). The GPU tests and the 2-rank
# collectives, the steps the check exists for, get less than 3x so that the sweeps fit.
# The low-latency MoE steps (issue 41) have not run on a GPU yet: their budgets are guesses (2-rank
# launches, Triton compiles, 2 x 100 graph replays checked on the CPU), taken from the sweeps and the
# collectives, which used 25-29 s and 91-96 s of theirs.
QUICK_BUDGETS = {"setup": 15, "environment": 20, "gpu-tests": 90, "collectives-ws2": 115, "cuda-graphs": 25,
                 "moe-low-latency": 40, "sweep-eager": 35, "sweep-graph": 35, "bench-moe": 30, "bench-moe-ll": 35,
                 "bench-tp": 20, "bench-tp-sp": 20}
SWEEP_ARGS = ("-b", "8", "-e", "64M", "-f", "8", "--ops", "all_reduce,all_gather,reduce_scatter,all_to_all")
# Calls per captured graph (nccl-tests' -G). A replay is timed with its launch and a synchronisation,
# which a graph of 10 calls left as the whole small-message time: every library read 7-12 us per call
# at <= 256 KiB (H200, 2026-11-27); 100 calls put that floor under 1 us.
GRAPH_CALLS = 100


def quick_paths(gpu_slug: str, date: str, results_dir: str | Path) -> dict[str, Path]:
    """The record's files: ``gpu-<gpu>-<date>-quick.{txt,json,png}`` and the two sweeps' rows."""
    stem = str(Path(results_dir) / f"gpu-{gpu_slug}-{date}-quick")
    return {"txt": Path(f"{stem}.txt"), "json": Path(f"{stem}.json"), "png": Path(f"{stem}.png"),
            "bench_json": Path(f"{stem}-bench.json"), "bench_graph_json": Path(f"{stem}-bench-graph.json")}


def quick_plan(paths: dict[str, Path], nccl_lib: str | None, multi_rank: bool) -> list[Step]:
    """The steps after setup, in order (budgets: :data:`QUICK_BUDGETS`). Pure.

    Args:
        paths: :func:`quick_paths`.
        nccl_lib: the NCCL library every step preloads, or None (the one torch and cupy load).
        multi_rank: whether that NCCL takes two ranks on one GPU (>= 2.30): nccl, the torch baseline
            and moecomm's NCCL path run only then; else ipc alone.
    """
    env = dict(MULTI_RANK_ENV)
    if nccl_lib:
        env["LD_PRELOAD"] = nccl_lib
    b = QUICK_BUDGETS
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    if multi_rank:
        peers = ["--transport", "nccl,ipc", "--compare", "--peers", "nccl"]
        bench_env, via, moe_extra, tp_extra = dict(env), "nccl, ipc and auto against torch.distributed NCCL", [], []
    else:
        peers = ["--transport", "ipc"]
        bench_env = {**env, "MOECOMM_TRANSPORT": "ipc"}
        via = "ipc alone (this NCCL refuses two ranks on one GPU: no nccl, no torch baseline)"
        moe_extra, tp_extra = ["--transport", "ipc", "--no-baseline"], ["--transport", "ipc"]
    sweep = ["bench", "--device", "cuda", "--nprocs", "2", *SWEEP_ARGS, *peers, "-q", "--no-save"]
    moe = ["bench-moe", "--device", "cuda", "--nprocs", "2", "--tokens", "4096", "--hidden", "7168", "-k", "8",
           "--experts", "256", "-d", "bfloat16", "-n", "5", "-w", "2", *moe_extra]
    tp = ["bench-tp", "--device", "cuda", "--sizes", "1,2", "-n", "10", "-w", "3", *tp_extra]
    moe_ll = ["bench-moe", "--device", "cuda", "--nprocs", "2", "--mode", "low_latency", "--fp8", "--cuda-graph", "20",
              "--tokens", "128", "--hidden", "7168", "-k", "8", "--experts", "256", "-d", "bfloat16", "-n", "10", "-w",
              "3", *moe_extra]
    return [
        Step("environment", "device, driver, CUDA, torch, cupy, NCCL, triton versions; moecomm topo --json",
             b["environment"], cli_argv("topo", "--json"), dict(env)),
        Step("gpu-tests", "pytest on the GPU test files (collectives, binding, topology, MoE, TP)", b["gpu-tests"],
             pytest_argv, dict(env)),
        Step("collectives-ws2", "every collective x dtype x op vs a CPU reference, uneven all_to_all with zero "
             "counts, 0 / 1001 / 256 MiB, split: 2 ranks on cuda:0" + ("" if multi_rank else ", ipc and auto only"),
             b["collectives-ws2"], cli_argv("validate-gpu", "--check", "collectives", "--nprocs", "2"), dict(env)),
        Step("cuda-graphs", "all_reduce captured once, 100 checked replays, 2 ranks on cuda:0"
             + ("" if multi_rank else ", ipc only"), b["cuda-graphs"],
             cli_argv("validate-gpu", "--check", "graphs", "--nprocs", "2"), dict(env)),
        Step("moe-low-latency", "moe.LowLatencyDispatcher over ipc (CUDA IPC), 2 ranks on cuda:0: bf16 and FP8, "
             "eager and CUDA-graph captured (100 replays), hidden 1024 and 7168, vs the CPU reference",
             b["moe-low-latency"], [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                    LOW_LATENCY_TEST_FILE], dict(env)),
        Step("sweep-eager", f"8 B - 64 MiB, eager calls: {via}", b["sweep-eager"],
             cli_argv(*sweep, "-J", str(paths["bench_json"]), "--plot", str(paths["png"])), bench_env),
        Step("sweep-graph", f"8 B - 64 MiB, CUDA graphs of {GRAPH_CALLS} calls: {via}", b["sweep-graph"],
             cli_argv(*sweep, "--cuda-graph", str(GRAPH_CALLS), "-n", "10", "-w", "2",
                      "-J", str(paths["bench_graph_json"])), bench_env),
        Step("bench-moe", "MoE dispatch/combine, DeepEP's shape (4096 tokens, hidden 7168, top-8 of 256, bf16), "
             "2 ranks", b["bench-moe"], cli_argv(*moe), bench_env),
        Step("bench-moe-ll", "MoE decoding, DeepEP's low-latency shape (128 tokens, hidden 7168, top-8 of 256): "
             "low latency bf16 and FP8, eager and CUDA graphs of 20, beside the normal mode and the baseline, 2 ranks",
             b["bench-moe-ll"], cli_argv(*moe_ll), bench_env),
        Step("bench-tp", "tensor-parallel MLP block at TP 1 and 2", b["bench-tp"], cli_argv(*tp), bench_env),
        Step("bench-tp-sp", "tensor-parallel MLP block at TP 1 and 2, sequence parallel", b["bench-tp-sp"],
             cli_argv(*tp, "--sequence-parallel"), bench_env),
    ]


# ---- setup ---------------------------------------------------------------------------------------

def nccl_library_version(path: str) -> tuple[int, int, int]:
    """Load the NCCL library at ``path`` into this process (RTLD_GLOBAL, so cupy's NCCL module binds
    to it when imported later) and ask it its version (ncclGetVersion).

    Raises OSError when it cannot be loaded or does not answer.
    """
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        raise OSError(f"ncclGetVersion failed in {path}")
    v = code.value  # 2.30.7 -> 23007 (from 2.9 on: major * 10000 + minor * 100 + patch)
    return v // 10000, v // 100 % 100, v % 100


def start_mps(runner: Any = subprocess.run) -> tuple[bool, str]:
    """Start the MPS control daemon (a user-space daemon; no card setting changes).

    Returns:
        (whether we started it, so must stop it; what happened).
    """
    if shutil.which("nvidia-cuda-mps-control") is None:
        return False, "nvidia-cuda-mps-control not found: ranks sharing the GPU are time-sliced (timings in ms)"
    p = runner(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True, timeout=20)
    if p.returncode == 0:
        return True, "MPS control daemon started (nvidia-cuda-mps-control -d)"
    said = (p.stdout + p.stderr).strip()
    return False, f"MPS not started by us (exit {p.returncode}: {said[-300:]}); an instance may already run"


def stop_mps(runner: Any = subprocess.run) -> None:
    """Stop the MPS control daemon we started (``echo quit | nvidia-cuda-mps-control``)."""
    runner(["nvidia-cuda-mps-control"], input="quit\n", capture_output=True, text=True, timeout=20)


def setup(nccl_lib: str | None) -> tuple[Outcome, dict[str, Any], bool]:
    """Step 1, in this process: MPS, the NCCL every later step uses, the code that runs.

    Returns:
        (the step's outcome, what later steps need: ``nccl_lib`` (None if not usable),
        ``nccl_version``, ``multi_rank``, ``source``; whether MPS must be stopped at exit).
    """
    t0 = time.monotonic()
    lines, status = [], "pass"
    started, said = start_mps()
    lines.append(said)
    info: dict[str, Any] = {"mps": said, "nccl_lib": None, "nccl_version": None, "multi_rank": False}
    if nccl_lib:
        try:
            version = nccl_library_version(nccl_lib)
            info.update(nccl_lib=str(Path(nccl_lib).resolve()), nccl_version=".".join(map(str, version)),
                        multi_rank=version >= MULTI_RANK_NCCL)
            lines.append(f"NCCL {info['nccl_version']} from {info['nccl_lib']}: preloaded (LD_PRELOAD) by every step")
        except (OSError, AttributeError) as e:
            status = "fail"
            lines.append(f"--nccl-lib {nccl_lib} cannot be used ({type(e).__name__}: {e}); the image's NCCL instead")
    if info["nccl_lib"] is None:
        from transports.nccl import nccl_version

        version = nccl_version()
        info.update(nccl_version=".".join(map(str, version)) if version else None,
                    multi_rank=bool(version and version >= MULTI_RANK_NCCL))
        lines.append(f"NCCL {info['nccl_version'] or 'none'}: the one torch and cupy load")
    if not info["multi_rank"]:
        lines.append("this NCCL refuses two ranks on one GPU (needs >= 2.30): nccl steps at 2 ranks are not run; "
                     "the sweeps, MoE and TP run through ipc (tools/gpu/build_nccl.sh builds one)")
    info["source"] = source_identity()
    lines.append(f"code: {info['source']}")
    out = Outcome("setup", status, time.monotonic() - t0, QUICK_BUDGETS["setup"], None, None,
                  "\n".join(lines), dict(info))
    return out, info, started
