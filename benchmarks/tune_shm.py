"""Measure the shm transport's all-reduce algorithms and slot sizes side by side.

    python -m benchmarks.tune_shm --nprocs 2 --sizes 8K,256K,4M,64M

Every configuration is a sub-communicator over the same ranks (its own segment, slot size and
one-shot limit), measured in turn at each size and repetition, so drift hits all alike; the best
of the repetitions is reported. The results set ``ONE_SHOT_MAX_BYTES`` and ``DEFAULT_SLOT_BYTES``
in transports/shm.py.
"""

from __future__ import annotations

import os
import time

import click
import torch

from .sweep import parse_size

UNBOUNDED = 1 << 62


def _configs(slots: list[int]) -> dict[str, tuple[int, int]]:
    out = {}
    for slot in slots:
        label = f"{slot >> 20}M" if slot >= 1 << 20 else f"{slot >> 10}K"
        out[f"one_shot/slot {label}"] = (slot, UNBOUNDED)
        out[f"two_shot/slot {label}"] = (slot, 0)
    return out


def _sub(comm, slot: int, one_shot_max: int):
    os.environ["MOECOMM_SHM_SLOT_BYTES"] = str(slot)
    os.environ["MOECOMM_SHM_ONE_SHOT_MAX"] = str(one_shot_max)
    try:
        return comm.split(0)
    finally:
        del os.environ["MOECOMM_SHM_SLOT_BYTES"], os.environ["MOECOMM_SHM_ONE_SHOT_MAX"]


def _measure(comm, configs: dict, sizes: list[int], reps: int) -> dict:
    comms = {name: _sub(comm, *cfg) for name, cfg in configs.items()}
    best: dict = {}
    for size in sizes:
        x = torch.randn(max(size // 4, 1))
        out = torch.empty_like(x)
        iters = max(3, min(2000, int(4e8 / max(size, 1) / 20)))
        for _ in range(reps):
            for name, c in comms.items():
                for _ in range(2):
                    c.all_reduce(x, out=out)
                c.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    c.all_reduce(x, out=out)
                dt = (time.perf_counter() - t0) / iters
                dt = float(comm.all_reduce(torch.tensor([dt], dtype=torch.float64), op="max")[0])
                best[(size, name)] = min(best.get((size, name), dt), dt)
    for c in comms.values():
        c.close()
    return best


@click.command()
@click.option("--nprocs", default=2, show_default=True)
@click.option("--sizes", default="8K,64K,256K,1M,4M,16M,64M", show_default=True)
@click.option("--slots", default="1M,4M,16M", show_default=True, help="Slot sizes to try.")
@click.option("--reps", default=3, show_default=True)
def main(nprocs: int, sizes: str, slots: str, reps: int) -> None:
    """Print algbw (GB/s, float32 sum, slowest rank) per size and configuration."""
    import collectives

    size_list = [parse_size(s) for s in sizes.split(",")]
    configs = _configs([parse_size(s) for s in slots.split(",")])
    best = collectives.launch(_measure, nprocs, configs, size_list, reps)[0]
    names = list(configs)
    print(f"# shm all_reduce float32 sum, {nprocs} ranks, best of {reps}, algbw GB/s (slowest rank's time)")
    print(f"{'size':>10} " + " ".join(f"{n:>20}" for n in names))
    for size in size_list:
        print(f"{size:>10} " + " ".join(f"{size / best[(size, n)] / 1e9:>20.2f}" for n in names))


if __name__ == "__main__":
    main()
