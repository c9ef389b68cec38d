"""Ratio tables (moecomm auto vs the best peer; one run vs another) and ``moecomm report``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import click

from .common import best_algbw, geomean
from .options import FIGURE
from .table import Column, Table

# size ranges of the summary: (name, lowest size included, highest size included)
RANGES = (("<=64KiB", 0, 64 << 10), ("64KiB-4MiB", (64 << 10) + 1, 4 << 20), (">4MiB", (4 << 20) + 1, 1 << 62))


def _groups(rows: Sequence[Mapping[str, Any]]) -> tuple[dict, tuple[bool, bool]]:
    """(op, dtype, redop) -> size -> peer -> (bandwidth, library); and whether dtype, redop vary."""
    g: dict = {}
    for r in rows:
        bw = best_algbw(r)
        if bw is None or bw <= 0 or r["size"] <= 0:
            continue
        g.setdefault((r["op"], r["dtype"], r["redop"]), {}).setdefault(r["size"], {})[r["transport"]] = (
            bw, r.get("library", "moecomm"))
    varied = (len({k[1] for k in g}) > 1, len({k[2] for k in g if k[2] != "none"}) > 1)
    return g, varied


def _opname(key: tuple, varied: tuple[bool, bool]) -> str:
    op, dtype, redop = key
    extra = [dtype] if varied[0] else []
    extra += [redop] if varied[1] and redop != "none" else []
    return f"{op}({','.join(extra)})" if extra else op


def _ratio_cell(values: Sequence[float]) -> str | float:
    """Geometric mean of ratios, or "-" when there are none."""
    return geomean(values) if values else "-"


def _range_columns(keys: Sequence[tuple], varied: tuple[bool, bool]) -> list[Column]:
    """The op and size-range columns that start every ratio table."""
    width = max([14] + [len(_opname(k, varied)) for k in keys])
    return [Column("op", width, align="<", gap=2), Column("sizes", 11, align="<")]


def ratio_table(rows: Sequence[Mapping[str, Any]], *, base: str = "auto") -> list[str]:
    """moecomm ``base`` (auto) against the best external peer, per op and size range.

    Per size the ratio is base algbw / best peer algbw (each the better checked variant, see
    :func:`common.best_algbw`); the table gives geometric means over the sizes of each range, the
    peer that was best most often, and the ratio against every peer.

    Args:
        rows: :class:`common.Row` dicts of one run.
        base: the moecomm peer compared with the others.

    Returns:
        The table's lines; empty when the rows hold no ``base`` or no external peer.
    """
    g, varied = _groups(rows)
    peers = list(dict.fromkeys(r["transport"] for r in rows if r.get("library", "moecomm") != "moecomm"))
    if not peers or not any(base in by_peer for sizes in g.values() for by_peer in sizes.values()):
        return []
    table = Table(_range_columns(list(g), varied) + [
        Column("n", 3), Column(f"{base} GB/s", 11, ".4f"), Column("best peer", 9, align="<", gap=2),
        Column("peer GB/s", 10, ".4f"), Column("ratio", 7, ".2f"), *(Column(f"vs {p}", 10, ".2f") for p in peers)])
    lines = [f"# moecomm {base} vs the best peer: algbw ratio, geometric mean over the sizes of each range "
             "(>1: moecomm faster)", *table.header()]
    for key, by_size in g.items():
        for rname, lo, hi in RANGES:
            pts = [d for s, d in sorted(by_size.items()) if lo <= s <= hi and base in d and any(p in d for p in peers)]
            if not pts:
                continue
            best = [max((d[p][0], p) for p in peers if p in d) for d in pts]
            mine = [d[base][0] for d in pts]
            who = max(set(b[1] for b in best), key=[b[1] for b in best].count)
            lines.append(table.line(_opname(key, varied), rname, len(pts), geomean(mine), who,
                                    geomean(b[0] for b in best), geomean(m / b[0] for m, b in zip(mine, best)),
                                    *(_ratio_cell([d[base][0] / d[p][0] for d in pts if p in d]) for p in peers)))
    return lines


def compare_runs(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[str]:
    """Each later run against the first: algbw ratio per peer, op and size range.

    Args:
        runs: (label, rows) per run; peers are matched by label (shm, auto, gloo, ...).

    Returns:
        The tables' lines (geometric means over the sizes both runs measured); empty for one run.
    """
    if len(runs) < 2:
        return []
    ref_label, ref_rows = runs[0]
    ref, _ = _groups(ref_rows)
    lines = []
    for label, rows in runs[1:]:
        cur, varied = _groups(rows)
        peers = list(dict.fromkeys(p for key in cur if key in ref for s in cur[key] if s in ref[key]
                                   for p in cur[key][s] if p in ref[key][s]))
        if not peers:
            lines.append(f"# {label} vs {ref_label}: no op, size and peer in common")
            continue
        table = Table(_range_columns(list(cur), varied) + [Column(p, 10, ".2f") for p in peers])
        lines.append(f"# {label} vs {ref_label}: algbw ratio, geometric mean over common sizes (>1: {label} faster)")
        lines += table.header()
        for key, by_size in cur.items():
            if key not in ref:
                continue
            for rname, lo, hi in RANGES:
                cells = [[d[p][0] / ref[key][s][p][0] for s, d in by_size.items()
                          if lo <= s <= hi and p in d and s in ref[key] and p in ref[key][s]] for p in peers]
                if any(cells):
                    lines.append(table.line(_opname(key, varied), rname, *map(_ratio_cell, cells)))
    return lines


def describe_run(label: str, run: Mapping[str, Any]) -> str:
    """One ``#`` line saying where and with what a saved run was made."""
    e = run.get("env", {})
    peers = ", ".join(dict.fromkeys(r["transport"] for r in run["rows"]))
    gpu = f", {e['gpu_count']}x {e['gpu_model']}" if e.get("gpu_model") else ""
    return (f"# {label}: {e.get('nranks', '?')} ranks ({e.get('launch', '?')}) on {e.get('hostname', '?')}, "
            f"{e.get('cpus', '?')} CPUs ({e.get('cpu_model', '?')}){gpu}; torch {e.get('torch', '?')}, "
            f"moecomm {e.get('moecomm', '?')}; peers: {peers}; {len(run['rows'])} rows")


def _labels(paths: Sequence[str]) -> list[str]:
    stems = [Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--plot", "plot_path", type=FIGURE, default=None,
              help="Plot every run's algbw and busbw vs size on one figure.")
@click.option("--labels", default=None, help="Comma-separated names of the runs (default: file names).")
@click.option("--title", default="", help="Figure title.")
def report(files: tuple[str, ...], plot_path: str | None, labels: str | None, title: str) -> None:
    """Summarize saved runs (`moecomm bench --json/--csv`): ratio tables, and one figure with all runs."""
    from .output import load_run

    try:
        runs = [load_run(f) for f in files]
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    names = [s.strip() for s in labels.split(",")] if labels else _labels(files)
    if len(names) != len(runs) or not all(names):
        raise click.BadParameter(f"{len(names)} labels ({labels!r}) for {len(runs)} files; give one non-empty "
                                 "label per file", param_hint="--labels")
    for name, run in zip(names, runs):
        click.echo(describe_run(name, run))
    for name, run in zip(names, runs):
        table = ratio_table(run["rows"])
        if table:
            click.echo(f"\n# {name}")
            for line in table:
                click.echo(line)
    cross = compare_runs(list(zip(names, [r["rows"] for r in runs])))
    if cross:
        click.echo("")
        for line in cross:
            click.echo(line)
    if plot_path:
        from .plot import plot_runs

        try:
            fig = plot_runs([(n if len(runs) > 1 else "", r["rows"]) for n, r in zip(names, runs)], plot_path,
                            title=title or "moecomm report: " + ", ".join(names))
        except (OSError, ValueError) as e:
            raise click.ClickException(f"no plot written: {e}") from None
        click.echo(f"# wrote {fig.path.resolve()}")
    sys.stdout.flush()
