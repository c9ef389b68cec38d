"""Communicator.grow / collectives.init(join=...): new processes join a running group (issue #55).

The newcomers are fresh interpreters (tests/_joiner.py) that rank 0 starts at the beginning of the
launch, so that their imports overlap the members' work; each join waits for a "go" file holding the
join address, so the test decides when (and so in which order) they queue up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import collectives
from _joiner import check_group
from collectives import CollectiveTimeoutError, PeerFailedError
from spmd import UNDER_MPI, left_behind, outcome, shm_segments

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="fault injection needs spawned ranks")

JOINER = Path(__file__).with_name("_joiner.py")


def _spawn(tmp: str, name: str, steps: list[str], check: list[str], timeout: float = 30.0) -> subprocess.Popen:
    """Start a newcomer process that joins once per step (it imports, then waits for each go file)."""
    log = open(Path(tmp, f"{name}.log"), "w")
    cmd = [sys.executable, str(JOINER), "--dir", tmp, "--steps", ",".join(steps), "--timeout", str(timeout)]
    cmd += [a for c in check for a in ("--check", c)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=JOINER.parent.parent)


def _go(tmp: str, step: str, address: str) -> None:
    """Let the newcomer of ``step`` join ``address`` (written whole, then renamed: never read half written)."""
    Path(tmp, f"{step}.part").write_text(address)
    Path(tmp, f"{step}.part").replace(Path(tmp, f"{step}.go"))


def _queued(comm, place: int, limit: float = 60.0) -> None:
    """Wait until the ``place``-th newcomer has queued up at ``comm``'s group (each member looks at the
    store itself: no collective, so a slow interpreter start is not bounded by the group's timeout)."""
    rdv = comm._rdv
    deadline = time.monotonic() + limit
    while not rdv.store.check([f"{rdv.prefix}/grow/q{place}"]):
        assert time.monotonic() < deadline, f"newcomer {place} never queued up"
        time.sleep(0.02)


def _finish(procs: dict[str, subprocess.Popen], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _result(tmp: Path, step: str) -> dict:
    out = tmp / f"{step}.json"
    logs = "\n".join(f"{p.name}:\n{p.read_text()}" for p in tmp.glob("*.log"))
    assert out.exists(), f"the newcomer of {step} wrote nothing; the newcomers' logs:\n{logs}"
    return json.loads(out.read_text())


def _body(comm, tmp: str):
    """4 ranks (timeout 5 s). (a) a bad count and (b) no newcomer, on a sub-group nobody joins; then rank 2
    dies, the others shrink without it and (1) grow back to 4 with a newcomer; then, on the 3 survivors:
    (2) the members pass different counts while a newcomer waits, (3) a queued newcomer dies, (4) a member
    (world rank 3) dies while a newcomer waits."""
    procs = {}
    if comm.rank == 0:  # one newcomer joins three times; the one of "dead" is killed
        procs = {"joiner": _spawn(tmp, "joiner", ["ok", "abort", "orphan"], ["ok"]),
                 "dead": _spawn(tmp, "dead", ["dead"], [])}
    out = {}
    try:
        sub = comm.split(0)
        out["bad"] = outcome(lambda: sub.grow(0 if comm.rank == 1 else 1))
        t0 = time.monotonic()
        out["none"] = outcome(lambda: sub.grow(1))
        out["none_s"] = time.monotonic() - t0
        sub.barrier()  # still usable
        sub.close()

        comm.barrier()
        if comm.rank == 2:
            os._exit(1)
        try:
            comm.all_reduce(torch.ones(100))
        except PeerFailedError as e:
            out["missing"] = list(e.missing_ranks)
        shrunk = comm.shrink(exclude=out["missing"])
        comm.close()
        r = shrunk.rank
        address = shrunk.join_address()
        out["address"] = address
        if r == 0:
            _go(tmp, "ok", address)
        _queued(shrunk, 1)
        grown = shrunk.grow(1)
        out["grown"] = (grown.rank, grown.size, list(grown.global_ranks), grown.timeout, grown._forced,
                        str(grown.device))
        check_group(grown, "ok")
        grown.close()
        x = torch.full((5,), float(r))
        torch.testing.assert_close(shrunk.all_reduce(x), torch.full((5,), 3.0))  # the shrunk group still works

        if r == 0:
            _go(tmp, "abort", address)
        _queued(shrunk, 2)
        out["differ"] = outcome(lambda: shrunk.grow(2 if r == 1 else 1))

        if r == 0:
            _go(tmp, "dead", address)
        _queued(shrunk, 3)
        if r == 0:
            procs["dead"].kill()
            procs["dead"].wait()
        out["dead"] = outcome(lambda: shrunk.grow(1))

        if r == 0:
            _go(tmp, "orphan", address)
        _queued(shrunk, 4)
        if r == 2:
            os._exit(1)
        t0 = time.monotonic()
        out["member"] = outcome(lambda: shrunk.grow(1))
        out["member_s"] = time.monotonic() - t0
        shrunk.close()
        out["closed"] = [(c.closed, dict(c.transports)) for c in (comm, shrunk, grown)]
        return out
    finally:
        _finish(procs)


def test_grow(tmp_path):
    """Scenarios 1 and 2 and the members' and newcomers' errors, in one launch."""
    before = shm_segments()
    # the newcomers take the forced transport and the agreed settings from the members
    res = collectives.launch(_body, 4, str(tmp_path), timeout=5, transport="shm", options={"shm_slot_bytes": 1 << 16},
                             return_exceptions=True)
    assert isinstance(res[2], Exception) and isinstance(res[3], Exception), res  # they died on purpose
    for r in (0, 1):
        out = res[r]
        assert not isinstance(out, BaseException), out
        kind, msg = out["bad"]
        assert kind == "ValueError" and ("rank(s) [1] passed an invalid count" in msg
                                         or "count on rank 1 must be >= 1" in msg), (r, msg)
        kind, msg = out["none"]
        assert kind == "CollectiveTimeoutError" and "0 of 1 newcomer(s) joined" in msg, (r, msg)
        assert out["none_s"] < 10, out["none_s"]
        assert out["missing"] == [2]
        assert out["address"].startswith("127.0.0.1:") and "/moecomm/launch/" in out["address"], out["address"]
        # members keep their ranks; the newcomer is rank 3 with world rank 4 (rank 2's is never reused)
        assert out["grown"] == (r, 4, [0, 1, 3, 4], 5.0, "shm", "cpu"), out["grown"]
        kind, msg = out["differ"]
        assert kind == "ValueError" and "rank 0 asks for 1, rank 1 asks for 2, rank 3 asks for 1" in msg, (r, msg)
        kind, msg = out["dead"]  # world ranks 4 and 5 went to "ok" and "abort": "dead" got 6
        assert kind == "PeerFailedError" and "rank 6" in msg, (r, msg)
        kind, msg = out["member"]
        assert kind == "PeerFailedError" and "rank 3" in msg, (r, msg)
        assert out["member_s"] < 5, out["member_s"]
        assert out["closed"] == [(True, {})] * 3, out["closed"]
    ok = _result(tmp_path, "ok")
    assert ok["ok"], ok.get("traceback")
    assert (ok["rank"], ok["size"], ok["global_ranks"]) == (3, 4, [0, 1, 3, 4]), ok
    assert (ok["forced"], ok["shm_slot_bytes"]) == ("shm", 1 << 16), ok
    abort = _result(tmp_path, "abort")
    assert abort["kind"] == "ValueError" and "disagree on count" in abort["msg"], abort
    assert not (tmp_path / "dead.json").exists()
    orphan = _result(tmp_path, "orphan")
    assert orphan["kind"] == "PeerFailedError" and "rank 3" in orphan["msg"], orphan
    assert orphan["elapsed"] < 10, orphan
    assert not left_behind(before)


def test_join_address_errors(tmp_path):
    """A malformed, unreachable or unknown address raises at once, naming it; with a group that never
    grows, the newcomer raises after its timeout."""
    from collectives.rendezvous import StoreRendezvous, loopback_store_server, store_client

    for bad in ("nonsense", "127.0.0.1/x", "127.0.0.1:0/x", "host:12/", 12):
        with pytest.raises(ValueError, match="not a join address|is a str") as e:
            collectives.init(join=bad, timeout=2)
        assert repr(bad) in str(e.value)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} cannot be reached"):
        collectives.init(join=f"127.0.0.1:{port}/moecomm/launch", timeout=5)
    assert time.monotonic() - t0 < 2
    server, port = loopback_store_server(10)
    with pytest.raises(ValueError, match="knows no group with the key prefix 'nope'"):
        collectives.init(join=f"127.0.0.1:{port}/nope", timeout=2)
    # a group (one member, its rendezvous only) that hands out its address but never grows
    rdv = StoreRendezvous(store_client("127.0.0.1", port, 10), 0, 1, 10.0, "quiet", [0])
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="no grow of the group took newcomer rank 1 within"):
        collectives.init(join=rdv.join_address(), timeout=1)
    assert time.monotonic() - t0 < 5
    del server


def test_grow_order_over_the_rendezvous():
    """Two members and two newcomers (threads) over a store: the newcomers arrive after the grow began,
    take ranks 2 and 3 in the order they took their world ranks, and all four exchange; an extra newcomer
    waits for the next grow."""
    from collectives.rendezvous import StoreRendezvous, join_group, loopback_store_server, store_client

    server, port = loopback_store_server(10)
    res, started = {}, threading.Event()

    def member(r):
        # host_rank=0: as under torchrun without an agent store, where rank 0's process hosts the store
        rdv = StoreRendezvous(store_client("127.0.0.1", port, 10), r, 2, 10.0, "order", range(2), host_rank=0)
        rdv.allgather_bytes(b"")
        res["address"] = rdv.join_address()
        started.set()
        new = rdv.grow(2, offer={"launch": "test"})
        res[f"m{r}"] = (new.rank, new.global_ranks, new.allgather_bytes(b"m%d" % r))
        res[f"host{r}"] = new.host_rank
        again = rdv.grow(1)  # the third newcomer, queued meanwhile
        res[f"again{r}"] = again.global_ranks

    def newcomer(i):
        started.wait(10)
        time.sleep(0.2 + 0.3 * i)  # after the members' grow began, one after the other
        new, offer = join_group(res["address"], 10.0)
        res[f"n{i}"] = (new.rank, new.global_ranks, offer)
        res[f"nhost{i}"] = new.host_rank
        if i < 2:
            new.allgather_bytes(b"n%d" % i)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    threads += [threading.Thread(target=newcomer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert res["m0"] == (0, [0, 1, 2, 3], [b"m0", b"m1", b"n0", b"n1"]), res
    assert res["m1"][:2] == (1, [0, 1, 2, 3])
    assert res["n0"] == (2, [0, 1, 2, 3], {"launch": "test"}) and res["n1"][:2] == (3, [0, 1, 2, 3])
    assert res["again0"] == res["again1"] == [0, 1, 4] and res["n2"][:2] == (2, [0, 1, 4])
    # the store's host is still world rank 0 on every rank of the grown groups
    assert [res[k] for k in ("host0", "host1", "nhost0", "nhost1", "nhost2")] == [0] * 5
    del server


def test_grow_not_possible_here():
    """A single-process group and MPI raise NotImplementedError saying why."""
    comm = collectives.init()
    try:
        with pytest.raises(NotImplementedError, match="single-process group"):
            comm.grow(1)
        with pytest.raises(NotImplementedError, match="single-process group"):
            comm.join_address()
    finally:
        comm.close()
    fake = object.__new__(collectives.Communicator)
    fake._mpi_comm, fake._forced = object(), None
    with pytest.raises(NotImplementedError, match="MPI"):
        fake.grow(1)
