"""Host transports under mpiexec: NaN in max/min, peers that close, stall, stop or die, or come late
to the set-up. Run by tests/test_host_transports.py as ``mpiexec -disable-auto-cleanup -n 3 python
host_transport_job.py main+late <out dir>`` (the main cases, then the late one, which leaves
MPI_COMM_WORLD out of step: it must come last) and ``mpiexec -disable-auto-cleanup -n 2 python
host_transport_job.py dead <out dir>``; ``main``, ``dead`` and ``late`` run one part alone.

Every rank writes ``{"rank": r, "results": {case: [ok, detail]}}`` to ``<out dir>/rank<r>.json``;
the test reports every failed case of every rank together.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import sys
import time
import traceback

import torch

import collectives
from collectives import CommunicatorBrokenError
from transports import mpi as mpi_transport

results: dict[str, list] = {}


def case(name):
    def run(fn):
        try:
            ok, detail = fn()
        except Exception:  # noqa: BLE001 - reported, the other cases still run
            ok, detail = False, traceback.format_exc()[-1500:]
        results[name] = [bool(ok), str(detail)]
        return fn

    return run


def outcome(fn):
    """(exception type name or None, message, seconds) of calling fn."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - inspected by the caller
        return type(e).__name__, str(e), getattr(e, "missing_ranks", None), time.monotonic() - t0
    return None, "", None, time.monotonic() - t0


def stall_after_signatures(comm, how):
    """Make this rank take part in the next call's signature exchange, then stall (sleep or SIGSTOP)."""
    t = comm.transports["mpi"]
    real = t._reduce

    def stalled(*args):
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3.0)  # past the others' 2 s timeout and their who-is-here query
        return real(*args)

    t._reduce = stalled


def main_cases(world):
    r, n = world.rank, world.size

    @case("nan_max_min")
    def _():
        # Adversarial 4: MPI's MAX/MIN are not NaN-aware: rank 0 got [nan, 1.0], rank 1 [1.0, nan].
        bad = []
        g = torch.Generator().manual_seed(1234 + r)
        for transport in ("mpi", "shm"):
            comm = world.using(transport)
            for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
                base = (torch.rand(n * 6, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
                x = base.clone()
                x[r::n] = float("nan")  # a NaN from a different rank in each position ...
                x[: n * 2 : 2] = base[: n * 2 : 2]  # ... but not everywhere
                xs = comm.all_gather(x.unsqueeze(0))  # every rank's input
                for op, fold in (("max", torch.maximum), ("min", torch.minimum)):
                    want = functools.reduce(fold, list(xs.unbind(0)))
                    got_ar = comm.all_reduce(x, op=op)
                    got_rs = comm.reduce_scatter(x, op=op)
                    want_rs = want.view(n, -1)[r]
                    for what, got, ref in (("all_reduce", got_ar, want), ("reduce_scatter", got_rs, want_rs)):
                        if not torch.equal(got.isnan(), ref.isnan()) or not torch.equal(
                                got.nan_to_num(0.0), ref.nan_to_num(0.0)):
                            bad.append(f"{transport} {what} {op} {dtype}: got {got.tolist()} want {ref.tolist()}")
                    # the same bits on every rank
                    bits = world.all_gather(got_ar.view(torch.uint8).unsqueeze(0))
                    if not all(torch.equal(bits[0], b) for b in bits):
                        bad.append(f"{transport} all_reduce {op} {dtype}: ranks differ")
        return not bad, "; ".join(bad)

    world.barrier()

    @case("closed_peer_named_at_once")
    def _():
        # Adversarial 9: a peer's close() was noticed only at the timeout.
        comm = collectives.init(transport="mpi", timeout=8.0)
        x = torch.arange(5, dtype=torch.float32) + 0.5
        got = comm.broadcast(x * (r + 1), src=0)  # the root may finish (and close) before the others receive
        if not torch.equal(got, x):
            return False, f"broadcast gave {got.tolist()}"
        if r == 0:
            comm.close()
            return True, "closed"
        name, msg, missing, waited = outcome(comm.barrier)
        comm.close()
        ok = name == "PeerFailedError" and "rank 0 closed its communicator" in msg and missing == [0] and waited < 4
        return ok, f"{name}: {msg} ({waited:.2f}s)"

    world.barrier()

    for how in ("sleep", "stop"):
        @case(f"{how}_rank_named")
        def _(how=how):
            # Adversarial 9: a rank that stalls after the signatures matched gave "some rank never
            # arrived (MPI cannot say which ...)", even with 2 ranks.
            comm = collectives.init(transport="mpi", timeout=2.0)
            pid1 = comm.topology.pids[1]
            if r == 1:
                stall_after_signatures(comm, how)
            name, msg, missing, waited = outcome(lambda: comm.all_reduce(torch.ones(3)))
            if r == 0 and how == "stop":
                os.kill(pid1, signal.SIGCONT)
            if r == 1:
                # Woke up late: the call may even complete (the others' abandoned requests are still
                # posted), but the next one is told at once that the others gave up on this rank.
                name, msg, missing, waited = outcome(comm.barrier)
                comm.close()
                ok = name == "CollectiveTimeoutError" and "timed out waiting for rank(s) [1]" in msg \
                    and missing == [1] and waited < 1.0
                return ok, f"{name}: {msg} ({waited:.2f}s)"
            comm.close()
            # the first rank to time out names rank 1 (and, on this node, its stopped process); it tells
            # the others, who name rank 1 too
            ok = (name == "CollectiveTimeoutError" and "rank(s) [1]" in msg and missing == [1]
                  and 1.5 < waited < 4.0)
            return ok, f"{name}: {msg} ({waited:.2f}s)"

        world.barrier()

    @case("use_after_close")
    def _():
        # Adversarial 10: a call after close() gave "Invalid MPI_Request".
        comm = collectives.init(transport="mpi", timeout=8.0)
        t = comm.transports["mpi"]
        comm.close()
        from transports.base import OpCode, ReduceOp, Signature

        x = torch.ones(4)
        sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
        wrong = []
        for what, call in (("all_reduce", lambda: t.all_reduce(x, torch.empty(4), ReduceOp.SUM, sig)),
                           ("barrier", lambda: t.barrier(Signature.of(OpCode.BARRIER))),
                           ("exchange_meta", lambda: t.exchange_meta(sig))):
            try:
                call()
                wrong.append(f"{what}: no error")
            except CommunicatorBrokenError as e:
                if "closed" not in str(e):
                    wrong.append(f"{what}: {e}")
            except Exception as e:  # noqa: BLE001 - reported
                wrong.append(f"{what}: {type(e).__name__}: {e}")
        return not wrong, "; ".join(wrong)


def dead_cases(world):
    r = world.rank

    @case("dead_peer_noticed_before_timeout")
    def _():
        comm = collectives.init(transport="mpi", timeout=10.0)
        x = torch.arange(6, dtype=torch.float64) + 0.25
        got = comm.broadcast(x * (r + 1), src=1)
        if r == 1:
            report(r, {"dead_peer_noticed_before_timeout": [True, "exited"]})
            os._exit(0)  # no close(), no MPI_Finalize: as a crash looks to the peers
        if not torch.equal(got, x * 2):  # it sent its part before it died: no false failure
            return False, f"broadcast gave {got.tolist()}"
        name, msg, missing, waited = outcome(comm.barrier)
        ok = name == "PeerFailedError" and "rank 1" in msg and "died" in msg and missing == [1] and waited < 5
        return ok, f"{name}: {msg} ({waited:.2f}s)"


def late_cases(world):
    r = world.rank

    @case("late_setup_peer_times_out")
    def _():
        # MPI_Comm_dup blocked without a deadline when a peer never made its mpi transport.
        marks = os.path.join(sys.argv[2], "late-marks")
        os.makedirs(marks, exist_ok=True)
        if r == 1:
            real = mpi_transport.MPITransport.__init__

            def late(self, group):
                # until every other rank has given up on its 2 s timeout (bounded: 30 s at most)
                deadline = time.monotonic() + 30
                while len(os.listdir(marks)) < world.size - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                real(self, group)

            mpi_transport.MPITransport.__init__ = late
        name, msg, missing, waited = outcome(lambda: collectives.init(transport="mpi", timeout=2.0))
        if r == 1:  # MPI_COMM_WORLD is out of step after rank 0 gave up: any bounded outcome will do
            return name is not None, f"{name}: {msg} ({waited:.2f}s)"
        open(os.path.join(marks, f"gave-up-{r}"), "w").close()
        ok = name == "CollectiveTimeoutError" and "mpi transport set-up" in msg and waited < 8
        return ok, f"{name}: {msg} ({waited:.2f}s)"


def report(rank, cases):
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "results": cases}, f)


if __name__ == "__main__":
    which = sys.argv[1]
    world = collectives.init(timeout=60.0)
    for part in which.split("+"):
        world.barrier()
        {"main": main_cases, "dead": dead_cases, "late": late_cases}[part](world)
    report(world.rank, results)
    if "late" in which:  # requests of the failed set-up stay posted: no MPI_Finalize, but wait for the peers
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(glob.glob(os.path.join(sys.argv[2], "rank*.json"))) < world.size:
            time.sleep(0.1)
    if "dead" in which or "late" in which:
        os._exit(0)  # a peer is gone without MPI_Finalize: finalizing would wait for it
    world.close()
