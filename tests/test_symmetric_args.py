"""``Communicator.symmetric_empty``'s arguments (issue #51 points 7 and 15): a bad shape or dtype on any
rank makes every rank raise TypeError/ValueError naming it, before the transport's collective
allocation, and the communicator stays open; on a closed communicator symmetric_empty and the
LowLatencyDispatcher constructor say it is closed.

Over the emulated ipc transport (Triton's interpreter on the CPU), two ranks in one launch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import collectives  # noqa: E402
from transports.base import CommunicatorBrokenError  # noqa: E402


def _outcome(fn) -> tuple[str, str]:
    try:
        t = fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return "ok", str(tuple(t.shape))


def _body(comm):
    me = comm.rank
    heap = comm.transports["ipc"].symmetric_bytes
    cases = {
        "negative": lambda: comm.symmetric_empty((2, -3)),
        "minus_one": lambda: comm.symmetric_empty((-1,)),
        "dtype_str": lambda: comm.symmetric_empty((4,), "float32"),
        "float_dim": lambda: comm.symmetric_empty((4.0,)),
        "one_rank_bad": lambda: comm.symmetric_empty((4,), "float32" if me == 1 else torch.float32),
        "shapes_differ": lambda: comm.symmetric_empty((8 + me,)),
        "too_large": lambda: comm.symmetric_empty((heap + 1,), torch.uint8),
        "huge": lambda: comm.symmetric_empty((1 << 40, 1 << 30)),
    }
    out = {name: (*_outcome(fn), comm.closed) for name, fn in cases.items()}
    s = comm.symmetric_empty(5)  # then a good one works, and the communicator with it
    s.fill_(me + 1)
    comm.all_reduce(s, out=s)
    out["after"] = s.tolist()
    comm.close()
    out["closed"] = _outcome(lambda: comm.symmetric_empty((4,)))
    import moe

    out["closed_ll"] = _outcome(lambda: moe.LowLatencyDispatcher(comm, num_experts=2, max_tokens_per_rank=2,
                                                                 hidden=128, dtype=torch.float32))
    return out


def test_bad_symmetric_empty_arguments_raise_on_every_rank_and_keep_the_communicator():
    results = collectives.launch(_body, 2, transport="ipc", options={"ipc_emulate": 1}, timeout=30.0)
    for me, res in enumerate(results):
        for name in ("negative", "minus_one", "dtype_str", "float_dim", "one_rank_bad", "shapes_differ",
                     "too_large", "huge"):
            kind, msg, closed = res[name]
            assert not closed, (me, name, res[name])
            assert kind in ("TypeError", "ValueError"), (me, name, res[name])
        for name in ("negative", "minus_one", "too_large", "huge"):
            assert res[name][0] == "ValueError" and f"rank {me}" in res[name][1], (me, name, res[name])
        assert res["dtype_str"][0] == "TypeError" and "torch.dtype" in res["dtype_str"][1], res["dtype_str"]
        assert res["float_dim"][0] == "TypeError" and "shape[0]" in res["float_dim"][1], res["float_dim"]
        # the bad rank raises its own TypeError, its peer a ValueError naming it
        kind, msg, _ = res["one_rank_bad"]
        assert kind == ("TypeError" if me == 1 else "ValueError") and "rank 1" in msg, res["one_rank_bad"]
        kind, msg, _ = res["shapes_differ"]
        assert kind == "ValueError" and "rank 0: (8,)" in msg and "rank 1: (9,)" in msg, res["shapes_differ"]
        assert res["after"] == [3.0] * 5, res["after"]
        for name in ("closed", "closed_ll"):  # closed, as every call says: not that ipc needs CUDA or emulation
            assert res[name][0] == CommunicatorBrokenError.__name__ and "closed" in res[name][1], res[name]
