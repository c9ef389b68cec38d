"""Session-wide hygiene of the test suite."""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Iterator

import pytest
import torch

import collectives

# A launched test body's ranks import its test module and what the body needs: pytest, the MoE and
# tensor-parallel packages, and, with no GPU, FSDP (3 s a rank on this VM), transformers' models (8 s)
# and the ipc kernels under Triton's interpreter (0.8 s). A fork server that holds them forks the ranks
# ready (tests/test_collectives.py took 80 s without pytest preloaded, 52 s with it). A module that
# is not installed is skipped there.
_HF_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
collectives.launch_preload("pytest", "moe", "collectives.tensor_parallel", "collectives.torch_backend")
if not torch.cuda.is_available():
    # The CPU suite. Not on a GPU machine: its one-call check (benchmarks/gpu_quick.py) launches none
    # of these bodies and would pay the imports (seconds) out of its device time.
    collectives.launch_preload("torch.distributed.fsdp", "transformers", "transformers.modeling_utils", "moe.hf",
                               *(f"transformers.models.{f}.modeling_{f}" for f in _HF_FAMILIES))
    # every ipc kernel of the suite runs under Triton's interpreter, which must be chosen before the
    # kernels are defined (transports/ipc.py load_kernels); the sm_90 compile tests run in
    # subprocesses without it
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        collectives.launch_preload("triton", "transports.kernels.collectives", "transports.kernels.lamport",
                                   "transports.kernels.moe_ll")

# Where the environment sets PYTHONDONTWRITEBYTECODE (this CI image does), every interpreter the suite
# starts (mpiexec and torchrun ranks, the CLI, the examples, the fork servers) would compile moecomm's
# sources and rewrite the test modules' asserts again: let them cache bytecode (__pycache__, git-ignored).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

MPICH_SEGMENTS = "/dev/shm/mpich_shm_*"

# The slow tier (pyproject's addopts leave it out; `pytest -m slow` runs it): more variants of a check
# whose representative stays in the default suite, named beside it, so that the suite keeps to about
# ten minutes on the 2-core CI machine (seconds: a quiet run of that machine, 2026-11-27).
SLOW: dict[str, str] = {
    "test_ipc_transport.py::test_every_collective_dtype_op_and_size[4]": "69 s; 2 and 3 ranks stay",
    "test_multinode.py::test_job_across_nodes[torchrun-3x1]": "15 s; torchrun-2x2 stays",
    "test_multinode.py::test_job_across_nodes[mpiexec-3x1]": "14 s; torchrun-2x2 stays",
    "test_multinode.py::test_job_across_nodes[mpiexec-2x2]": "12 s; torchrun-2x2 stays",
    "test_moe_internode.py::test_node_aware_across_testbed_nodes[torchrun-3x1]": "16 s; mpiexec-2x2 stays",
    "test_moe_internode.py::test_node_aware_across_testbed_nodes[torchrun-2x2]": "13 s; mpiexec-2x2 stays",
    "test_moe_internode.py::test_node_aware_across_testbed_nodes[mpiexec-3x1]": "9 s; mpiexec-2x2 stays",
    "test_hierarchical.py::test_hierarchical_equals_flat[mpiexec]": "7 s; torchrun stays",
    "test_blame.py::test_a_killed_rank_on_another_node_is_named_on_the_hierarchical_path":
        "30 s; the stopped rank (torchrun-rail) and the gloo/mpi blame tests stay",
    "test_blame.py::test_a_stopped_rank_on_another_node_is_named_on_the_hierarchical_path[torchrun-node]":
        "13 s; torchrun-rail stays",
    "test_blame.py::test_a_stopped_rank_on_another_node_is_named_on_the_hierarchical_path[mpiexec-rail]":
        "12 s; torchrun-rail stays",
    # issue #42 (.ci/run at 18 minutes), seconds of a loaded run of this machine
    "test_moe_hf.py::test_expert_parallel_in_memory_equals_one_process[4-every]":
        "14 s; every family at 2 ranks and deepseek_v3 + gpt_oss at 4 ranks ([4]) stay",
    "test_moe_hf.py::test_distributed_config_ep_implementation_moecomm[4-gloo-every]":
        "19 s; every family at 2 ranks and deepseek_v3 + gpt_oss at 4 ranks ([4-gloo]) stay",
    # seconds of a quiet run (2026-11-28, 908 s in all)
    "test_ipc_lamport.py::test_lamport_every_dtype_op_and_size_bitwise_on_every_rank[4]":
        "6.8 s; 2 ranks (every size, three passes) and 3 ranks stay",
    "test_ipc_lamport.py::test_fused_all_reduce_rmsnorm_matches_the_composition[4]": "6.6 s; 2 and 3 ranks stay",
    "test_tensor_parallel.py::test_region_functions_forward_and_backward[4]": "6.1 s; 2 and 3 ranks stay",
    # issue #55 (seconds of a quiet run, 2026-11-28)
    "test_elastic_moe.py::test_raise_shrink_grow[low-latency-0-4-auto-10]":
        "31-52 s; the same with 2 steps before and after the death ([low-latency-0-4-auto-2]) stays",
    "test_elastic_moe.py::test_raise_shrink_grow[normal-2-0-gloo-10]": "15 s; shm ([normal-2-0-auto-10]) stays",
    "test_elastic_moe.py::test_mask_on_failure[low-latency]": "27 s; [normal] stays",
    "test_moe_ll_hooks.py::test_hooked_calls_equal_plain_ones_bitwise_and_the_rules_hold[3]":
        "32 s; 2 ranks (50 hooked calls and the rules) stay",
    "test_elastic_moe.py::test_a_newcomer_without_a_source_for_an_expert_fails_on_every_rank":
        "12 s; the grows with a checkpoint and with replicas stay",
}


# With pytest-xdist (`-n auto`, as the README's test command runs), each worker takes whole files
# (--dist loadfile, the default here) in collection order: the files that take longest go first, so
# the run does not end on one worker finishing a long file while the other idles. Seconds of a
# `-n auto` run of this 2-core machine (2026-11-28, 614 s in all); a file not named keeps its place.
LONGEST_FIRST: dict[str, float] = {
    "test_collectives.py": 96, "test_ipc_transport.py": 88, "test_launch_modes.py": 62, "test_ipc_lamport.py": 55,
    "test_readme.py": 51, "test_moe_low_latency.py": 50, "test_ipc_lamport_kernels.py": 48,
    "test_bench_suite.py": 47, "test_host_transports.py": 40, "test_torch_backend.py": 39, "test_blame.py": 38,
    "test_ipc_compile.py": 37, "test_init.py": 36, "test_model_calibrate.py": 32, "test_faults.py": 32,
    "test_communicator_threads.py": 25, "test_interrupted_calls.py": 25, "test_examples_hf.py": 25,
    "test_examples_train_moe.py": 24, "test_p2p.py": 22,
    # issue #55's files (2026-11-28)
    "test_elastic_moe.py": 45, "test_moe_ll_hooks.py": 25, "test_moe_masks.py": 22, "test_moe_ll_masks.py": 19,
    "test_grow.py": 20,
}
# workers for `-n auto`: each runs jobs of 2 to 4 ranks (and a few of 8), so more would only
# oversubscribe the cores and stretch the tests' bounded waits
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # declared by pytest-xdist (the test extra); without it, never called
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's scheduler
    """Whole files per worker unless --dist says otherwise: the module fixtures then run once."""
    if any(a == "--dist" or a.startswith("--dist=") or a in ("-d", "--distload")
           for a in config.invocation_params.args):
        return None  # xdist's own choice
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start compiling the torch backend's c10d trampoline (collectives/torch_backend/_native.py: about a
    minute on 2 cores, once per machine and torch) beside the first tests, instead of inside the first
    test that creates a moecomm group; the processes that need it meanwhile wait for this build."""
    import threading

    from collectives.torch_backend import _native

    threading.Thread(target=_native.load, name="moecomm-trampoline-build", daemon=True).start()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("tests/", 1)[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # a stable sort: the files' own order of tests stays
        items.sort(key=lambda item: -LONGEST_FIRST.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], 0.0))


def _mapped(paths: set[str]) -> set[str]:
    """The ``paths`` that some process still maps (read from /proc/*/maps)."""
    in_use: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # the process ended, or is not ours to read
            continue
        in_use |= {p for p in paths if p in text}
    return in_use


@pytest.fixture(scope="session", autouse=True)
def remove_mpich_segments_of_killed_ranks() -> Iterator[None]:
    """MPICH unlinks its shared-memory segment in MPI_Finalize, so a rank that the fault tests kill (or
    that exits after a creation error) leaves ``/dev/shm/mpich_shm_*`` behind: several MB of RAM per
    job on every run. At the end of the session, remove the ones created during it that no process
    maps any more (a job still running, such as the mpiexec that runs this pytest, keeps its own)."""
    before = set(glob.glob(MPICH_SEGMENTS))
    yield
    new = set(glob.glob(MPICH_SEGMENTS)) - before
    try:  # this session's own job (pytest run by mpiexec) keeps its segment: MPI_Finalize removes it
        with open("/proc/self/maps") as f:
            mine = f.read()
        new = {p for p in new if p not in mine}
    except OSError:
        pass
    deadline = time.monotonic() + 5.0  # a killed job's last processes may still be exiting
    while new:
        for path in new - _mapped(new):
            try:
                os.unlink(path)
            except OSError:  # another session removed it
                pass
        new = {p for p in new if os.path.exists(p)}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.5)
