"""One rank of the mpi blame check (tests/test_blame.py), 3 ranks on one host under
``mpiexec -disable-auto-cleanup -n 3 python blame_mpi_job.py <out dir>``.

Rank 2 exits without closing (a crash) before a barrier; rank 1 sees it in the barrier, raises naming it, and closes its
communicator (as a process does on its way out); rank 0 comes to the barrier later and must name rank 2
(from rank 1's failure notice or its own /proc check), not "rank 1 closed its communicator". Ranks 0 and 1
write ``<out dir>/<rank>.json``: {"error", "message", "missing"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repository

import collectives


def main() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Hydra's notice of a dead rank (-disable-auto-cleanup)
    comm = collectives.init(transport="mpi", timeout=10.0)
    comm.barrier()
    if comm.rank == 2:
        os._exit(0)  # no close: as a crash looks to the peers (Hydra ends the whole job on a SIGKILL)
    if comm.rank == 0:
        time.sleep(1.5)  # rank 1 has failed and closed by now
    report: dict = {"rank": comm.rank, "error": None}
    try:
        comm.barrier()
    except Exception as e:  # noqa: BLE001 - reported to the test
        report.update(error=type(e).__name__, message=str(e), missing=list(getattr(e, "missing_ranks", [])))
    if comm.rank == 1:
        comm.close()
    (Path(sys.argv[1]) / f"{comm.rank}.json").write_text(json.dumps(report))
    if comm.rank == 1:
        time.sleep(3)  # alive (closed) while rank 0 looks
    os._exit(0)  # a peer is gone without MPI_Finalize: finalizing would wait for it


if __name__ == "__main__":
    main()
