"""``launch``: run a function on N local ranks, each with its own Communicator.

Ranks are started from a fork server that has torch and moecomm preloaded, so a launch
costs a fork per rank, not an interpreter start and a torch import. The rendezvous store
listens on 127.0.0.1 only. A rank that raises or dies makes ``launch`` kill the others and
re-raise that rank's exception (its traceback attached); ranks die with the launcher.

Settings (``options=`` over ``MOECOMM_*``) are resolved in the calling process and sent to
every rank: the fork server keeps the environment of the first launch, so a variable set
later would otherwise never reach the ranks.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable, Mapping

from transports.base import CollectiveTimeoutError
from transports.settings import check_timeout
from transports.settings import resolve as resolve_settings

log = logging.getLogger("collectives")

# What the fork server imports once, so that no rank imports (or, without bytecode caches, compiles) it
# again: the package, and what creating a communicator imports lazily (the performance model that
# picks the defaults, the transports every group probes). Not the ipc kernels: they need
# TRITON_INTERPRET decided first (transports/ipc.py load_kernels).
_PRELOAD = ["torch", "numpy", "transports.shm", "collectives", "collectives.model", "transports.ipc",
            "transports.gloo", "transports.nccl", "transports._shmfast"]
_ctx = None


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank (set as ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class RankFailedError(RuntimeError):
    """A launched rank died without returning (signal, os._exit, or an unpicklable error).

    Args:
        message: what happened, naming the rank.
        rank: the rank that failed (also ``.rank``).
    """

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _refuse_inside_mpi() -> None:
    """RuntimeError if this process was started by an MPI launcher and MPI is initialized here.

    The fork server and its ranks would inherit the MPI launcher's PMI connection; MPICH then
    aborts the children. Raised before anything is started.
    """
    from .rendezvous import launched_by_mpi

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not launched_by_mpi():
        return
    try:
        initialized = mpi.Is_initialized() and not mpi.Is_finalized()
    except Exception:  # noqa: BLE001 - a broken MPI module: let launch try
        return
    if initialized:
        raise RuntimeError(
            "collectives.launch cannot start ranks inside an MPI job (this process was started by "
            "mpiexec/mpirun and MPI is initialized here): use the communicator from collectives.init(), "
            "which already spans the MPI job's ranks, or run the script without mpiexec to let "
            "launch start its own ranks")


def launch_preload(*modules: str) -> None:
    """Have the fork server import ``modules`` once, beside torch and moecomm, before any rank is forked.

    Each launched rank unpickles its function, importing the function's module and what that imports;
    a module the server already holds costs nothing per rank. For a test suite whose bodies live in
    modules that import pytest or other heavy packages, that is most of a short launch. Like
    :func:`multiprocessing.set_forkserver_preload`, it must come before the server starts; a module
    that fails to import there is imported again, and fails, in the rank that needs it.

    Args:
        modules: importable module names ("pytest", "mypkg.helpers").

    Raises:
        TypeError: a name that is not a non-empty str.
        RuntimeError: after the first :func:`launch` of this process (its server has started).
    """
    bad = [m for m in modules if not isinstance(m, str) or not m]
    if bad:
        raise TypeError(f"launch_preload: module names must be non-empty strings, got {bad!r}")
    if _ctx is not None:
        raise RuntimeError("launch_preload: the fork server has started (a launch ran in this process); "
                           "call launch_preload before the first launch")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context() -> mp.context.BaseContext:
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


def _rank_main(rank: int, nprocs: int, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
               transport: str, timeout: float, settings: dict[str, Any], conn: mpc.Connection,
               threads: int | None, device: Any = None, env: Mapping[str, str] | None = None) -> None:
    _die_with_parent()
    if env:  # before anything reads it: NCCL caches its variables at its first communicator
        os.environ.update(env)
    import torch

    from ._factory import build_communicator
    from .rendezvous import StoreRendezvous, store_client

    if threads:
        torch.set_num_threads(threads)
    comm = None
    try:
        store = store_client("127.0.0.1", port, timeout)
        rdv = StoreRendezvous(store, rank, nprocs, timeout, "moecomm/launch", range(nprocs))
        comm = build_communicator(rdv, transport, timeout, "launch", settings=settings, device=device)
        payload = ("ok", rank, fn(comm, *args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the launcher
        payload = ("err", rank, e, traceback.format_exc())
    if payload[0] == "err":  # first the cause: closing makes the peers raise at once, about this rank
        _send(conn, payload)
    if comm is not None:
        try:
            comm.close()
        except BaseException as e:  # noqa: BLE001 - a failed close fails a rank that succeeded
            if payload[0] == "ok":
                payload = ("err", rank, e, traceback.format_exc())
                _send(conn, payload)
    if payload[0] == "ok":
        _send(conn, payload)
    conn.close()


def _send(conn: mpc.Connection, payload: tuple) -> None:
    """Send a rank's result or error to the launcher (a note of what went wrong if it cannot be pickled)."""
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception as e:  # noqa: BLE001 - unpicklable result or error
        conn.send_bytes(pickle.dumps(("err", payload[1], None, f"rank {payload[1]}: could not send its result "
                                      f"back: {e!r}\n" + (payload[3] if payload[0] == "err" else ""))))


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, transport: str = "auto", timeout: float = 300.0,
           options: Mapping[str, Any] | None = None, return_exceptions: bool = False, threads: int | None = None,
           device: Any = None, env: Mapping[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``nprocs`` local ranks; return their results in rank order.

    The ranks are started from a fork server, which imports the calling script's ``__main__``
    module: a script that calls ``launch`` must do so under ``if __name__ == "__main__":``.
    Under mpiexec, use the communicator of :func:`collectives.init` instead (MPI cannot be
    started again in the launched ranks); ``launch`` raises RuntimeError there once MPI is
    initialized.

    Args:
        fn: a module-level (picklable) function ``fn(comm, *args, **kwargs)``.
        nprocs: number of ranks, >= 1.
        *args, **kwargs: passed to ``fn`` on every rank (picklable).
        transport: "auto", "shm" or "nccl" ("mpi" needs mpiexec; see :func:`collectives.init`).
        timeout: the communicators' timeout in seconds; positive and finite (checked before any
            rank starts: ValueError/TypeError).
        options: settings by option name, overriding their ``MOECOMM_*`` environment variables;
            resolved here, in the calling process, and handed to every rank (so every rank sees
            the same values, and the caller's current environment, not the fork server's).
        return_exceptions: False: if a rank raises, the others are killed and that rank's
            exception is re-raised (its remote traceback as ``__cause__``, ``.rank`` set). True:
            every rank runs to its end and the list holds the failed ranks' exception objects.
        threads: torch intra-op threads per rank (default: CPUs // nprocs, at least 1, like
            torchrun's OMP_NUM_THREADS=1 for several ranks).
        device: the device of every rank (see :func:`collectives.init`): None (default) binds
            rank r to cuda:r (modulo the GPUs; cpu without a GPU); an int N, "cuda:N" or a
            torch.device puts every rank on that one GPU (NCCL then needs
            NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30); "cpu": no GPU.
        env: environment variables set in every rank before its communicator is made (e.g.
            ``NCCL_*``): the ranks inherit the fork server's environment, which is the one of the
            first launch, so a variable the caller set since does not reach them otherwise.

    Returns:
        [nprocs] ``fn``'s return value on each rank, in rank order.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(f"launch: nprocs must be an int, got {nprocs!r}")
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    timeout = check_timeout(timeout, source="collectives.launch: timeout")
    settings = resolve_settings(options, source="collectives.launch")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"launch: threads must be a positive int or None, got {threads!r}")
    env = dict(env or {})
    bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k]
    if bad:
        raise TypeError(f"launch: env must map variable names to strings; bad entries: {bad}")
    _refuse_inside_mpi()
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
                            args=(rank, nprocs, port, fn, args, kwargs, transport, timeout, settings, child_end,
                                  threads, device, env))
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


# How long launch() holds a rank's PeerFailedError/timeout (a consequence of another rank's failure)
# for the failing rank's own error to arrive: that rank sends it before it closes its communicator,
# so it is normally first; the grace covers a launcher that reads the pipes late.
_CAUSE_GRACE_S = 2.0


def _collect(procs: list[mp.process.BaseProcess], conns: list[mpc.Connection],
             return_exceptions: bool) -> list[Any]:
    """Every rank's result in rank order; the first failure raised (or kept, with return_exceptions).

    A rank that raised because a peer failed (PeerFailedError, a timeout) is a consequence: its error
    is held for up to :data:`_CAUSE_GRACE_S` while another rank's error, the cause, may still arrive.
    """
    n = len(procs)
    results: list[Any] = [None] * n
    done = [False] * n
    waiting = {c: r for r, c in enumerate(conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    held: BaseException | None = None  # a consequence, raised unless a cause arrives in time
    held_until = 0.0
    while not all(done):
        timeout = None if held is None else max(0.0, held_until - time.monotonic())
        ready = mpc.wait(list(waiting) + [s for s, r in sentinels.items() if not done[r]], timeout)
        if held is not None and (not ready or time.monotonic() >= held_until):
            raise held
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
                    if not isinstance(exc, CollectiveTimeoutError):
                        raise exc
                    if held is None:
                        held, held_until = exc, time.monotonic() + _CAUSE_GRACE_S
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
    if held is not None:
        raise held
    return results


def _rebuild(payload: tuple) -> BaseException:
    """A failed rank's exception, with ``.rank`` set and its remote traceback as ``__cause__``."""
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
