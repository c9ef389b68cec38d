"""``moecomm validate-gpu --quick``: the GPU check that fits one device call of a 15-minute lease.

A GPU reaches this project by chance and for 15 minutes of device time, a machine start included,
so the whole check runs as one process tree of at most 8.5 minutes (:data:`QUICK_BUDGET_S`):

1. setup (in this process, :func:`setup`): start MPS, so that two ranks sharing the GPU run their
   kernels at once instead of in time slices (stopped at exit if we started it); load the NCCL of
   ``--nccl-lib`` (``MOECOMM_NCCL_LIBRARY``), e.g. one built by ``tools/gpu/build_nccl.sh``, which
   every later step preloads (``LD_PRELOAD``); read which code runs (:func:`gpu_steps.source_identity`);
2. environment: versions and ``moecomm topo --json``;
3. the GPU code no GPU has run yet, first, each test file in a step of its own so that one slow file
   cannot starve the others (:data:`GPU_TEST_STEPS`): the ipc transport (bound launcher, float16,
   fused RMSNorm, symmetric tensors, graphs), its in-kernel waits' speed, Lamport with signed zeros and
   the fused op at hidden 7168, close with kernels in flight, the low-latency MoE dispatcher (eager and
   CUDA graphs), NCCL point-to-point, the MoE normal mode's one host sync; then ``bench-moe --mode
   low_latency`` (bf16 and FP8, eager and CUDA graphs);
4. what passed on a GPU before: the NCCL, binding and topology test files, the MoE and TP ones; every
   collective x dtype x op at 2 ranks through nccl (where the NCCL allows two ranks on one GPU:
   >= 2.30), ipc and auto, sizes 0, 1001 elements and 32 MiB (the full run reaches 256 MiB);
5. last, shrunk sweeps of all_reduce 8 B to 16 MiB (factor 8) of moecomm's nccl and ipc against
   torch.distributed NCCL, eagerly and under CUDA graphs (``bench --cuda-graph``): the sizes where
   ipc and NCCL cross.

Every budget is at least 1.5x the step's last measured time or marked a guess (:data:`QUICK_TABLE`,
printed by ``--dry-run``). The full run (``validate-gpu`` without ``--quick``) keeps what this one
leaves out to fit: 256 MiB cases, the separate graph-replay check, ``bench-moe`` at DeepEP's
normal-mode shape and ``bench-tp``.

Without an NCCL that takes two ranks on one GPU, the steps that need one say so in their titles and
run through ipc alone (``--transport ipc``, no torch.distributed baseline); nothing else changes.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

from .gpu_checks import MULTI_RANK_ENV, MULTI_RANK_NCCL
from .gpu_steps import GPU_TEST_FILES, ROOT, Outcome, Step, cli_argv, pytest_argv, source_identity

# Wall time of the whole quick check, setup included: 8.5 of the lease's 15 minutes, leaving a machine
# start (1-2 minutes), the transfers and a short rerun (8 until the path check joined it).
QUICK_BUDGET_S = 8 * 60 + 30
MARGIN = 1.5  # a measured step's budget over its last measured time


class Budget(NamedTuple):
    """A quick step's budget and where its number came from."""

    seconds: int
    measured_s: float | None  # the step's last measured time, its command as planned now; None: a guess
    source: str  # the record and its seconds, or "guess: why"
    checks: str  # "setup"; "new": GPU code no GPU has run yet; "rerun": passed on a GPU before; "sweep": timings


_R = "benchmarks/results/gpu-nvidia-h200-2026-11-27-"
# Measured on one H200, 2026-11-27 (benchmarks/results/gpu-nvidia-h200-2026-11-27-notes.md), two ranks
# sharing it under MPS, NCCL 2.30.7. pytest -q prints no per-file times: a step of several files takes
# the record of a run of those files alone, or the difference of two runs' totals (said so).
QUICK_TABLE: dict[str, Budget] = {
    "setup": Budget(5, 0.03, f"{_R}eb7c865-quick.json: 0.03 s (9478cb7-quick: 0.03 s); in-process", "setup"),
    "environment": Budget(12, 7.5, f"{_R}eb7c865-quick.json: 7.5 s (9478cb7-quick: 5.5 s)", "setup"),
    "gpu-ipc": Budget(50, 32.7, f"{_R}08aca58-test-ipc-gpu.txt: pytest of this file alone, 32.7 s (its two "
                      "tests, the late peer's 8 s sleep included)", "new"),
    "gpu-ipc-spin": Budget(15, None, "guess: one process, no launch: CUDA start, 3 tiny kernels compiled, 3 waits "
                           "of >= 0.5 s (longer if the GPU turns slower than 1 us a turn)", "new"),
    "gpu-ipc-lamport": Budget(30, None, "guess: one 2-rank launch (~5 s: test_ipc_gpu.py's two launches took "
                              "32.7 s, compiles included), 3 fused-RMSNorm variants of an 8192-wide tile to compile "
                              "(the Lamport ones are cached by gpu-ipc), 67 calls", "new"),
    "gpu-ipc-close": Budget(30, None, "guess: its docstring says about 20 s (rank 1 sleeps 10 s)", "new"),
    "moe-low-latency": Budget(45, None, "guess: 2 launches (hidden 1024, 7168), the low-latency kernels compiled "
                              "for each (bf16, FP8), 2 x 100 replays, 26 CPU references (~0.1-0.2 s each)", "new"),
    "gpu-p2p": Budget(20, None, "guess: two 2-rank NCCL launches (exchanges; the stream test); with one, this file "
                      "and test_ipc_gpu.py together took 24.5 s "
                      f"by difference of pytest totals ({_R}eb7c865-quick.txt 85.1 s - {_R}9478cb7-quick.txt 60.6 s), before "
                      "the stream test was added", "new"),
    "gpu-moe-sync": Budget(10, None, "guess: the file's one GPU test (-k cuda), a 1-rank launch", "new"),
    "bench-paths": Budget(30, None, "guess: three 2-rank launches (ipc; NCCL forced onto SHM; onto NET/Socket), each "
                          "~5 s to start plus its NCCL or ipc setup, and 4 sizes of all_reduce (8 B - 256 KiB, 5 + 2 "
                          "calls); ipc alone without a two-rank NCCL", "new"),
    "bench-moe-ll": Budget(30, None, "guess: bench-moe at DeepEP's normal-mode shape took 14.6 s with its baseline "
                           f"({_R}9478cb7-quick.json); here 2 rank launches plus the low-latency kernels compiled at "
                           "256 experts, 5 + 2 iterations of 4 variants, 2 graphs of 20 captured", "new"),
    "gpu-core": Budget(29, 19.0, f"{_R}35a6dca.json gpu-tests: these three files alone, 19.0 s", "rerun"),
    "gpu-moe-tp": Budget(67, 44.0, f"{_R}9478cb7-quick.json gpu-tests, these two files and gpu-core's, 63.1 s, "
                         f"minus {_R}35a6dca.json gpu-tests, gpu-core's alone, 19.0 s: 44.0 s", "rerun"),
    "collectives-ws2": Budget(100, None, f"guess: {_R}eb7c865-quick.json took 96.4 s (9478cb7: 90.6 s) with "
                              "256 MiB cases, whose CPU inputs and references (9 cases, ~2 s each) shrink 8x at "
                              "32 MiB; most of the rest is the cases' first-call compiles", "rerun"),
    "sweep-eager": Budget(18, None, f"guess: 25.2 s for 4 ops x 9 sizes to 64 MiB ({_R}eb7c865-quick.json; 29.3 s "
                          "in 9478cb7); now all_reduce alone, 8 sizes to 16 MiB, 10 + 3 calls: the launch and "
                          "the two NCCL starts remain", "sweep"),
    "sweep-graph": Budget(18, None, f"guess: 26.4 s for 3 ops x 9 sizes to 64 MiB ({_R}eb7c865-quick.json; 18.6 s "
                          "in 9478cb7); now all_reduce alone, 8 sizes to 16 MiB, 5 + 2 replays", "sweep"),
}
QUICK_BUDGETS = {name: b.seconds for name, b in QUICK_TABLE.items()}

# The GPU test steps: (files, what they check[, pytest options narrowing them]). Each of GPU_TEST_FILES is in
# exactly one (tests/test_gpu_quick.py checks it).
GPU_TEST_STEPS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "gpu-ipc": (("tests/test_ipc_gpu.py",), "ipc transport, 2 ranks on cuda:0: Lamport (float16 too) and staged "
                "all_reduce through the pre-bound launcher, fused all_reduce + RMSNorm at 1024, symmetric tensors, "
                "100 graph replays, a late peer raising at synchronize()", ()),
    "gpu-ipc-spin": (("tests/test_ipc_spin_gpu.py",), "ipc in-kernel waits: turns per second on this GPU against "
                     "_SPINS_PER_SECOND (a wait must last the host's timeout; -rsP prints the rates)", ("-rsP",)),
    "gpu-ipc-lamport": (("tests/test_ipc_lamport_gpu.py",), "Lamport all_reduce of -0.0 / +0.0 (the sentinel) in "
                        "float32, bf16, fp16, and the fused all_reduce + RMSNorm at hidden 7168, 2 ranks", ()),
    "gpu-ipc-close": (("tests/test_ipc_close_gpu.py",), "ipc close() with kernels in flight, 2 ranks: returns fast, "
                      "CUDA left clean, the late peer raises", ()),
    "moe-low-latency": (("tests/test_moe_low_latency_gpu.py",), "moe.LowLatencyDispatcher over ipc (CUDA IPC), 2 "
                        "ranks on cuda:0: bf16 and FP8, eager and CUDA-graph captured (100 replays), hidden 1024 and "
                        "7168, vs the CPU reference", ()),
    "gpu-p2p": (("tests/test_p2p_gpu.py",), "NCCL point-to-point, 2 ranks on cuda:0, and its stream contract", ()),
    "gpu-moe-sync": (("tests/test_moe_sync.py",), "MoE normal mode: one host synchronization per layout on CUDA "
                     "(the file's GPU test; the CPU suite runs the rest)", ("-k", "cuda")),
    "gpu-core": (("tests/test_nccl.py", "tests/test_device_binding.py", "tests/test_gpu_topology.py"),
                 "NCCL transport, device binding, GPU topology", ()),
    "gpu-moe-tp": (("tests/test_moe_gpu.py", "tests/test_tp_gpu.py"), "MoE dispatch/combine and layer, "
                   "tensor-parallel layers, 1 and 2 ranks on cuda:0", ()),
}
assert sorted(f for files, _, _ in GPU_TEST_STEPS.values() for f in files) == sorted(GPU_TEST_FILES)

# all_reduce from 8 B to 16 MiB by 8: ipc's Lamport, one-shot and chunked paths against NCCL, where
# auto must choose (IPC_MAX_BYTES; the notes put the crossover between 2 and 16 MiB)
SWEEP_ARGS = ("-b", "8", "-e", "16M", "-f", "8", "--ops", "all_reduce")
# Calls per captured graph (nccl-tests' -G). A replay is timed with its launch and a synchronisation,
# which a graph of 10 calls left as the whole small-message time: every library read 7-12 us per call
# at <= 256 KiB (H200, 2026-11-27); 100 calls put that floor under 1 us.
GRAPH_CALLS = 100
LARGE_MIB = 32  # the collectives check's largest case: 4 chunks of ipc's 8 MiB buffer (the full run: 256)


def quick_paths(gpu_slug: str, date: str, results_dir: str | Path) -> dict[str, Path]:
    """The record's files: ``gpu-<gpu>-<date>-quick.{txt,json,png}``, the two sweeps' and the paths' rows."""
    stem = str(Path(results_dir) / f"gpu-{gpu_slug}-{date}-quick")
    return {"txt": Path(f"{stem}.txt"), "json": Path(f"{stem}.json"), "png": Path(f"{stem}.png"),
            "bench_json": Path(f"{stem}-bench.json"), "bench_graph_json": Path(f"{stem}-bench-graph.json"),
            "paths_json": Path(f"{stem}-paths.json")}


def _test_step(name: str, env: dict[str, str], root: Path) -> Step:
    """A GPU test step of :data:`GPU_TEST_STEPS`; recorded as not run when a file is not in this tree."""
    files, title, options = GPU_TEST_STEPS[name]
    b = QUICK_TABLE[name]
    missing = [f for f in files if not (root / f).is_file()]
    return Step(name, f"pytest {' '.join(files)}: {title}", b.seconds, pytest_argv(*options, *files), dict(env),
                skip=f"not in this tree: {', '.join(missing)}" if missing else None, budget_source=b.source)


def quick_plan(paths: dict[str, Path], nccl_lib: str | None, multi_rank: bool, root: Path = ROOT) -> list[Step]:
    """The steps after setup, in order (budgets: :data:`QUICK_TABLE`). Pure but for looking up the test files.

    Args:
        paths: :func:`quick_paths`.
        nccl_lib: the NCCL library every step preloads, or None (the one torch and cupy load).
        multi_rank: whether that NCCL takes two ranks on one GPU (>= 2.30): nccl, the torch baseline
            and moecomm's NCCL path run only then; else ipc alone.
        root: the tree whose test files run (a missing one makes its step "not run").
    """
    env = dict(MULTI_RANK_ENV)
    if nccl_lib:
        env["LD_PRELOAD"] = nccl_lib
    b = QUICK_TABLE
    if multi_rank:
        peers = ["--transport", "nccl,ipc", "--compare", "--peers", "nccl"]
        bench_env, via, moe_extra = dict(env), "nccl, ipc and auto against torch.distributed NCCL", []
    else:
        peers = ["--transport", "ipc"]
        bench_env = {**env, "MOECOMM_TRANSPORT": "ipc"}
        via = "ipc alone (this NCCL refuses two ranks on one GPU: no nccl, no torch baseline)"
        moe_extra = ["--transport", "ipc", "--no-baseline"]
    sweep = ["bench", "--device", "cuda", "--nprocs", "2", *SWEEP_ARGS, *peers, "-q", "--no-save"]
    # every path two ranks on this GPU can take, each verified (ipc's cuda-ipc; with a two-rank NCCL also its
    # SHM and NET/Socket, checked in its INFO log: NCCL may keep ranks of one GPU on P2P, which fails the step
    # naming what it took); the paths it does not have are listed with their reasons
    paths_argv = ["bench", "--device", "cuda", "--nprocs", "2", "--path", "all" if multi_rank else "cuda-ipc",
                  "-b", "8", "-e", "256K", "-f", "32", "--ops", "all_reduce", "-n", "5", "-w", "2", "-q", "--no-save",
                  "-J", str(paths["paths_json"])]
    moe_ll = ["bench-moe", "--device", "cuda", "--nprocs", "2", "--mode", "low_latency", "--fp8", "--cuda-graph", "20",
              "--tokens", "128", "--hidden", "7168", "-k", "8", "--experts", "256", "-d", "bfloat16", "-n", "5", "-w",
              "2", *moe_extra]

    def step(name: str, title: str, argv: list[str], step_env: dict[str, str]) -> Step:
        return Step(name, title, b[name].seconds, argv, dict(step_env), budget_source=b[name].source)

    tests = [_test_step(name, env, root) for name in GPU_TEST_STEPS]
    new = [t for t in tests if b[t.name].checks == "new"]
    rerun = [t for t in tests if b[t.name].checks == "rerun"]
    return [
        step("environment", "device, driver, CUDA, torch, cupy, NCCL, triton versions; moecomm topo --json",
             cli_argv("topo", "--json"), env),
        *new,
        step("bench-paths", "bench --path " + ("all: cuda-ipc (ipc), NCCL's SHM and NET/Socket, each verified from "
             "its log" if multi_rank else "cuda-ipc (ipc; this NCCL refuses two ranks on one GPU)") +
             "; the paths this machine lacks, with their reasons", cli_argv(*paths_argv), bench_env),
        step("bench-moe-ll", "MoE decoding, DeepEP's low-latency shape (128 tokens, hidden 7168, top-8 of 256): "
             "low latency bf16 and FP8, eager and CUDA graphs of 20, beside the normal mode and the baseline, 2 ranks",
             cli_argv(*moe_ll), bench_env),
        *rerun,
        step("collectives-ws2", "every collective x dtype x op vs a CPU reference, uneven all_to_all with zero "
             f"counts, 0 / 1001 / {LARGE_MIB} MiB, split: 2 ranks on cuda:0" + ("" if multi_rank else ", ipc and auto "
             "only"), cli_argv("validate-gpu", "--check", "collectives", "--nprocs", "2", "--large-mib",
                               str(LARGE_MIB)), env),
        step("sweep-eager", f"all_reduce 8 B - 16 MiB, eager calls: {via}",
             cli_argv(*sweep, "-n", "10", "-w", "3", "-J", str(paths["bench_json"]), "--plot", str(paths["png"])),
             bench_env),
        step("sweep-graph", f"all_reduce 8 B - 16 MiB, CUDA graphs of {GRAPH_CALLS} calls: {via}",
             cli_argv(*sweep, "--cuda-graph", str(GRAPH_CALLS), "-n", "5", "-w", "2",
                      "-J", str(paths["bench_graph_json"])), bench_env),
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
    out = Outcome("setup", status, time.monotonic() - t0, QUICK_TABLE["setup"].seconds, None, None,
                  "\n".join(lines), dict(info))
    return out, info, started
