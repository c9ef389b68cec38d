"""IPCTransport.close()/abort() with kernels still in flight (issue #50, point 4), in emulation.

close() must set our STATE and ABORT words first, wait (bounded) for our kernels to end, and only
then stop the watchdog and unmap; when they do not end within the bound it keeps the regions
mapped (leaked) instead of unmapping them under a kernel. Emulated launches return when their
kernel has ended, so the kernel in flight is simulated: a thread that ends once our ABORT word is
set, seen through the provider's stream probe (the GPU's event) or through the host's launch count
against DONE (the GPU path's count), or a real kernel spinning in a thread on a peer that is away.
tests/test_ipc_close_gpu.py is the same on a GPU.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks  # noqa: E402
from spmd import mark_done, wait_done  # noqa: E402
from transports.base import OpCode, PeerFailedError, Signature  # noqa: E402

BUF = 4096


def _close_in_flight(group, how: str, flags: str) -> dict:
    """Rank 0 closes with a simulated kernel in flight; returns what happened, in order.

    how: "probe" (the kernel is seen by the provider's stream probe), "count" (by the launch count
    against DONE, as on a GPU), "never" (it never ends: close must give up at the bound and leak),
    "finishes" (it ends by itself within close()'s grace, before any ABORT).
    """
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group, buffer_bytes=BUF)
    t.peer_region(1 << 16)  # a second provider: it must follow the same order
    me = group.rank
    if me != 0:
        # away (alive, not closed) until rank 0 is done: a peer that left would not change rank 0's close
        wait_done(flags, [0])
        t.close()
        return {}
    events: list[tuple] = []
    regions = t._regions
    write = regions.write

    def recording_write(r: int, word: int, value: int) -> None:
        if r == me and word in (L.STATE, L.ABORT):
            events.append(("write", {L.STATE: "STATE", L.ABORT: "ABORT"}[word], value))
        write(r, word, value)

    regions.write = recording_write
    for i, reg in enumerate([*t._more_regions, regions]):
        def recording_close(close=reg.close, i=i) -> None:
            events.append(("unmap", i))
            close()
        reg.close = recording_close
    join = t._watchdog.join
    t._watchdog.join = lambda timeout=None: (events.append(("watchdog stopped",)), join(timeout))

    ended = threading.Event()

    def kernel() -> None:  # gives up once our ABORT word is set, as an aborted wait does, a little later
        if how == "finishes":  # its peers are there: it ends by itself, within close()'s grace
            time.sleep(0.1)
            events.append(("kernel ended",))
            ended.set()
            return
        while regions.read(me, L.ABORT, 1)[0] == 0:
            time.sleep(0.005)
        if how == "never":
            return
        time.sleep(0.3)
        events.append(("kernel ended",))
        if how == "count":
            t._status[L.S_DONE : L.S_DONE + t.programs] += 1  # what the kernel's done() writes
        ended.set()

    if how == "count":
        t.emulate = False  # the GPU path of _in_flight: the host's count against DONE
        t._launched += 1
        regions.stream_probe = lambda: (lambda: True)
    else:
        regions.stream_probe = lambda: ended.is_set
    if how == "never":
        IPCTransport._DRAIN_SECONDS = 0.5
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transports.ipc").addHandler(handler)
    threading.Thread(target=kernel, daemon=True).start()
    t0 = time.monotonic()
    t.close()
    took = time.monotonic() - t0
    logging.getLogger("transports.ipc").removeHandler(handler)
    mark_done(flags, 0)
    leaked = any(regions in entry[0] for entry in getattr(IPCTransport, "_leaked", []))
    return {"events": events, "took": took, "mapped": regions._map is not None, "leaked": leaked,
            "warnings": [w for w in warnings if "leaked" in w]}


@pytest.mark.parametrize("how", ["probe", "count"])
def test_close_aborts_then_waits_for_the_kernels_then_unmaps(how, tmp_path):
    from transports.kernels import layout as L

    results = run_ranks(_close_in_flight, 2, how, str(tmp_path), timeout=60.0)
    assert [r[0] for r in results] == ["ok", "ok"], results
    got = results[0][1]
    # STATE aborted (it abandons a kernel: see close()) and ABORT set before anything else,
    # the kernel's end awaited, then the watchdog stopped, then both providers unmapped
    assert got["events"] == [("write", "STATE", L.STATE_ABORTED), ("write", "ABORT", 1), ("kernel ended",),
                             ("watchdog stopped",), ("unmap", 0), ("unmap", 1)], got
    assert 0.3 <= got["took"] < 3.0, got
    assert not got["mapped"] and not got["leaked"] and not got["warnings"], got


def test_close_gives_up_at_the_bound_and_leaks_instead_of_unmapping(tmp_path):
    from transports.kernels import layout as L

    results = run_ranks(_close_in_flight, 2, "never", str(tmp_path), timeout=60.0)
    assert [r[0] for r in results] == ["ok", "ok"], results
    got = results[0][1]
    assert got["events"] == [("write", "STATE", L.STATE_ABORTED), ("write", "ABORT", 1), ("watchdog stopped",)], got
    assert 0.5 <= got["took"] < 3.0, got
    assert got["mapped"] and got["leaked"] and len(got["warnings"]) == 1, got


def test_close_lets_a_call_in_flight_finish_within_its_grace_and_then_closes_cleanly(tmp_path):
    """As ncclCommDestroy completes its operations: a call whose peers are there is not abandoned."""
    from transports.kernels import layout as L

    results = run_ranks(_close_in_flight, 2, "finishes", str(tmp_path), timeout=60.0)
    assert [r[0] for r in results] == ["ok", "ok"], results
    got = results[0][1]
    assert got["events"] == [("kernel ended",), ("write", "STATE", L.STATE_CLOSED), ("write", "ABORT", 1),
                             ("watchdog stopped",), ("unmap", 0), ("unmap", 1)], got
    assert got["took"] < 0.5 and not got["mapped"] and not got["leaked"], got


def _failed_launch(group) -> tuple:
    """A launch that raises before its kernel runs (here: a compile error) is not counted in flight."""
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    before = (t._launched, t._busy())

    def broken(*args, **kwargs):
        raise RuntimeError("compile error")

    bind, t._bind = t._bind, lambda kernel, const: broken
    try:
        t.barrier(Signature.of(OpCode.BARRIER))
        raised = False
    except RuntimeError:
        raised = True
    t._bind = bind
    after = (t._launched, t._busy())
    t.barrier(Signature.of(OpCode.BARRIER))  # the transport still works
    t.close()
    return raised, before, after


def test_a_launch_that_raises_is_not_counted_as_a_kernel_in_flight():
    for r in run_ranks(_failed_launch, 2, timeout=30.0):
        assert r[0] == "ok", r
        raised, before, after = r[1]
        assert raised and after == before and not after[1], r


def _spinning_kernel_then_close(group, flags: str) -> tuple:
    """Rank 0's barrier kernel spins (in a thread) on rank 1, who is away; rank 0 closes at once.
    Rank 1 then calls the barrier and must raise promptly, naming rank 0."""
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group, buffer_bytes=BUF)
    sig = Signature.of(OpCode.BARRIER)
    t.barrier(sig)  # both ranks, once
    if group.rank == 1:
        wait_done(flags, [0])  # away (alive, not closed) until rank 0 has closed
        state, abort = (int(w) for w in t._regions.read(0, L.STATE, 2))
        t0 = time.monotonic()
        try:
            t.barrier(sig)
            return ("no error", state, abort)
        except PeerFailedError as e:
            return (type(e).__name__, str(e), time.monotonic() - t0, state, abort)
        finally:
            mark_done(flags, 1)
            t.close()
    t.eager_check = False  # the launching thread reads no status after its kernel: close() may be unmapping
    call = threading.Thread(target=t.barrier, args=(sig,), daemon=True)
    call.start()
    # the GPU's stream event, here: the launch (and its kernel) has returned
    t._regions.stream_probe = lambda: (lambda: not call.is_alive())
    deadline = time.monotonic() + 30
    while not t._busy() and time.monotonic() < deadline:  # launched (counted), not DONE: spinning on rank 1
        time.sleep(0.01)
    time.sleep(0.3)
    spinning = t._busy()
    t0 = time.monotonic()
    t.close()
    took = time.monotonic() - t0
    kernel_ended = not call.is_alive()
    mark_done(flags, 0)
    wait_done(flags, [1])  # alive until rank 1 has seen the close
    return ("closed", spinning, took, kernel_ended, t._regions._map is None)


def test_close_while_a_kernel_spins_on_an_absent_peer(tmp_path):
    from transports.kernels import layout as L

    results = run_ranks(_spinning_kernel_then_close, 2, str(tmp_path), timeout=30.0)
    assert results[0][0] == "ok", results[0]  # not killed by a kernel touching unmapped memory
    _, spinning, took, kernel_ended, unmapped = results[0][1]
    assert spinning and kernel_ended and unmapped, results[0]
    assert took < 2.0, took
    assert results[1][0] == "ok", results[1]
    kind, msg, waited, state, abort = results[1][1]
    assert (state, abort) == (L.STATE_ABORTED, 1), results[1]
    # rank 0's aborted kernel advanced its epoch: STATE closed would read as a call it finished
    assert kind == "PeerFailedError" and "rank 0" in msg and waited < 5.0, results[1]
