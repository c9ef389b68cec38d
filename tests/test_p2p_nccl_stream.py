"""GPU-free check of the CUDA stream contract of NCCL point-to-point (transports/_p2p_nccl.py,
collectives/_p2p.py), torch's ProcessGroupNCCL's: a data step is ordered after what the caller's
stream had queued at *post* time (not the stream current when a later wait enqueues it), every
buffer it uses gets ``record_stream`` for the stream it runs on, a non-contiguous receive is copied
back on that stream before the completion event, and ``wait()`` makes the then-current stream wait
on that event.

Two ranks over shm run the real handshakes; CUDA is faked in each rank: tensors that say they are
on cuda:0 (CPU tensors underneath), streams and events that log what is done with them, and an nccl
transport whose ``send``/``recv`` log the stream they were enqueued on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from spmd import UNDER_MPI

import collectives

LOG: list[tuple] = []  # one rank's record of stream operations, in order
_CURRENT: list[Any] = []  # the fake current-stream stack
_NAMES = itertools.count(1)


class _Stream:
    def __init__(self, name: str):
        self.name = name
        self.cuda_stream = 0x1000 + len(_BY_HANDLE)  # the handle cupy's nccl calls get
        _BY_HANDLE[self.cuda_stream] = name

    def wait_event(self, event: _Event) -> None:
        LOG.append(("wait", self.name, event.name))


_BY_HANDLE: dict[int, str] = {}


class _Event:
    def __init__(self, *args: Any, **kwargs: Any):
        self.name = f"e{next(_NAMES)}"

    def record(self, stream: _Stream | None = None) -> None:
        LOG.append(("record", (stream or _CURRENT[-1]).name, self.name))

    def query(self) -> bool:
        return True


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 and logs the calls whose stream matters."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        LOG.append(("record_stream", self.data_ptr(), stream.name))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            LOG.append(("contiguous", _CURRENT[-1].name))
        elif func is torch.Tensor.copy_:
            LOG.append(("copy", _CURRENT[-1].name, args[0].data_ptr()))
        return super().__torch_function__(func, types, args, kwargs or {})


@contextmanager
def _on(stream: _Stream) -> Iterator[None]:
    _CURRENT.append(stream)
    try:
        yield
    finally:
        _CURRENT.pop()


class _FakeNcclComm:
    def send(self, ptr: int, n: int, dtype: int, peer: int, stream: int) -> None:
        LOG.append(("send", _BY_HANDLE[stream], ptr))

    def recv(self, ptr: int, n: int, dtype: int, peer: int, stream: int) -> None:
        LOG.append(("recv", _BY_HANDLE[stream], ptr))


class _FakeNcclModule:
    @staticmethod
    def groupStart() -> None:  # noqa: N802 - cupy's names
        LOG.append(("groupStart",))

    @staticmethod
    def groupEnd() -> None:  # noqa: N802
        LOG.append(("groupEnd",))


class _FakeNccl:
    """Stands in for the nccl transport (transports/nccl.py): ``nccl`` and ``comm`` as cupy's."""

    name = "nccl"

    def __init__(self) -> None:
        self.nccl, self.comm = _FakeNcclModule(), _FakeNcclComm()

    def close(self) -> None:
        pass

    def abort(self, why: str) -> None:
        pass


def _stream_body(comm) -> dict:
    """Post under stream s1 (a non-contiguous isend, then a batch: a non-contiguous irecv, a
    contiguous irecv and a contiguous isend), wait under s2; return the log and the tensors' pointers."""
    fakes = {"current_stream": lambda device=None: _CURRENT[-1], "Event": _Event,
             "Stream": lambda device=None, priority=0: _Stream(f"side{next(_NAMES)}"), "stream": _on}
    saved = {k: getattr(torch.cuda, k) for k in fakes}
    saved_comm = comm._forced, comm.device
    for k, v in fakes.items():
        setattr(torch.cuda, k, v)
    comm._forced, comm.device = None, torch.device("cuda", 0)  # let CUDA-looking tensors take the NCCL path
    comm.transports["nccl"] = _FakeNccl()
    # no group split by the grace after which a wait enqueues what is agreed so far (a loaded machine)
    import collectives._p2p as p2p_mod

    p2p_mod._NCCL_GRACE = 60.0
    peer = 1 - comm.rank
    s1, s2 = _Stream("s1"), _Stream("s2")
    try:
        with _on(s1):
            x = torch.arange(48.0).reshape(4, 12).as_subclass(_FakeCuda)
            y = torch.arange(10.0).as_subclass(_FakeCuda)
            out = torch.zeros(4, 12).as_subclass(_FakeCuda)
            out_c = torch.zeros(10).as_subclass(_FakeCuda)
            works = [comm.isend(x[:, ::2], peer, tag=1)]
            works += comm.batch_isend_irecv([collectives.P2POp("irecv", out[:, ::2], peer, 1),
                                             collectives.P2POp("irecv", out_c, peer, 2),
                                             collectives.P2POp("isend", y, peer, 2)])
        with _on(s2):  # the default stream, say: a wait enqueues the steps while it is current
            for w in works:
                w.wait()
    finally:
        comm.transports.pop("nccl")
        comm._forced, comm.device = saved_comm
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
    return {"log": list(LOG), "out": out.data_ptr(), "y": y.data_ptr()}


def _check(res: dict) -> None:
    """The log against the contract. The isend may go in a group of its own, before the batch (its
    peer answered it before the batch was posted) or in the batch's: both are checked per group."""
    log, out_ptr, y_ptr = res["log"], res["out"], res["y"]
    at = {e: i for i, e in enumerate(log)}
    calls = [(i, e) for i, e in enumerate(log) if e[0] in ("send", "recv")]
    assert sorted(e[0] for _, e in calls) == ["recv", "recv", "send", "send"], log
    streams = {e[1] for _, e in calls}
    assert len(streams) == 1, f"the NCCL groups run on one stream: {calls}"
    (p2p,) = streams
    starts = [i for i, e in enumerate(log) if e == ("groupStart",)]
    ends = [i for i, e in enumerate(log) if e == ("groupEnd",)]
    assert len(starts) == len(ends) and all(a < b for a, b in zip(starts, ends)), log

    def group(i: int) -> int:
        return next(g for g, (a, b) in enumerate(zip(starts, ends)) if a < i < b)

    posted = [e for e in log if e[0] == "record" and e[1] == "s1"]
    assert len(posted) == 2, f"one event per posting call (isend, batch_isend_irecv): {log}"
    # recorded after the non-contiguous send's contiguous() copy (the receive's buffer needs no copy in)
    assert [e for e in log if e[0] == "contiguous"] == [("contiguous", "s1")], log
    assert at[("contiguous", "s1")] < at[posted[0]], log
    batch = group(next(i for i, e in calls if e[0] == "send" and e[2] == y_ptr))
    for i, (kind, _, ptr) in calls:
        g = group(i)
        first_send = kind == "send" and ptr != y_ptr  # the isend of x[:, ::2]; the others are the batch's
        assert first_send or g == batch, f"the batch's steps go in one group: {log}"
        # the bug this guards against: the steps ran on s2 (current at progress time), after no event of s1
        ev = posted[0 if first_send else 1][2]
        assert at.get(("wait", p2p, ev), starts[g]) < starts[g], (
            f"{kind} on {p2p} must wait on the event recorded on s1 when it was posted ({ev}): {log}")
        assert at.get(("record_stream", ptr, p2p), starts[g]) < starts[g], f"{kind} buffer {ptr} lacks record_stream"
    copy = ("copy", p2p, out_ptr)  # the non-contiguous receive copied back on the p2p stream, after its group
    assert ends[batch] < at.get(copy, -1), f"the copy-back runs on {p2p} after the group: {log}"
    assert at[copy] < at.get(("record_stream", out_ptr, p2p), -1), log
    # one completion event per group, after it (the batch's after the copy-back); wait() on s2 waits on it
    done = []
    for g, b in enumerate(ends):
        nxt = starts[g + 1] if g + 1 < len(starts) else len(log)
        recs = [e for e in log[b:nxt] if e[0] == "record" and e[1] == p2p]
        assert len(recs) == 1, f"one completion event after group {g}: {log}"
        done.append(recs[0])
    assert at[done[batch]] > at[copy], log
    x_group = group(next(i for i, e in calls if e[0] == "send" and e[2] != y_ptr))
    waits = [e for e in log if e[0] == "wait" and e[1] == "s2"]
    expect = [("wait", "s2", done[x_group][2])] + [("wait", "s2", done[batch][2])] * 3
    assert waits == expect, f"wait() on s2 waits on its op's completion event: {log}"


@pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks")
def test_nccl_steps_wait_on_the_stream_of_post_time_and_wait_orders_the_current_stream():
    for res in collectives.launch(_stream_body, 2, transport="shm", timeout=60.0):
        _check(res)
