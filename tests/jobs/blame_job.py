"""One rank of the blame checks across the testbed's nodes (tests/test_blame.py): a rank on another node is
stopped (SIGSTOP) or killed (SIGKILL) during a collective, and every survivor must raise naming it.

    python blame_job.py --nodes N --ppn P --launcher torchrun|mpiexec --out DIR --victim R --how stop|kill \
        [--hierarchical]

Each rank writes ``<out>/<rank>.json``: {"error", "message", "missing", "seconds"} of what it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

import collectives
from collectives import selection


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--ppn", type=int, required=True)
    ap.add_argument("--launcher", choices=("torchrun", "mpiexec"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--victim", type=int, required=True)
    ap.add_argument("--how", choices=("stop", "kill"), required=True)
    ap.add_argument("--hierarchical", action="store_true")
    ap.add_argument("--stage", choices=("call", "rail", "node"), default="call",
                    help="where the victim stops or dies: before the call, or (hierarchical) at its rail stage, "
                         "or at the node stage's all_gather")
    ap.add_argument("--timeout", type=float, default=3.0)
    a = ap.parse_args()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Hydra's notice of a dead rank (-disable-auto-cleanup)
    torch.set_num_threads(1)
    if a.hierarchical:
        for op in selection.HIERARCHICAL_MIN_BYTES:
            selection.HIERARCHICAL_MIN_BYTES[op] = 0
    comm = collectives.init(timeout=a.timeout)
    out = Path(a.out) / f"{comm.rank}.json"
    x = torch.ones(1 << 12)
    report = {"rank": comm.rank, "hostname": socket.gethostname(),
              "plan": str(comm.plan("all_reduce", x).transport)}
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)  # every connection made
        comm.barrier()
        if comm.rank == a.victim:
            def die(*args: object, **kwargs: object) -> None:
                out.write_text(json.dumps({**report, "victim": True}))
                os.kill(os.getpid(), signal.SIGSTOP if a.how == "stop" else signal.SIGKILL)
                time.sleep(3600)

            if a.stage == "call":
                die()
            node, rail = comm.transports["hierarchical"]._groups
            if a.stage == "rail":
                rail.all_reduce = die
            else:
                node.all_gather = die
        t0 = time.monotonic()
        for _ in range(3):
            comm.all_reduce(x)
        report.update(error=None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        report.update(error=type(e).__name__, message=str(e), missing=list(getattr(e, "missing_ranks", [])))
    report["seconds"] = time.monotonic() - t0
    out.write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # no close: a close would tell the peers, which must find the victim by themselves


if __name__ == "__main__":
    main()
