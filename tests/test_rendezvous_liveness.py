"""Rendezvous waits (issue #51 points 10 and 11): ``split()`` and a dispatcher's construction wait in the
store rendezvous; Ctrl-C reaches such a wait at once, the peers of an interrupted rank raise promptly
naming it (it stays alive: its pid is not what tells them), a rank killed there is noticed within about
a second instead of at the timeout, and an unreachable store is a PeerFailedError, never torch's raw
DistNetworkError.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch

import collectives
from collectives import PeerFailedError, RankFailedError
from spmd import mark_done, wait_done

TIMEOUT = 30.0
PROMPT = 3.0  # a peer's failure must be seen well before the timeout


def _wait_in(comm, what: str) -> None:
    """The collective call that waits in the rendezvous for a late peer."""
    if what == "split":
        comm.split(0)
    else:
        import moe

        moe.LowLatencyDispatcher(comm, num_experts=2, max_tokens_per_rank=2, hidden=128, dtype=torch.float32,
                                 max_topk=1)


def _failure(fn) -> tuple:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e), getattr(e, "missing_ranks", None), time.monotonic() - t0
    return ("no error",)


def _body_killed(comm, what: str):
    if comm.rank == 1:
        time.sleep(0.3)  # rank 0 waits for it by now
        os.kill(os.getpid(), signal.SIGKILL)
    return _failure(lambda: _wait_in(comm, what))


def _body_interrupted(comm, what: str, flags: str):
    if comm.rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        try:
            _wait_in(comm, what)
            res = ("not interrupted",)
        except KeyboardInterrupt:
            res = ("interrupted", time.monotonic() - t0)
        finally:
            timer.cancel()
        wait_done(flags, [1])  # alive until rank 1 has raised
        return res
    time.sleep(2.0)  # arrives long after rank 0 was interrupted
    try:
        return _failure(lambda: _wait_in(comm, what))
    finally:
        mark_done(flags, 1)


def _needs(what: str) -> dict:
    if what == "split":
        return {}
    pytest.importorskip("triton")
    return {"transport": "ipc", "options": {"ipc_emulate": 1}}


@pytest.mark.parametrize("what", ["split", "low_latency"])
def test_a_rank_killed_while_its_peers_wait_in_the_rendezvous_is_named_promptly(what):
    res = collectives.launch(_body_killed, 2, what, timeout=TIMEOUT, return_exceptions=True, **_needs(what))
    assert isinstance(res[1], RankFailedError), res
    kind, msg, missing, waited = res[0]
    assert kind == "PeerFailedError" and "rank 1" in msg and "died" in msg and missing == [1], res[0]
    assert waited < PROMPT, res[0]


@pytest.mark.parametrize("what", ["split", "low_latency"])
def test_ctrl_c_in_the_rendezvous_is_delivered_at_once_and_the_peer_raises_naming_it(what, tmp_path):
    res = collectives.launch(_body_interrupted, 2, what, str(tmp_path), timeout=TIMEOUT, **_needs(what))
    assert res[0][0] == "interrupted" and res[0][1] < 1.2, res[0]  # not when rank 1 arrives (2 s)
    kind, msg, missing, waited = res[1]
    assert kind == "PeerFailedError" and "rank 0 left" in msg and "KeyboardInterrupt" in msg, res[1]
    assert missing == [0] and waited < PROMPT, res[1]


def test_an_unreachable_store_names_the_rank_that_hosted_it():
    from collectives.rendezvous import StoreRendezvous, loopback_store_server, store_client

    server, port = loopback_store_server(TIMEOUT)
    rdv = StoreRendezvous(store_client("127.0.0.1", port, TIMEOUT), 1, 2, TIMEOUT, "gone-host", [0, 1],
                          host_rank=0)
    del server  # the host rank's death, as far as the store is concerned
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(PeerFailedError, match="store cannot be reached.*rank 0 hosts it") as info:
        rdv.allgather_bytes(b"x")
    assert info.value.missing_ranks == [0] and time.monotonic() - t0 < PROMPT
