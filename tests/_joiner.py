"""A newcomer of tests/test_grow.py: a fresh process that joins a running group with
``collectives.init(join=address)``, once per step.

    python tests/_joiner.py --dir D --steps ok,abort [--check ok] [--timeout S]

It imports torch and moecomm first; then, for each step in turn, it waits for the file D/STEP.go
(written by a member once it wants this join to happen: the file holds the address), joins, and for
a ``--check`` step runs :func:`check_group` on the grown group as the members do, then closes it.
What happened goes to D/STEP.json: ``{"ok": true, "rank", "size", "global_ranks", "transports", ...}``
or ``{"ok": false, "kind", "msg", "elapsed", "traceback"}``. The exit status is 0 either way (a
process that dies writes nothing).

:func:`data` and :func:`check_group` are shared with the test's members, so both sides compute the
same references.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

import collectives

log = logging.getLogger("collectives.tests.joiner")


def data(kind: str, world: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random input of world rank ``world`` that any process can regenerate."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{world}".encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def check_group(comm: collectives.Communicator, tag: str) -> None:
    """all_reduce, all_gather, all_to_all with uneven counts (some zero) and a broadcast from the last
    rank (a newcomer in a grown group), each against a reference from every rank's seeded input."""
    worlds, me = comm.global_ranks, comm.global_ranks[comm.rank]
    x = {w: data(f"{tag}ar", w, (1000,)) for w in worlds}
    torch.testing.assert_close(comm.all_reduce(x[me]), sum(x[w] for w in worlds))
    g = {w: data(f"{tag}ag", w, (7, 3)) for w in worlds}
    torch.testing.assert_close(comm.all_gather(g[me]), torch.cat([g[w] for w in worlds]))
    # rank i sends (7i + 3j) % 4 rows to rank j: uneven, a zero on every rank of a 4-rank group
    counts = {i: [(7 * i + 3 * j) % 4 for j in range(comm.size)] for i in range(comm.size)}
    a = {i: data(f"{tag}a2a", worlds[i], (sum(counts[i]), 5)) for i in range(comm.size)}
    got = comm.all_to_all(a[comm.rank], counts[comm.rank])
    want = []
    for i in range(comm.size):
        start = sum(counts[i][: comm.rank])
        want.append(a[i][start : start + counts[i][comm.rank]])
    torch.testing.assert_close(got, torch.cat(want))
    b = {w: data(f"{tag}bc", w, (64,)) for w in worlds}
    src = comm.size - 1
    torch.testing.assert_close(comm.broadcast(b[me], src=src), b[worlds[src]])


def join_step(directory: Path, step: str, *, timeout: float, check: bool, wait: float) -> None:
    """Wait for ``step``'s go file, join the address it holds, write what happened to ``step``.json."""
    go, out = directory / f"{step}.go", directory / f"{step}.json"
    deadline = time.monotonic() + wait
    while not go.exists():
        if time.monotonic() > deadline:
            out.write_text(json.dumps({"ok": False, "kind": "NoGo", "msg": f"{go} never appeared"}))
            return
        time.sleep(0.02)
    address = go.read_text().strip()
    t0 = time.monotonic()
    try:
        comm = collectives.init(join=address, timeout=timeout)
        result = {"ok": True, "rank": comm.rank, "size": comm.size, "global_ranks": list(comm.global_ranks),
                  "transports": sorted(comm.transports), "forced": comm._forced, "pid": os.getpid(),
                  "shm_slot_bytes": comm.settings["shm_slot_bytes"]}
        if check:
            check_group(comm, step)
        comm.close()
    except Exception as e:  # noqa: BLE001 - the test reads what happened
        result = {"ok": False, "kind": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0,
                  "traceback": traceback.format_exc()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="where the go files appear and the results go")
    ap.add_argument("--steps", required=True, help="comma-separated step names, joined in this order")
    ap.add_argument("--check", action="append", default=[], help="a step that runs check_group once joined")
    ap.add_argument("--timeout", type=float, default=30.0, help="init's timeout (seconds)")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a step's go file")
    args = ap.parse_args()
    for step in args.steps.split(","):
        join_step(Path(args.dir), step, timeout=args.timeout, check=step in args.check, wait=args.wait)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
