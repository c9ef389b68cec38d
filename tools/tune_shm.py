"""Measure the shm transport's all-reduce algorithms and slot sizes side by side.

    python -m tools.tune_shm --nprocs 2 --sizes 8K,256K,4M,64M [--json RUN.json]

Every configuration (slot size x one-shot or two-shot) is a launch of its own with the
settings passed as ``options=`` (``shm_slot_bytes``, ``shm_one_shot_max``; see
``transports/settings.py``), nothing set in the environment. Repetitions go round all
configurations in turn, so drift hits all alike. Every call is timed on its own and averaged across
ranks, as ``moecomm bench`` times them; a repetition's figure is its median call, and the median
repetition is reported (the best repetition of a back-to-back loop's mean, as before 2026-11-23, came
out 1.1-1.8x faster than the bench's medians at the same sizes, so the two did not pool). The results
chose the default of ``MOECOMM_SHM_SLOT_BYTES`` (``transports/settings.py``); see
``benchmarks/results/shm-allreduce-tuning.txt``. ``--json`` saves the measurements as a ``moecomm bench``
run (one row per size, configuration; ``algorithm`` one_shot or two_shot) that
``collectives.model.calibrate`` fits: the one-shot/two-shot switch point comes from that fit.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import click
import torch

from benchmarks.common import Row, bus_factor, format_size, parse_size
from benchmarks.options import COUNT, comma_list
from benchmarks.table import Column, Table
from transports.settings import SETTINGS
from transports.shm import ONE_SHOT_UNBOUNDED



def configs(slots: Sequence[int]) -> dict[str, dict[str, int]]:
    """The configurations measured: label -> ``options=`` of ``collectives.launch``.

    Args:
        slots: shm slot sizes in bytes.

    Returns:
        For each slot, "one_shot/slot <size>" (every all_reduce one-shot) and "two_shot/slot <size>".
    """
    out = {}
    for slot in slots:
        label = format_size(slot).replace(" ", "")
        out[f"one_shot/slot {label}"] = {"shm_slot_bytes": slot, "shm_one_shot_max": ONE_SHOT_UNBOUNDED}
        out[f"two_shot/slot {label}"] = {"shm_slot_bytes": slot, "shm_one_shot_max": 0}
    return out


def _measure(comm, sizes: Sequence[int]) -> dict[int, tuple[float, float]]:
    """(mean, median) seconds per float32 sum all_reduce at each size, every call timed on its own and
    the times averaged across ranks call by call (collective)."""
    out = {}
    for size in sizes:
        x = torch.randn(max(size // 4, 1))
        y = torch.empty_like(x)
        iters = max(3, min(2000, int(4e8 / max(size, 1) / 20)))
        for _ in range(2):
            comm.all_reduce(x, out=y)
        comm.barrier()
        times = torch.empty(iters, dtype=torch.float64)
        for i in range(iters):
            t0 = time.perf_counter()
            comm.all_reduce(x, out=y)
            times[i] = time.perf_counter() - t0
        times = comm.all_reduce(times, op="avg")
        out[size] = (float(times.mean()), float(times.median()))
    return out


def _sizes(text: str, hint: str, setting: str | None = None) -> list[int]:
    """Comma-separated byte sizes, each checked by ``transports.settings`` ``setting`` if given."""
    try:
        out = [parse_size(s) for s in comma_list(text)]
        if setting is not None:
            for size in out:
                SETTINGS[setting].parse(size, source="shm slot")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None
    if not out:
        raise click.BadParameter("no size given", param_hint=hint)
    return out


@click.command()
@click.option("--nprocs", type=COUNT, default=2, show_default=True)
@click.option("--sizes", default="8K,64K,256K,1M,4M,16M,64M", show_default=True, help="Message sizes.")
@click.option("--slots", default="1M,4M,16M", show_default=True, help="Slot sizes to try.")
@click.option("--reps", type=COUNT, default=3, show_default=True, help="Rounds over every configuration.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also save the times as a moecomm bench run (for collectives.model.calibrate).")
def main(nprocs: int, sizes: str, slots: str, reps: int, json_path: str | None) -> None:
    """Print algbw (GB/s, float32 sum, slowest rank) per size and configuration."""
    import collectives

    size_list, cfgs = _sizes(sizes, "--sizes"), configs(_sizes(slots, "--slots", "shm_slot_bytes"))
    reps_seen: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(reps):
        for name, options in cfgs.items():
            seconds = collectives.launch(_measure, nprocs, size_list, transport="shm", options=options)[0]
            for size, mean_median in seconds.items():
                reps_seen.setdefault((size, name), []).append(mean_median)
    # the median repetition, by its mean and by its median call
    mean = {k: statistics.median(m for m, _ in v) for k, v in reps_seen.items()}
    median = {k: statistics.median(p for _, p in v) for k, v in reps_seen.items()}
    table = Table([Column("size", 10), *(Column(name, 20, ".2f") for name in cfgs)])
    click.echo(f"# shm all_reduce float32 sum, {nprocs} ranks, median call (averaged across ranks), median of "
               f"{reps} repetitions, algbw GB/s")
    for line in [*table.header(), *(table.line(size, *(size / median[(size, name)] / 1e9 for name in cfgs))
                                    for size in size_list)]:
        click.echo(line)
    if json_path:
        from benchmarks.output import environment, make_run, save_json

        options = {"nprocs": nprocs, "sizes": size_list, "slots": slots, "reps": reps}
        rows = [_row(size, options, mean[(size, name)], median[(size, name)], nprocs)
                for name, options in cfgs.items() for size in size_list]
        save_json(json_path, make_run(rows, environment({"nranks": nprocs, "nodes": 1, "launch": "launch"}),
                                      options, [f"median of {reps} repetitions; configuration in each row's algorithm"]))
        click.echo(f"# saved {json_path}")


def _row(size: int, options: dict[str, int], seconds: float, median: float, nprocs: int) -> Row:
    """One measurement as a bench row (``seconds``: mean call, ``median``: median call, its ``p50_us``):
    ``algorithm`` one_shot or two_shot; ``transport`` "shm" at the default slot size, "shm/slot <size>"
    at the others (so that a fit never mixes slot sizes)."""
    algbw = size / seconds / 1e9
    slot = options["shm_slot_bytes"]
    transport = "shm" if slot == SETTINGS["shm_slot_bytes"].default else f"shm/slot {format_size(slot).replace(' ', '')}"
    algorithm = "one_shot" if options["shm_one_shot_max"] else "two_shot"
    return Row(op="all_reduce", transport=transport, size=size, count=max(size // 4, 1), dtype="float32",
               redop="sum", time_us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor("all_reduce", nprocs),
               wrong=-1, algorithm=algorithm, nranks=nprocs, device="cpu", p50_us=median * 1e6)


if __name__ == "__main__":
    main()
