"""ipc in the library: size-routed selection for CUDA tensors, the P2P probe at creation, and the
first-call signature agreement over the rendezvous that keeps size-routed ranks from waiting in
different transports. The CUDA paths cannot run here; what they decide is tested with stand-ins
and with the emulated transport switched into the CUDA behaviour."""

from __future__ import annotations

import pytest
import torch

import collectives
from collectives.selection import IPC_MAX_BYTES, choose_transport, ipc_max_bytes
from ipc_harness import run_ranks
from transports.base import OpCode, ReduceOp, Signature

pytest.importorskip("triton")


class _Fake:
    def __init__(self, devices, size=4):
        self.devices, self.size = devices, size


# The GPU sweep IPC_MAX_BYTES comes from (2 ranks on one H100 under MPS, NCCL 2.30.7, 8 B to 128 MiB).
GPU_CROSSOVER_RECORD = "benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-mps-nccl2.30.7-bench.json"


def test_the_measured_table_sends_no_cuda_call_to_ipc():
    # the GPU record's crossover is "never" (see the next test): every CUDA call goes to NCCL
    avail = {"ipc": _Fake(("cuda",), 2), "nccl": _Fake(("cuda",), 2), "shm": _Fake(("cpu",), 2)}
    for op in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER):
        assert ipc_max_bytes(op, 2) == 0
        for nbytes in (8, 4096, 1 << 20):
            assert choose_transport(op, "cuda", True, avail, None, nbytes=nbytes)[0] == "nccl"
    assert choose_transport(OpCode.ALL_REDUCE, "cuda", True, avail, "ipc", nbytes=8)[0] == "ipc"  # forced


def test_the_table_holds_what_the_gpu_record_measured():
    """IPC_MAX_BYTES is the crossover of the model fitted on the committed GPU sweep: re-derive it."""
    from pathlib import Path

    from collectives.model.calibrate import calibrate, crossover_bytes, fitted_time_us

    record = Path(__file__).resolve().parent.parent / GPU_CROSSOVER_RECORD
    system = calibrate(str(record), name="gpu-record")
    for op, ipc_alg in ((OpCode.ALL_REDUCE, "ipc/one_shot"), (OpCode.ALL_GATHER, "ipc/pull"),
                        (OpCode.REDUCE_SCATTER, "ipc/pull_reduce")):
        name = op.name.lower()
        assert fitted_time_us(system, name, ipc_alg, 8, ranks=2) > fitted_time_us(system, name, "moecomm-nccl/nccl", 8,
                                                                                 ranks=2)
        assert crossover_bytes(system, name, ipc_alg, "moecomm-nccl/nccl", ranks=2) is None  # nccl faster throughout
        assert IPC_MAX_BYTES[(op, "any")][2] == 0


def test_cuda_calls_go_to_ipc_up_to_the_table_and_to_nccl_above(monkeypatch):
    avail = {"ipc": _Fake(("cuda",)), "nccl": _Fake(("cuda",)), "shm": _Fake(("cpu",))}
    limit = 8 << 20  # a table that sends small calls to ipc (the mechanism, for a faster ipc host path)
    for op in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER):
        monkeypatch.setitem(IPC_MAX_BYTES, (op, "any"), {n: limit for n in range(2, 9)})
    assert ipc_max_bytes(OpCode.ALL_REDUCE, 4) == limit
    for op in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER):
        assert choose_transport(op, "cuda", True, avail, None, nbytes=1024)[0] == "ipc"
        assert choose_transport(op, "cuda", True, avail, None, nbytes=limit)[0] == "ipc"
        assert choose_transport(op, "cuda", True, avail, None, nbytes=limit + 1)[0] == "nccl"
    # never by size: all_to_all (sizes differ by design), broadcast, host tensors, several nodes
    assert choose_transport(OpCode.ALL_TO_ALL, "cuda", True, avail, None, nbytes=None)[0] == "nccl"
    assert choose_transport(OpCode.BROADCAST, "cuda", True, avail, None, nbytes=8)[0] == "nccl"
    assert choose_transport(OpCode.ALL_REDUCE, "cpu", True, avail, None, nbytes=8)[0] == "shm"
    assert choose_transport(OpCode.ALL_REDUCE, "cuda", False, avail, None, nbytes=8)[0] == "nccl"
    # emulated ipc serves CPU tensors and is never chosen by auto; forcing still works
    emulated = {"ipc": _Fake(("cpu",)), "shm": _Fake(("cpu",))}
    assert choose_transport(OpCode.ALL_REDUCE, "cpu", True, emulated, None, nbytes=8)[0] == "shm"
    assert choose_transport(OpCode.ALL_REDUCE, "cpu", True, emulated, "ipc", nbytes=8)[0] == "ipc"
    # world sizes outside the table: no ipc
    assert choose_transport(OpCode.ALL_REDUCE, "cuda", True, {**avail, "ipc": _Fake(("cuda",), 16)}, None,
                            nbytes=8)[0] == "nccl"


def _probe_with_a_broken_peer_read(group, liar):
    from transports.ipc import IPCTransport

    if group.rank == liar:  # this rank's reads of peer buffers come back wrong
        real = IPCTransport.all_gather

        def wrong(self, send, out, sig):
            real(self, send, out, sig)
            out[(group.rank + 1) % group.size] += 1

        IPCTransport.all_gather = wrong
    try:
        IPCTransport(group)
        return "up"
    except RuntimeError as e:
        return str(e)


def test_p2p_probe_fails_creation_on_a_rank_that_reads_wrong_data():
    results = run_ranks(_probe_with_a_broken_peer_read, 3, 1, timeout=30.0)
    assert [r[0] for r in results] == ["ok"] * 3, results
    assert results[0][1] == "up" and results[2][1] == "up", results
    assert "ipc P2P probe failed on rank 1" in results[1][1] and "rank(s) [2]" in results[1][1], results


def _mismatched_sizes_with_host_agreement(group):
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group)
    t._agree_on_host = True  # what the CUDA provider does
    before = t._regions.read(group.rank, L.EPOCH, 1).tolist()
    n = 5 + group.rank  # sizes wrongly differ across ranks
    x = torch.randn(n)
    sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
    try:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
        return "no error"
    except ValueError as e:
        # raised by the host exchange before any kernel ran (the in-kernel check would raise the same
        # ValueError, but only after its barriers: the host check is what meets a peer sitting in nccl)
        return str(e), t._regions.read(group.rank, L.EPOCH, 1).tolist() == before
    finally:
        t.close()


def test_first_call_agreement_over_the_rendezvous_names_the_difference():
    results = run_ranks(_mismatched_sizes_with_host_agreement, 2, timeout=30.0)
    assert len(results) == 2 and all(r[0] == "ok" and "shape differs (rank 0: (5), rank 1: (6))" in r[1][0]
                                     and r[1][1] for r in results), results


def test_host_tensors_leave_a_forced_gpu_transport_for_the_host_chain():
    # transport="nccl"/"ipc" on GPUs forces the device tensors; host tensors (MoE's count exchange,
    # agreement checks) cannot go to a GPU transport and take the host chain, whatever is forced
    avail = {"ipc": _Fake(("cuda",), 2), "nccl": _Fake(("cuda",), 2), "shm": _Fake(("cpu",), 2)}
    for forced in ("ipc", "nccl"):
        for op in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.ALL_TO_ALL, OpCode.BROADCAST):
            name, reason = choose_transport(op, "cpu", True, avail, forced, nbytes=64)
            assert name == "shm" and f"{forced!r} is forced" in reason, (forced, op, name, reason)
            assert choose_transport(op, "cuda", True, avail, forced, nbytes=64)[0] == forced
    # across nodes the host chain is mpi > gloo; a host transport forced still stages CUDA tensors
    multi = {"nccl": _Fake(("cuda",), 2), "mpi": _Fake(("cpu",), 2)}
    assert choose_transport(OpCode.ALL_REDUCE, "cpu", False, multi, "nccl", nbytes=8)[0] == "mpi"
    assert choose_transport(OpCode.ALL_REDUCE, "cuda", True, avail, "shm", nbytes=8)[0] == "shm"
    with pytest.raises(RuntimeError, match="no transport can serve cpu"):
        choose_transport(OpCode.ALL_REDUCE, "cpu", True, {"nccl": _Fake(("cuda",), 2)}, "nccl", nbytes=8)


def _host_calls_under_forced_gpu_ipc(comm):
    comm.transports["ipc"].devices = ("cuda",)  # the emulated transport as it is on a GPU
    comm._forget_calls()
    x = torch.arange(5, dtype=torch.float64) * (comm.rank + 1.5)
    plan = comm.plan("all_reduce", x)
    counts = [comm.rank + 1 + d for d in range(comm.size)]
    a2a = comm.all_to_all(torch.full((sum(counts), 2), float(comm.rank)), send_counts=counts)
    return plan.transport, plan.staged_through_host, comm.all_reduce(x).tolist(), a2a[:, 0].tolist()


def test_a_communicator_forced_onto_gpu_ipc_serves_host_tensors_through_shm():
    res = collectives.launch(_host_calls_under_forced_gpu_ipc, 2, transport="ipc", timeout=60.0,
                             options={"ipc_emulate": 1})
    for r, (name, staged, total, got) in enumerate(res):
        assert (name, staged) == ("shm", False)
        assert total == [i * (1.5 + 2.5) for i in range(5)]
        assert got == [float(src) for src in range(2) for _ in range(src + 1 + r)]
