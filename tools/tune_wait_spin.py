"""How long should a wait after a large copy busy-poll before it sleeps? (run under mpiexec)

    mpiexec -n 2 python -m tools.tune_wait_spin [--sizes 4M,8M,16M,32M] [--budgets 0,100,200,1000]

For each op (all_gather out of place and in place, all_to_all) and size, the shm transport's
spin budget (``LARGE_WAIT_SPIN_NS``, in us here) is switched between the given values every
10 calls, in turn, so that the machine's drift hits every value alike; each value's median call
time (averaged over ranks) is printed. Budget 0: sleep on the futex as soon as the compiled
helper's short spin ends. The numbers chose ``transports.shm.LARGE_WAIT_SPIN_NS``
(``benchmarks/results/shm-large-wait-spin.txt``).
"""

from __future__ import annotations

import statistics
import time

import click
import torch

import collectives
from benchmarks.common import format_size, parse_size
from benchmarks.options import comma_list


def _calls(comm, op: str, nbytes: int):
    """A no-argument call of ``op`` on ``nbytes`` (all_gather: the gathered output; all_to_all: what a
    rank sends), float32, with its output allocated once."""
    n, me = comm.size, comm.rank
    numel = max(nbytes // 4 // n, 1) * n
    if op == "all_to_all":
        x, out = torch.randn(numel), torch.empty(numel)
        return lambda: comm.all_to_all(x, out=out)
    out = torch.empty(numel)
    block = numel // n
    x = out[me * block : (me + 1) * block] if op == "all_gather in place" else torch.randn(block)
    if op == "all_gather in place":
        x.copy_(torch.randn(block))
    return lambda: comm.all_gather(x, out=out)


@click.command()
@click.option("--sizes", default="4M,8M,16M,32M", show_default=True, help="Sizes (nccl-tests' size of each op).")
@click.option("--budgets", default="0,100,200,1000", show_default=True, help="Spin budgets to compare, in us.")
@click.option("--blocks", type=int, default=40, show_default=True, help="Blocks of 10 timed calls per op and size.")
def main(sizes: str, budgets: str, blocks: int) -> None:
    comm = collectives.init()
    shm = comm.transports["shm"]
    spins = [int(float(b) * 1000) for b in comma_list(budgets)]
    if comm.rank == 0:
        click.echo(f"# {comm.size} ranks, shm single copy: {shm.single_copy_status}; median us per call "
                   f"(mean over ranks), budgets switched every 10 calls, {blocks} blocks")
    for size in (parse_size(s) for s in comma_list(sizes)):
        for op in ("all_gather", "all_gather in place", "all_to_all"):
            call = _calls(comm, op, size)
            for _ in range(3):
                call()
            times: dict[int, list[float]] = {s: [] for s in spins}
            for blk in range(blocks):
                spin = spins[blk % len(spins)]
                shm._large_spin_ns = spin
                comm.barrier()
                for _ in range(10):
                    t = time.perf_counter()
                    call()
                    times[spin].append(time.perf_counter() - t)
            med = torch.tensor([statistics.median(times[s]) * 1e6 for s in spins], dtype=torch.float64)
            med = comm.all_reduce(med) / comm.size
            if comm.rank == 0:
                cells = "  ".join(f"{s / 1000:g} us: {t:7.0f}" for s, t in zip(spins, med.tolist()))
                click.echo(f"{op:>20} {format_size(size):>8}  {cells}")
    comm.close()


if __name__ == "__main__":
    main()
