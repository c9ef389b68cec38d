"""A rank that rejects its own input for an ipc call (#51 item 8), in emulation: its peers raise
ValueError in that call, at once, and the communicator stays usable, whichever way the peers' call
meets (transports.ipc.IPCTransport.reject_call): the host comparison of a signature's first call,
the Lamport kernel (no barrier: a rejecting header), or a barrier kernel (exchange_meta's).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

import collectives  # noqa: E402


def _inputs(seed: int, rank: int, shape: tuple) -> tuple:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g), torch.rand(shape[-1], generator=g) + 0.5


def _body(comm, case: str):
    """Calls 0..2 of one kind; rank 1 rejects call ``bad``. Per call: the result or the error."""
    me, out = comm.rank, []
    shape = (64, 1024) if case == "barrier" else (4, 256)  # 256 KiB: past the Lamport slots
    bad = 0 if case == "first_call" else 1
    for c in range(3):
        x, res, w = _inputs(300 + c, me, shape)
        t0 = time.monotonic()
        try:
            if case == "rmsnorm_eps":
                y = comm.all_reduce_rmsnorm(x, res, w, eps=-1.0 if (c, me) == (bad, 1) else 1e-6)[1]
            else:
                o = torch.empty(shape[0] + 1, shape[1]) if (c, me) == (bad, 1) else torch.empty(shape)
                y = comm.all_reduce(x, out=o)
            out.append(("ok", y.clone()))
        except ValueError as e:
            out.append(("ValueError", str(e), time.monotonic() - t0))
    return out


@pytest.mark.parametrize("case", ["lamport_out", "rmsnorm_eps", "barrier", "first_call"])
def test_a_rank_that_rejects_its_input_makes_its_peers_raise_in_that_call_and_the_next_call_works(case):
    res = collectives.launch(_body, 2, case, transport="ipc", timeout=20.0, options={"ipc_emulate": 1})
    bad = 0 if case == "first_call" else 1
    for r in range(2):
        kinds = [o[0] for o in res[r]]
        assert kinds == ["ValueError" if c == bad else "ok" for c in range(3)], (r, res[r])
        assert res[r][bad][2] < 5.0, res[r][bad]  # at once, not at the 20 s timeout
    assert "rank(s) [1] rejected their input" in res[0][bad][1], res[0][bad]
    assert ("eps=-1.0" if case == "rmsnorm_eps" else "out has shape") in res[1][bad][1], res[1][bad]
    shape = (64, 1024) if case == "barrier" else (4, 256)
    for c in range(3):
        if c == bad:
            continue
        ins = [_inputs(300 + c, q, shape) for q in range(2)]
        total = ins[0][0] + ins[1][0]
        if case == "rmsnorm_eps":  # the residual-added sum (this rank's residual), as returned
            for q in range(2):
                torch.testing.assert_close(res[q][c][1], total + ins[q][1], rtol=1e-5, atol=1e-5)
        else:
            for q in range(2):
                torch.testing.assert_close(res[q][c][1], total, rtol=1e-5, atol=1e-5)


def _lazy_reject(group):
    """GPU behaviour (eager_check=False): rank 1 rejects a Lamport all_reduce; rank 0's call returns
    and its next call finds the rejection. Per rank: what its next call raised, and how long it took."""
    from transports.base import OpCode, ReduceOp, Signature
    from transports.ipc import IPCTransport

    t = IPCTransport(group, eager_check=False)
    x = torch.randn(256)
    sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
    t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)  # the signature agreed on the host
    t.synchronize()
    if group.rank == 1:
        t.reject_call(sig, x)
    else:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)  # returns: the rejection is read later
    t0 = time.monotonic()
    try:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
        t.synchronize()
        outcome = ("no error", "")
    except Exception as e:  # noqa: BLE001 - inspected by the test
        outcome = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    t.close()
    return outcome, took


def test_a_rejection_read_after_its_call_returned_closes_the_transport_on_every_rank_promptly():
    """Read at a later call's start, a rank would raise at another call than its peers and leave
    them waiting: the transport ends for every rank instead, and nobody waits for the timeout."""
    from ipc_harness import run_ranks

    res = run_ranks(_lazy_reject, 2, timeout=30.0)
    assert [r[0] for r in res] == ["ok", "ok"], res
    (kind0, msg0), took0 = res[0][1]
    assert kind0 == "ValueError" and "rank(s) [1] rejected their input" in msg0 and "is closed" in msg0, msg0
    (kind1, msg1), took1 = res[1][1]
    assert kind1 == "PeerFailedError" and "rank 0" in msg1, msg1
    assert took0 < 5.0 and took1 < 10.0, (took0, took1)
