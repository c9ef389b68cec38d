"""One rank of a job across the testbed's nodes (tests/test_multinode.py), under torchrun or mpiexec.

Every rank checks, against references built from every rank's regenerable random input:
topology (nodes, local ranks, hostnames), which transports came up and which one a call uses, every
collective x dtype x op, sub-communicators within a node and across nodes (rank i of every node), a
shape that differs on one rank of another node (ValueError everywhere, naming it). Then it writes
``<out>/<rank>.json``. Last, with a second communicator of short timeout, the last rank kills itself
(SIGKILL) after a barrier and the others call all_reduce: each must raise naming it; they add what
they raised to their file.

    python multinode_job.py --nodes N --ppn P --launcher torchrun|mpiexec --out DIR
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: spmd's references

import collectives  # noqa: E402
from spmd import assert_reduced, node_job_args, rank_input, write_rank_report  # noqa: E402

SEED = 1515
DTYPE_OPS = [(torch.float32, "sum"), (torch.float32, "max"), (torch.float64, "avg"), (torch.bfloat16, "sum"),
             (torch.float16, "min"), (torch.int64, "sum"), (torch.int32, "prod"), (torch.uint8, "max"),
             (torch.bool, "min")]


def check_topology(comm: collectives.Communicator, nodes: int, ppn: int, launcher: str) -> dict:
    topo, r = comm.topology, comm.rank
    want_nodes = tuple(tuple(range(k * ppn, (k + 1) * ppn)) for k in range(nodes))  # block placement
    assert topo.nodes == want_nodes, (topo.nodes, want_nodes)
    assert topo.num_nodes == nodes and not topo.single_node
    assert comm.local_size == ppn and comm.local_rank == r % ppn, (comm.local_size, comm.local_rank)
    assert topo.hosts[r] == socket.gethostname() == f"node{r // ppn}", (topo.hosts, socket.gethostname())
    assert list(topo.hosts) == [f"node{k // ppn}" for k in range(comm.size)], topo.hosts
    cross = "mpi" if launcher == "mpiexec" else "gloo"
    assert cross in comm.transports and "shm" not in comm.transports, comm.transports
    plan = comm.plan("all_reduce", torch.zeros(4))
    assert plan.transport == cross and "several nodes" in plan.reason, plan
    return {"nodes": [list(n) for n in topo.nodes], "hosts": list(topo.hosts), "transports": sorted(comm.transports),
            "plan": str(plan), "local_rank": comm.local_rank}


def check_collectives(comm: collectives.Communicator, tag: str) -> int:
    """Every collective against its reference; returns how many results were compared."""
    n, r, checks = comm.size, comm.rank, 0
    for i, (dtype, op) in enumerate(DTYPE_OPS):
        for numel in (5, 40_000):
            xs = [rank_input(f"{tag}ar{i}", k, (numel,), dtype, SEED) for k in range(n)]
            if op == "prod" and dtype == torch.int32:
                xs = [x % 5 + 1 for x in xs]
            assert_reduced(comm.all_reduce(xs[r], op=op), xs, op, f"{tag} all_reduce {dtype} {op} {numel}")
            blocks = [rank_input(f"{tag}rs{i}", k, (n * 3, 7), dtype, SEED) for k in range(n)]
            got = comm.reduce_scatter(blocks[r], op=op)
            assert_reduced(got, [b[3 * r: 3 * r + 3] for b in blocks], op, f"{tag} reduce_scatter {dtype} {op}")
            checks += 2
        g = comm.all_gather(xs[r])
        assert torch.equal(g, torch.cat(xs)), f"{tag} all_gather {dtype}"
        src = n - 1 - (i % n)
        assert torch.equal(comm.broadcast(xs[r], src=src), xs[src]), f"{tag} broadcast {dtype} from {src}"
        checks += 2
    for given in (False, True):  # uneven all_to_all, empty pieces included
        counts = [[(s * 5 + d * 3 + int(given)) % 4 for d in range(n)] for s in range(n)]
        rows = [rank_input(f"{tag}a2a{int(given)}", s, (sum(counts[s]), 3, 2), torch.bfloat16, SEED) for s in range(n)]
        recv = [counts[s][r] for s in range(n)] if given else None
        got = comm.all_to_all(rows[r], counts[r], recv_counts=recv)
        want = torch.cat([rows[s][sum(counts[s][:r]): sum(counts[s][: r + 1])] for s in range(n)])
        assert torch.equal(got, want), f"{tag} all_to_all (recv_counts given: {given})"
        checks += 1
    comm.barrier()
    return checks


def check_groups(comm: collectives.Communicator, ppn: int) -> int:
    """Sub-communicators: the ranks of one node (shm), and rank i of every node (across nodes)."""
    node, local = comm.rank // ppn, comm.rank % ppn
    same_node = comm.split(node)
    rail = comm.split(local)
    try:
        assert same_node.topology.single_node and "shm" in same_node.transports, same_node.transports
        assert same_node.size == ppn and rail.size == comm.size // ppn
        assert (rail.topology.num_nodes == rail.size) and (rail.size == 1 or not rail.topology.single_node)
        checks = 0
        for sub, ranks in ((same_node, [node * ppn + k for k in range(ppn)]),
                           (rail, list(range(local, comm.size, ppn)))):
            xs = [rank_input("sub", k, (1000,), torch.float32, SEED) for k in ranks]
            assert_reduced(sub.all_reduce(xs[sub.rank]), xs, "sum", f"sub-group {ranks}")
            checks += 1
        return checks
    finally:
        same_node.close()
        rail.close()


def check_mismatch(comm: collectives.Communicator) -> None:
    """The last rank (on the last node) passes another shape: every rank raises, naming it."""
    bad = comm.size - 1
    x = torch.ones(6 if comm.rank == bad else 5)
    try:
        comm.all_reduce(x)
    except ValueError as e:
        assert f"rank {bad}: (6)" in str(e), str(e)
    else:
        raise AssertionError("a shape that differs on one rank did not raise")


def kill_stage(victim: int) -> dict:
    """A short-timeout communicator; ``victim`` dies after a barrier; the others must raise naming it."""
    # Under `mpiexec -disable-auto-cleanup` Hydra tells the survivors of a dead rank with SIGUSR1, whose
    # default action would end them before they report what they raised.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    comm = collectives.init(timeout=4.0)
    t0 = time.monotonic()
    try:
        # The victim leaves the barrier once its own part is done; its last message may still be in
        # flight when it dies, so a survivor may already see the death here.
        comm.barrier()
        if comm.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        comm.all_reduce(torch.randn(1 << 14))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "missing": list(getattr(e, "missing_ranks", [])),
                "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def main() -> None:
    a = node_job_args()
    torch.set_num_threads(1)
    comm = collectives.init(timeout=30.0)
    out = Path(a.out) / f"{comm.rank}.json"

    def fill(report: dict) -> None:
        report["topology"] = check_topology(comm, a.nodes, a.ppn, a.launcher)
        report["checks"] = check_collectives(comm, "world") + check_groups(comm, a.ppn)
        check_mismatch(comm)
        report["checks"] += 1
        comm.barrier()

    report = write_rank_report(out, {"rank": comm.rank, "size": comm.size, "hostname": socket.gethostname()}, fill)
    comm.close()
    if report["ok"]:
        report["kill"] = kill_stage(victim=comm.size - 1)
        out.write_text(json.dumps(report))
    sys.exit(0)


if __name__ == "__main__":
    main()
