"""Each rank binds to a device: cuda:local_rank by default, ``device=`` to override, "cpu" for none.

No GPU here: device parsing, the binding choice and the NCCL creation failure (a fake NCCL module
and a fake CUDA) are tested on the CPU; the tests that need real GPUs skip without them.
"""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np
import pytest
import torch

import collectives
from collectives._device import resolve_device
from collectives.rendezvous import LocalRendezvous
from spmd import ThreadRendezvous, on_threads

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("device,local_rank,count,expected", [
    (None, 0, 0, "cpu"), (None, 3, 0, "cpu"),
    (None, 0, 4, "cuda:0"), (None, 3, 4, "cuda:3"), (None, 5, 4, "cuda:1"),  # more ranks than GPUs: they share
    ("cuda", 2, 4, "cuda:2"), (torch.device("cuda"), 6, 4, "cuda:2"),
    (1, 0, 2, "cuda:1"), (np.int64(1), 0, 2, "cuda:1"), ("cuda:1", 0, 2, "cuda:1"), (" CUDA:1 ", 0, 2, "cuda:1"),
    (torch.device("cuda", 0), 1, 2, "cuda:0"),
    ("cpu", 1, 2, "cpu"), (torch.device("cpu"), 0, 0, "cpu"),
])
def test_resolve_device(device, local_rank, count, expected):
    assert resolve_device(device, local_rank, device_count=count) == torch.device(expected)


@pytest.mark.parametrize("device,count,error,words", [
    (0, 0, ValueError, "sees no GPU"), ("cuda", 0, ValueError, "sees no GPU"), ("cuda:0", 0, ValueError, "no GPU"),
    (2, 2, ValueError, "cuda:0 to cuda:1"), (-1, 2, ValueError, "no such CUDA device"),
    ("cuda:-1", 2, ValueError, "no such CUDA device"), ("gpu0", 2, ValueError, "device must be"),
    ("mps", 2, ValueError, "device must be"), (torch.device("meta"), 2, ValueError, "cpu and cuda"),
    (True, 2, TypeError, "bool"), (1.0, 2, TypeError, "float"), ([0], 2, TypeError, "list"),
])
def test_resolve_device_rejects(device, count, error, words):
    with pytest.raises(error, match=words):
        resolve_device(device, 0, device_count=count)


def _body_device(comm):
    return str(comm.device), str(comm.split(0).device)


@pytest.mark.skipif(GPUS > 0, reason="checks the CPU-only machine's answers")
def test_launch_and_init_device_without_a_gpu():
    assert collectives.launch(_body_device, 2) == [("cpu", "cpu")] * 2  # default: no GPU, so cpu
    assert collectives.launch(_body_device, 2, device="cpu") == [("cpu", "cpu")] * 2
    res = collectives.launch(_body_device, 2, device=0, return_exceptions=True)
    assert all(isinstance(e, ValueError) and "sees no GPU" in str(e) for e in res), res
    res = collectives.launch(_body_device, 2, device=True, return_exceptions=True)
    assert all(isinstance(e, TypeError) for e in res), res
    with collectives.init(device="cpu") as comm:
        assert comm.device == torch.device("cpu") and "nccl" not in comm.transports
    with pytest.raises(ValueError, match="sees no GPU"):
        collectives.init(device="cuda:0")


# ---- NCCL creation failure on a machine with GPUs: a fake CUDA and a fake NCCL ----------------------
def _fake_gpus(monkeypatch, count, fail_on=None):
    """torch.cuda sees ``count`` GPUs (every one the same physical GPU's UUID when count is 1), and
    NCCL's communicator creation raises what cupy raises for NCCL's 'Duplicate GPU detected' on the
    ranks in ``fail_on`` (None: every rank)."""
    import transports.nccl as nccl_mod

    made, current = [], []

    def communicator(size, uid, rank):
        made.append(rank)
        if fail_on is None or rank in fail_on:
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN for details)")
        return types.SimpleNamespace(destroy=lambda: None)

    fake = types.SimpleNamespace(get_unique_id=lambda: (1, 2, 3), get_version=lambda: 23004,
                                 NcclCommunicator=communicator)
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid=f"GPU-{torch.device(d).index % count}"))
    return made, current


def _create_on_threads(n, **kw):
    shared = {"slots": [None] * n, "barrier": threading.Barrier(n)}
    return on_threads(n, lambda r: collectives._build(ThreadRendezvous(shared, r), kw.get("transport", "auto"), 10.0,
                                                      "launch", device=kw.get("device")))


def test_nccl_duplicate_gpu_raises_on_every_rank_with_what_to_do(monkeypatch):
    made, current = _fake_gpus(monkeypatch, 1)  # two ranks, one GPU: both bind cuda:0
    res = _create_on_threads(2)
    for r in range(2):
        e = res[r]
        assert isinstance(e, RuntimeError), (r, e)
        msg = str(e)
        assert "NCCL could not start on rank(s) [0, 1]" in msg and "NCCL_ERROR_INVALID_USAGE" in msg, msg
        assert "ranks [0, 1] share a GPU" in msg and "NCCL_MULTI_RANK_GPU_ENABLE=1" in msg and "2.30" in msg, msg
        assert "2.30.4" in msg and "own GPU" in msg and "transport='ipc'" in msg and "'shm'" in msg, msg
    assert sorted(made) == [0, 1] and current == [torch.device("cuda", 0)] * 2


def test_nccl_failure_on_one_rank_raises_on_every_rank(monkeypatch):
    made, current = _fake_gpus(monkeypatch, 2, fail_on={1})  # each rank has its own GPU; rank 1's NCCL fails
    res = _create_on_threads(2)
    assert sorted(current, key=str) == [torch.device("cuda", 0), torch.device("cuda", 1)]  # cuda:local_rank
    for r in range(2):
        assert isinstance(res[r], RuntimeError) and "NCCL could not start on rank(s) [1]" in str(res[r]), res[r]
        assert "ranks [0, 1] share a GPU" not in str(res[r])


def test_nccl_failure_with_a_forced_host_transport_or_cpu_device_is_no_error(monkeypatch):
    made, _ = _fake_gpus(monkeypatch, 1)
    res = _create_on_threads(2, transport="shm")  # the user chose a host transport: NCCL is not needed
    for r in range(2):
        assert isinstance(res[r], collectives.Communicator), res[r]
        assert "nccl" not in res[r].transports and res[r].device == torch.device("cuda", 0)
        res[r].close()
    made.clear()
    res = _create_on_threads(2, device="cpu")  # no GPU: NCCL is not even tried
    for r in range(2):
        assert isinstance(res[r], collectives.Communicator) and res[r].device == torch.device("cpu"), res[r]
        res[r].close()
    assert made == []


def test_single_process_init_raises_for_nccl_failure(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="NCCL could not start on rank"):
        collectives._build(LocalRendezvous(10.0), "auto", 10.0, "single")


# ---- real GPUs --------------------------------------------------------------------------------------
def _body_gpu_binding(comm):
    return str(comm.device), torch.cuda.current_device()


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_launch_binds_each_rank_to_its_gpu():
    n = min(2, GPUS)
    res = collectives.launch(_body_gpu_binding, n, transport="shm")
    assert res == [(f"cuda:{r % GPUS}", r % GPUS) for r in range(n)]


def _body_wrong_gpu(comm):
    x = torch.ones(4, device="cuda:1" if comm.rank == 0 else comm.device)
    try:
        comm.all_reduce(x)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_a_tensor_on_another_gpu_raises_on_every_rank():
    res = collectives.launch(_body_wrong_gpu, 2)
    assert "rank 0 passed a tensor on cuda:1" in res[0] and "bound to cuda:0" in res[0], res
    assert "rejected" in res[1], res


def test_nccl_failure_with_ipc_forced_is_no_error(monkeypatch):
    # two ranks on one GPU with NCCL < 2.30 (seen on the H100): transport="ipc" asked for ipc, so the
    # failed NCCL is dropped instead of stopping the communicator
    import collectives._creation as creation
    import transports.ipc as ipc_mod
    from transports import transport_class

    class FakeIpc:
        name, devices = "ipc", ("cuda",)

        def __init__(self, group):
            self.size = group.size

        def close(self):
            pass

    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(ipc_mod, "ipc_available", lambda settings: True)
    monkeypatch.setattr(creation, "transport_class", lambda name: FakeIpc if name == "ipc" else transport_class(name))
    res = _create_on_threads(2, transport="ipc")
    for r in range(2):
        assert isinstance(res[r], collectives.Communicator), res[r]
        assert "nccl" not in res[r].transports and "ipc" in res[r].transports
        res[r].close()
    res = _create_on_threads(2)  # auto: still the loud NCCL error
    assert all(isinstance(res[r], RuntimeError) and "transport='ipc'" in str(res[r]) for r in range(2)), res


def test_benchmarks_bind_to_the_communicators_gpu():
    # bench, bench-moe, bench-tp and their torch.distributed NCCL peer use the communicator's GPU (ranks
    # may share one); cuda:local_rank only where the communicator is not on a GPU
    from types import SimpleNamespace

    from benchmarks.peers import comm_gpu

    shared = SimpleNamespace(device=torch.device("cuda", 0), local_rank=1)
    assert comm_gpu(shared) == torch.device("cuda", 0)
    on_cpu = SimpleNamespace(device=torch.device("cpu"), local_rank=3)
    assert comm_gpu(on_cpu) == torch.device("cuda", 3)


def test_benchmarks_place_tensors_and_wait_by_the_agreed_device(monkeypatch):
    # bench-moe and bench-tp: on the CPU nothing to wait for; on a GPU the communicator's GPU and a
    # device synchronisation before each clock read
    from types import SimpleNamespace

    from benchmarks import peers

    comm = SimpleNamespace(device=torch.device("cuda", 0), local_rank=1)
    dev, sync = peers.bench_placement(comm, "cpu")  # "cpu" asks no rank anything
    assert dev == torch.device("cpu") and sync() is None
    monkeypatch.setattr(peers, "bench_device", lambda c, requested: "cuda")
    dev, sync = peers.bench_placement(comm, "auto")
    assert dev == torch.device("cuda", 0) and sync is torch.cuda.synchronize
