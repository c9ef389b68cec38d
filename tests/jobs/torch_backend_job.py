"""init_process_group("moecomm") under an external launcher; each rank prints one JSON line.

    python -m torch.distributed.run --nproc-per-node 2 torch_backend_job.py
    mpiexec -n 3 python torch_backend_job.py      # env:// from MPI's rank and size (MASTER_* given)

env:// rendezvous, an all-reduce and an uneven all-to-all on the world group, a sub-group of the
first and last rank (under mpiexec forced onto the mpi transport, so its MPI communicator comes
from MPI_Comm_create_group) with bool and int8 reductions on it, one DDP step checked against the
same step on one process.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import collectives  # noqa: F401 - registers the backend

if "PMI_RANK" in os.environ:  # MPICH's hydra: torch's env:// needs RANK and WORLD_SIZE
    os.environ.setdefault("RANK", os.environ["PMI_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["PMI_SIZE"])
report = {"rank": int(os.environ["RANK"])}


def launched() -> None:
    dist.init_process_group("moecomm", timeout=datetime.timedelta(seconds=60))
    n, r = dist.get_world_size(), dist.get_rank()
    world = dist.group.WORLD
    report.update(size=n, transports=sorted(world.comm.transports), backend=dist.get_backend())
    x = torch.arange(6, dtype=torch.float64) * (r + 1)
    dist.all_reduce(x)
    ok = torch.equal(x, torch.arange(6, dtype=torch.float64) * (n * (n + 1) // 2))
    send = [(r + q) % 3 for q in range(n)]
    recv = [(q + r) % 3 for q in range(n)]
    out = torch.empty(sum(recv), 2)
    dist.all_to_all_single(out, torch.full((sum(send), 2), float(r)), recv, send)
    ok &= torch.equal(out[:, 0], torch.cat([torch.full((c,), float(q)) for q, c in enumerate(recv)]))
    options = {"transport": "mpi"} if "mpi" in world.comm.transports else None
    pair = dist.new_group([0, n - 1], pg_options=options)
    if r in (0, n - 1):
        y = torch.full((3,), float(r + 1))
        dist.all_reduce(y, group=pair)
        ok &= torch.equal(y, torch.full((3,), float(1 + n)))
        report["pair_plan"] = pair.comm.plan("all_reduce", y).transport
        # bool SUM/PRODUCT (DTensor's any/all) and int8 (moved as uint8), as torch computes them
        mine = torch.tensor([True, False, r == 0, r != 0])
        for op, ref in ((dist.ReduceOp.SUM, [True, False, True, True]),
                        (dist.ReduceOp.PRODUCT, [True, False, False, False])):
            b = mine.clone()
            dist.all_reduce(b, op=op, group=pair)
            ok &= b.tolist() == ref
        for op, ref in ((dist.ReduceOp.SUM, [-128 + 127, 100 + 100 - 256]), (dist.ReduceOp.MAX, [127, 100]),
                        (dist.ReduceOp.MIN, [-128, 100])):
            i8 = torch.tensor([-128 if r == 0 else 127, 100], dtype=torch.int8)
            dist.all_reduce(i8, op=op, group=pair)
            ok &= i8.tolist() == ref
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    model(torch.full((2, 4), float(r))).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    ref = torch.nn.Linear(4, 3)
    for p, q in zip(ref.parameters(), model.module.parameters()):
        p.data.copy_(q.data)
    sum(ref(torch.full((2, 4), float(q))).sum() for q in range(n)).div(n).backward()
    ok &= all(torch.allclose(g, p.grad) for g, p in zip(grads, ref.parameters()))
    report["ok"] = bool(ok)
    dist.destroy_process_group()


launched()
print(json.dumps(report), flush=True)
sys.exit(0 if report["ok"] else 1)
