"""Repeated ``moecomm bench --compare`` runs side by side: the ratio table's and the memcpy table's
cells of every run and their median, as Markdown (one machine repeats itself only so well).

    python -m tools.repeat_summary RUN1.json RUN2.json RUN3.json [--peer mpi4py]
"""

from __future__ import annotations

import statistics

import click

from benchmarks.output import load_run
from benchmarks.report import memcpy_table, ratio_table


def _cells(lines: list[str], column: int) -> dict[tuple[str, str], float]:
    """(op, size range) -> the number in ``column`` of each data line of a report table."""
    out = {}
    for line in lines:
        fields = line.split()
        if fields and not line.startswith("#") and len(fields) > column:
            out[(fields[0], fields[1])] = float(fields[column])
    return out


def _markdown(title: str, per_run: list[dict], fmt: str) -> list[str]:
    keys = list(dict.fromkeys(k for cells in per_run for k in cells))
    runs = " | ".join(f"run {i + 1}" for i in range(len(per_run)))
    lines = [f"**{title}**", "", f"| op | sizes | {runs} | median |", "|---|---|" + "---|" * (len(per_run) + 1)]
    for key in keys:
        values = [cells[key] for cells in per_run if key in cells]
        shown = " | ".join(format(cells[key], fmt) if key in cells else "-" for cells in per_run)
        lines.append(f"| {key[0]} | {key[1]} | {shown} | {format(statistics.median(values), fmt)} |")
    return lines


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--peer", default="mpi4py", show_default=True, help="The peer whose ratio column is shown.")
def main(runs: tuple[str, ...], peer: str) -> None:
    """Print the per-run and median cells of RUNS' ratio (auto vs PEER) and memcpy (auto %) tables."""
    ratios, fractions = [], []
    for path in runs:
        rows = load_run(path)["rows"]
        table = ratio_table(rows)
        header = next((line.split() for line in table if line.startswith("# op")), [])
        # data lines: op, sizes, n, auto GB/s, best peer, peer GB/s, ratio, then one "vs <peer>" column each
        against = [header[i + 1] for i, token in enumerate(header[:-1]) if token == "vs"]
        ratios.append(_cells(table, 7 + against.index(peer)) if peer in against else {})
        memcpy = memcpy_table(rows)
        fractions.append(_cells(memcpy, 4))  # op, sizes, n, memcpy GB/s, auto %
    click.echo("\n".join(_markdown(f"moecomm auto vs {peer}: algbw ratio (geometric mean over each range's sizes)",
                                   ratios, ".2f")))
    click.echo("")
    click.echo("\n".join(_markdown("auto's busbw as % of the memcpy reference", fractions, ".1f")))


if __name__ == "__main__":
    main()
