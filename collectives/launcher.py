"""``launch``: run a function on N local ranks, each with its own Communicator.

Ranks are started from a fork server that has torch and moecomm preloaded, so a launch
costs a fork per rank, not an interpreter start and a torch import. The rendezvous store
listens on 127.0.0.1 only. A rank that raises or dies makes ``launch`` kill the others and
re-raise that rank's exception (its traceback attached); ranks die with the launcher.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import traceback
from typing import Any, Callable

log = logging.getLogger("collectives")

_PRELOAD = ["torch", "numpy", "transports.shm", "collectives"]
_ctx = None


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank (set as ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class RankFailedError(RuntimeError):
    """A launched rank died without returning (signal, os._exit, or an unpicklable error)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(rank: int, nprocs: int, port: int, fn, args, kwargs, transport: str, timeout: float,
               conn, threads: int | None) -> None:
    _die_with_parent()
    import torch

    from .rendezvous import StoreRendezvous, store_client
    from . import _build

    if threads:
        torch.set_num_threads(threads)
    try:
        store = store_client("127.0.0.1", port, timeout)
        rdv = StoreRendezvous(store, rank, nprocs, timeout, "moecomm/launch", range(nprocs))
        comm = _build(rdv, transport, timeout, "launch")
        try:
            result = fn(comm, *args, **kwargs)
        finally:
            comm.close()
        payload = ("ok", rank, result)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the launcher
        tb = traceback.format_exc()
        payload = ("err", rank, e, tb)
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as e:  # noqa: BLE001 - unpicklable result or error
        conn.send_bytes(pickle.dumps(("err", rank, None, f"rank {rank}: could not send its result back: {e!r}\n"
                                      + (payload[3] if payload[0] == "err" else ""))))
    conn.close()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, transport: str = "auto", timeout: float = 300.0,
           return_exceptions: bool = False, threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``nprocs`` local ranks; return their results in rank order.

    fn: a module-level (picklable) function. transport: "auto", "shm" or "mpi" (mpi needs mpirun).
    timeout: the communicators' timeout in seconds. threads: torch intra-op threads per rank
    (default: CPUs // nprocs, at least 1, like torchrun's OMP_NUM_THREADS=1 for several ranks).

    If a rank raises, the others are killed and that rank's exception is re-raised (its remote
    traceback as ``__cause__``, ``.rank`` set). With ``return_exceptions=True`` every rank runs to
    its end and the list holds the exception objects of the ranks that failed.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"launch needs a module-level function it can pickle, got {fn!r}: {e}") from e
    from .rendezvous import loopback_store_server

    if threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cpus // nprocs)
    store, port = loopback_store_server(timeout)
    ctx = _context()
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"moecomm-rank{rank}", daemon=False,
                            args=(rank, nprocs, port, fn, args, kwargs, transport, timeout, child_end, threads))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, return_exceptions)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        del store


def _collect(procs, conns, return_exceptions: bool) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    done = [False] * n
    waiting = {c: r for r, c in enumerate(conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    while not all(done):
        ready = mpc.wait(list(waiting) + [s for s, r in sentinels.items() if not done[r]])
        for obj in ready:
            if obj in waiting:
                r = waiting.pop(obj)
                try:
                    payload = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    continue  # died before sending: its sentinel reports it
                except Exception as e:  # noqa: BLE001 - e.g. exception class not importable here
                    payload = ("err", r, None, f"could not unpickle rank {r}'s result: {e!r}")
                done[r] = True
                if payload[0] == "ok":
                    results[r] = payload[2]
                    continue
                exc = _rebuild(payload)
                if not return_exceptions:
                    raise exc
                results[r] = exc
            else:
                r = sentinels[obj]
                if done[r]:
                    continue
                procs[r].join(timeout=1)
                if conns[r] in waiting and conns[r].poll():
                    continue  # its result is in the pipe; read it on the next turn
                done[r] = True
                waiting.pop(conns[r], None)
                code = procs[r].exitcode
                how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                exc = RankFailedError(f"rank {r} died with {how} before returning", r)
                if not return_exceptions:
                    raise exc
                results[r] = exc
    return results


def _rebuild(payload) -> BaseException:
    _, rank, exc, tb = payload
    if exc is None:
        exc = RankFailedError(f"rank {rank} failed", rank)
    try:
        exc.rank = rank
    except AttributeError:
        pass
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on rank {rank} of collectives.launch)")
    exc.__cause__ = RemoteTraceback(f"Traceback on rank {rank}:\n{tb}")
    return exc
