"""Communicator creation under mpiexec, once per case, each case with its own per-rank MOECOMM_* settings.

Run by tests/test_communicator_settings.py as one MPMD job (one interpreter per rank for every case):

    mpiexec -disable-auto-cleanup -n 1 -env SETTINGS_JOB_CASE0_MOECOMM_X a ... python settings_job.py OUT : \
        -n 1 -env SETTINGS_JOB_CASE0_MOECOMM_X b ... python settings_job.py OUT

``SETTINGS_JOB_CASES`` (the same on every rank) names the cases in order. For case ``i`` a rank sets in
``os.environ`` exactly the variables the launcher gave it as ``SETTINGS_JOB_CASE<i>_<VAR>`` (every other
MOECOMM_* variable is back to what the job started with), then calls ``collectives.init`` (which
resolves the settings from ``os.environ`` at each call). A communicator that comes up does one
all-reduce (are the ranks still in step after the failed creations before it?) and is closed.

Each rank appends one JSON line per case to ``OUT/rank<r>.jsonl`` as soon as the case is over:
``{"case", "rank", "set", "error", "message", "ok", "seconds"}`` (``error``: the exception type's name
or None).
"""

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

import collectives

PREFIX = "SETTINGS_JOB_CASE"
rank = int(os.environ["PMI_RANK"])
names = os.environ["SETTINGS_JOB_CASES"].split(",")
given = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
start = {k: v for k, v in os.environ.items() if k.startswith("MOECOMM_")}
out = Path(sys.argv[1], f"rank{rank}.jsonl")

for i, name in enumerate(names):
    mine = {k[len(f"{PREFIX}{i}_"):]: v for k, v in given.items() if k.startswith(f"{PREFIX}{i}_")}
    for k in [k for k in os.environ if k.startswith("MOECOMM_")]:
        del os.environ[k]
    os.environ.update(start)
    os.environ.update(mine)
    rep = {"case": name, "rank": rank, "set": mine, "error": None, "message": "", "ok": None}
    t0 = time.monotonic()
    try:
        comm = collectives.init(timeout=20.0)
    except Exception as e:  # noqa: BLE001 - the test reads it
        rep.update(error=type(e).__name__, message=str(e))
    else:
        x = torch.full((3,), float(comm.rank + 1))
        rep["ok"] = bool(torch.equal(comm.all_reduce(x), torch.full((3,), float(comm.size * (comm.size + 1) // 2))))
        comm.close()
    rep["seconds"] = round(time.monotonic() - t0, 2)
    with out.open("a") as f:
        f.write(json.dumps(rep) + "\n")

# Everything is closed: skip the final garbage collection of the interpreter's exit (about 0.6 CPU-s
# with torch loaded, on a machine where the ranks share the cores); exit handlers still run.
gc.freeze()
