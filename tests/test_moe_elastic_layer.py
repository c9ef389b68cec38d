"""MoELayer's elastic EP in one launch (issue #55): decode over the low-latency dispatcher equals forward,
per-call masks line up with shrink, and the errors of shrink / grow / decode reach every rank.

The loss of a rank itself, the shrink, the grow with a newcomer and the equality with the one-process
model run end to end in tests/test_elastic_moe.py (examples/elastic_moe.py).
"""

from __future__ import annotations

import pytest
import torch

import collectives
from moe import MoELayer
from spmd import UNDER_MPI, left_behind, outcome, run_checks, shm_segments

pytestmark = [pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
pytest.importorskip("triton")

H, F, E, K, M = 128, 48, 6, 2, 4


def _layer(comm, **kw) -> MoELayer:
    return MoELayer(comm, H, F, E, K, seed=3, shared_ffn_hidden_size=16, **kw)


def _x(comm, step: int, n: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + comm.rank)
    n = int(torch.randint(0, M + 1, (1,), generator=g)) if n is None else n
    return torch.randn(n, H, generator=g)


def _decode_equals_forward(comm) -> int:
    """decode (float32, and FP8 close) equals forward on random token counts, with and without EPLB."""
    for R in (0, 3):
        layer = _layer(comm, num_redundant_experts=R)
        layer.init_low_latency(M, dtype=torch.float32)
        for step in range(3):
            x = _x(comm, step)
            torch.testing.assert_close(layer.decode(x), layer(x)[0], atol=1e-5, rtol=1e-5)
        x = _x(comm, 9, M)
        y8, y = layer.decode(x, use_fp8=True), layer(x)[0]
        assert float((y8 - y).norm() / y.norm()) < 0.1  # e4m3 keeps 3 mantissa bits
        layer.close()
    return 0


def _shrink_equals_masks(comm) -> int:
    """After shrink(exclude=[last]) on the others, forward and decode equal the same calls with the last
    rank masked per call in a layer that did not shrink (the dispatchers' masks)."""
    last = comm.size - 1
    a, b = _layer(comm, num_redundant_experts=3), _layer(comm, num_redundant_experts=3)
    a.init_low_latency(M, dtype=torch.float32)
    b.init_low_latency(M, dtype=torch.float32)
    if comm.rank != last:
        a.shrink(exclude=[last])
        assert a.masked_ranks == (last,) and a.low_latency.masked_ranks == (last,)
        x = _x(comm, 4)
        y = a(x)[0]
        torch.testing.assert_close(a.decode(x), y, atol=1e-5, rtol=1e-5)
        # the same routing by hand: the slots on the masked rank rerouted to replicas or dropped
        from moe.eplb import route

        w, chosen, _ = b.router.route(x)
        slots = route(chosen, b.placement, offset=comm.rank, masked_ranks=[last])
        recv, counts, handle = b.dispatcher.dispatch(x, slots, weights=w.detach(), masked_ranks=[last])
        ref = b.dispatcher.combine(b.experts(recv, counts), handle, w) + b.shared(x)
        torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
        assert handle.masked_ranks == (last,)
    a.close()
    b.close()
    return 0


def _errors(comm) -> dict:
    """What each rank raised for each misuse."""
    out = {}
    out["bad on_peer_failure"] = outcome(lambda: _layer(comm, on_peer_failure="retry" if comm.rank == 1 else "raise"))
    layer = _layer(comm)
    out["decode before init"] = outcome(lambda: layer.decode(_x(comm, 0)))
    out["grow without masks"] = outcome(lambda: layer.grow(comm))
    layer.init_low_latency(M, dtype=torch.float32)
    out["decode bad x on rank 1"] = outcome(lambda: layer.decode(_x(comm, 1) if comm.rank != 1 else torch.ones(2, 5)))
    out["decode after"] = outcome(lambda: layer.decode(_x(comm, 2)))
    layer.close()
    etp = _layer(comm, expert_tp_size=comm.size)
    out["shrink with ETP"] = outcome(lambda: etp.shrink(exclude=[0] if comm.rank else [1]))
    etp.close()
    return out


_CHECKS = {"decode": _decode_equals_forward, "masks": _shrink_equals_masks, "errors": _errors}


def _all_checks(comm):
    return run_checks(_CHECKS, comm)


@pytest.fixture(scope="module")
def results():
    before = shm_segments()
    res = collectives.launch(_all_checks, 3, timeout=20.0, options={"ipc_emulate": 1})
    assert not left_behind(before)
    return res


@pytest.mark.parametrize("name", ["decode", "masks"])
def test_checks(results, name):
    for r, res in enumerate(results):
        status, what = res[name]
        assert status == "ok", f"rank {r}:\n{what}"


def test_errors_reach_every_rank(results):
    errs = [res["errors"] for res in results]
    assert all(s == "ok" for s, _ in errs), errs
    errs = [what for _, what in errs]
    for e in errs:
        kind, msg = e["bad on_peer_failure"]
        assert kind == "ValueError" and "on_peer_failure" in msg, e
        kind, msg = e["decode before init"]
        assert kind == "RuntimeError" and "init_low_latency" in msg, e
        kind, msg = e["grow without masks"]
        assert kind == "ValueError" and "no masked ranks" in msg, e
        kind, msg = e["decode bad x on rank 1"]
        assert kind in ("ValueError", "TypeError") and "rank 1" in msg, e
        assert e["decode after"] == ("ok", ""), e
        assert e["shrink with ETP"][0] == "NotImplementedError", e
