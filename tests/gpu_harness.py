"""Shared by the CUDA test files (test_moe_gpu.py, test_tp_gpu.py): ranks on the one GPU, each
launch running a body for every dtype (a launch costs seconds of process and CUDA start; the quick
GPU check runs these files inside its 8 minutes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import collectives
from benchmarks.gpu_checks import gpu_transports

DEVICE = "cuda:0"


def each_dtype(comm: Any, device: str, body: Callable[..., Any], dtypes: Sequence[str]) -> list[Any]:
    """``[body(comm, device, d) for d in dtypes]`` on one rank (a launch body)."""
    return [body(comm, device, d) for d in dtypes]


def launch_on_gpu(body: Callable[..., Any], nprocs: int, *args: Any) -> list[Any]:
    """Run ``body(comm, DEVICE, *args)`` on ``nprocs`` ranks, all on cuda:0."""
    # NCCL < 2.30 refuses two ranks on one GPU; gpu_transports then forces the ipc transport.
    kw = {"transport": gpu_transports(nprocs)[1]} if nprocs > 1 else {}
    return collectives.launch(body, nprocs, DEVICE, *args, device=DEVICE, timeout=120, **kw)
