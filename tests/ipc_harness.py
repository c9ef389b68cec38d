"""Run an ipc transport in n processes without the communicator (tests of transports/ipc.py).

``run_ranks(fn, n, *args)`` starts n ranks (from a fork server; ``fn`` must be a module-level function); each builds a GroupInfo over a FileStore rendezvous
(with every rank's pid, so failure detection works) and returns ``fn(group, *args)``; the
parent gets [n] results, or the list of ranks' exceptions (type name, message, traceback).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable

from collectives.launcher import _context
from transports.base import GroupInfo
from transports.settings import resolve


def make_group(store_path: str, rank: int, size: int, timeout: float, options: dict | None = None) -> GroupInfo:
    import torch.distributed as dist

    from collectives.rendezvous import StoreRendezvous

    store = dist.FileStore(store_path, size)
    rdv = StoreRendezvous(store, rank, size, timeout, "ipc-test", list(range(size)))
    pids = [int(b) for b in rdv.allgather_bytes(str(os.getpid()).encode())]
    return GroupInfo(rank=rank, size=size, timeout=timeout, rendezvous=rdv, global_ranks=list(range(size)),
                     pids=pids, hosts=["node"] * size, settings=resolve({"ipc_emulate": 1, **(options or {})}))


def _rank_main(fn, rank, size, store_path, timeout, options, queue, args):
    try:
        from transports.ipc import load_kernels

        load_kernels(True)  # before the peers' clocks start: the rendezvous timeout may be short
        group = make_group(store_path, rank, size, timeout, options)
        result = ("ok", fn(group, *args))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        result = ("error", (type(e).__name__, str(e), traceback.format_exc()[-3000:]))
    queue.put((rank, pickle.dumps(result)))  # plain pickle: tensors by value, not by shared fd


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 60.0, options: dict | None = None,
              join_timeout: float = 300.0) -> list:
    """[size] ("ok", value) or ("error", (type name, message, traceback)) of ``fn(group, *args)`` per rank.

    A rank that never reports (killed) shows as ("missing", None).
    """
    # collectives.launch's fork server (one per process, whichever starts it first: its preloads, so that
    # the ranks of both find what conftest preloads): a rank forked from this (pytest) process would
    # inherit OpenMP's thread pool of earlier torch work and hang in it
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, size, store_path, timeout, options, queue, args),
                             daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        results: list = [("missing", None)] * size
        got = 0
        deadline = time.monotonic() + join_timeout
        while got < size and time.monotonic() < deadline:
            try:
                rank, res = queue.get(timeout=0.2)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[rank] = pickle.loads(res)
            got += 1
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results
