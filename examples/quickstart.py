"""A tour of moecomm's collectives on 4 local ranks, every result checked against plain torch.

What it shows: ``collectives.launch`` starts 4 ranks on this machine and calls ``main(comm)`` on each,
with ``comm`` a Communicator over the 4 of them. ``main`` runs all_reduce (sum, max), all_gather,
reduce_scatter, all_to_all with uneven counts (some 0), broadcast, split into two sub-groups,
``comm.plan`` (which transport and algorithm a call would use, and why) and barrier. Each rank's input
is seeded random numbers that any rank can recompute, so every rank computes what each call must
return with torch alone and compares; a mismatch on any rank raises (``launch`` re-raises it).
Rank 0 prints "<step>: ok" once every rank agrees.

Run it as it is (a few seconds on CPU; no GPU needed)::

    pip install -e .
    python examples/quickstart.py

It uses the CPU (``device="cpu"``). On GPUs, leave ``device`` out: ``launch`` binds rank r to
``cuda:r`` (``comm.device``; one GPU per rank), and tensors moved there with ``.to(comm.device)``
run over NCCL or moecomm's ipc transport.
"""

from __future__ import annotations

import argparse

import torch

import collectives

RANKS, ROWS, COLS = 4, 8, 3


def seeded(seed: int, rows: int = ROWS) -> torch.Tensor:
    """[rows, COLS] float32 random numbers that any rank can recompute from the seed."""
    return torch.randn(rows, COLS, generator=torch.Generator().manual_seed(seed))


def check(comm: collectives.Communicator, step: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise unless ``got`` matches torch's ``want`` on every rank; then rank 0 prints "<step>: ok"."""
    good = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # the ranks agree on the outcome (bool "min": True only if True everywhere), so "ok" means every rank
    everywhere = bool(comm.all_reduce(torch.tensor(good), op="min"))
    if not good:
        raise AssertionError(f"{step} on rank {comm.rank}: got\n{got}\nbut torch gives\n{want}")
    if not everywhere:
        raise AssertionError(f"{step}: another rank's result differs from torch's")
    if comm.rank == 0:
        print(f"{step}: ok", flush=True)


def main(comm: collectives.Communicator) -> None:
    n, r = comm.size, comm.rank
    xs = [seeded(src) for src in range(n)]  # every rank's input; this rank passes only its own
    x = xs[r]                               # [ROWS, COLS], different on every rank

    # all_reduce: every rank gets the elementwise reduction over the ranks
    check(comm, "all_reduce sum", comm.all_reduce(x, op="sum"), torch.stack(xs).sum(0))
    check(comm, "all_reduce max", comm.all_reduce(x, op="max"), torch.stack(xs).amax(0))

    # all_gather: every rank's x, concatenated along dim 0 in rank order -> [n * ROWS, COLS]
    check(comm, "all_gather", comm.all_gather(x), torch.cat(xs))

    # reduce_scatter: the sum, of which this rank keeps its block of dim 0 -> [ROWS // n, COLS]
    block = ROWS // n
    check(comm, "reduce_scatter", comm.reduce_scatter(x, op="sum"), torch.stack(xs).sum(0)[r * block:(r + 1) * block])

    # all_to_all: rank r sends (r + d) % 3 rows to rank d, so some counts are 0. The receivers
    # need not know their counts: return_counts=True hands them back with the rows.
    def counts(src: int) -> list[int]:
        return [(src + dst) % 3 for dst in range(n)]

    sends = [seeded(100 + src, sum(counts(src))) for src in range(n)]   # each rank's rows, grouped by destination
    got, recv_counts = comm.all_to_all(sends[r], counts(r), return_counts=True)
    # what rank r must get: from each source, the rows that source addressed to r, in source order
    want = torch.cat([sends[s].split(counts(s))[r] for s in range(n)])
    check(comm, "all_to_all (uneven)", got, want)
    check(comm, "all_to_all recv_counts", recv_counts, torch.tensor([counts(s)[r] for s in range(n)]))

    # broadcast: rank 2's x on every rank (the other ranks' x only gives the shape and dtype)
    check(comm, "broadcast from rank 2", comm.broadcast(x, src=2), xs[2])

    # split: ranks passing the same color form a sub-group (MPI_Comm_split): even {0, 2}, odd {1, 3}
    half = comm.split(color=r % 2)
    assert half.size == 2 and half.rank == r // 2  # ranks inside the group keep their order
    check(comm, "split + all_reduce in each half", half.all_reduce(x), sum(xs[s] for s in range(r % 2, n, 2)))
    half.close()  # a sub-group owns its transports: close it when done

    # plan: which transport and algorithm a call would use here, and why (local: no communication)
    if r == 0:
        print(f"plan: {comm.plan('all_reduce', x)}", flush=True)

    # barrier: returns once every rank has reached it
    comm.barrier()
    if r == 0:
        print("barrier: ok", flush=True)


if __name__ == "__main__":  # required: launch's ranks import this module, and must not launch again
    # it takes no options: --help shows the docstring above, anything else is refused, not ignored
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    collectives.launch(main, RANKS, device="cpu")  # main(comm) on 4 local CPU ranks; raises if any rank does
