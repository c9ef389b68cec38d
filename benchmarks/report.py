"""Ratio tables (moecomm auto vs the best peer; one run vs another) and ``moecomm report``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import click

from .sweep import best_algbw, geomean

# size ranges of the summary: (name, lowest size included, highest size included)
RANGES = (("<=64KiB", 0, 64 << 10), ("64KiB-4MiB", (64 << 10) + 1, 4 << 20), (">4MiB", (4 << 20) + 1, 1 << 62))


def _groups(rows: Sequence[dict]) -> tuple[dict, tuple[bool, bool]]:
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


def ratio_table(rows: Sequence[dict], *, base: str = "auto") -> list[str]:
    """moecomm ``base`` (auto) against the best external peer, per op and size range.

    Per size the ratio is base algbw / best peer algbw (each the better checked variant, see
    :func:`sweep.best_algbw`); the table gives geometric means over the sizes of each range, the
    peer that was best most often, and the ratio against every peer. Empty when the rows hold no
    ``base`` or no external peer.
    """
    g, varied = _groups(rows)
    peers = list(dict.fromkeys(r["transport"] for r in rows if r.get("library", "moecomm") != "moecomm"))
    if not peers or not any(base in by_peer for sizes in g.values() for by_peer in sizes.values()):
        return []
    w = max([14] + [len(_opname(k, varied)) for k in g])
    head = f"{'op':<{w}} {'sizes':<11} {'n':>3} {base + ' GB/s':>11}  {'best peer':<9} {'peer GB/s':>10} {'ratio':>7}"
    head += "".join(f" {'vs ' + p:>10}" for p in peers)
    lines = [f"# moecomm {base} vs the best peer: algbw ratio, geometric mean over the sizes of each range "
             "(>1: moecomm faster)", "# " + head]
    for key, by_size in g.items():
        for rname, lo, hi in RANGES:
            pts = [(s, d) for s, d in sorted(by_size.items()) if lo <= s <= hi and base in d
                   and any(p in d for p in peers)]
            if not pts:
                continue
            best = [max(((d[p][0], p) for p in peers if p in d)) for _, d in pts]
            mine = [d[base][0] for _, d in pts]
            who = max(set(b[1] for b in best), key=[b[1] for b in best].count)
            line = (f"{_opname(key, varied):<{w}} {rname:<11} {len(pts):>3} {geomean(mine):>11.4f}  {who:<9} "
                    f"{geomean(b[0] for b in best):>10.4f} {geomean(m / b[0] for m, b in zip(mine, best)):>7.2f}")
            for p in peers:
                rs = [d[base][0] / d[p][0] for _, d in pts if p in d]
                line += f" {geomean(rs):>10.2f}" if rs else f" {'-':>10}"
            lines.append("  " + line)
    return lines


def compare_runs(runs: Sequence[tuple[str, Sequence[dict]]]) -> list[str]:
    """Each later run against the first: algbw ratio per peer, op and size range (geomean over the
    sizes both runs measured). Peers are matched by label (shm, auto, gloo, ...)."""
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
        lines.append(f"# {label} vs {ref_label}: algbw ratio, geometric mean over common sizes (>1: {label} faster)")
        w = max([14] + [len(_opname(k, varied)) for k in cur])
        lines.append("# " + f"{'op':<{w}} {'sizes':<11}" + "".join(f" {p:>10}" for p in peers))
        for key, by_size in cur.items():
            if key not in ref:
                continue
            for rname, lo, hi in RANGES:
                cells, any_val = [], False
                for p in peers:
                    rs = [d[p][0] / ref[key][s][p][0] for s, d in by_size.items()
                          if lo <= s <= hi and p in d and s in ref[key] and p in ref[key][s]]
                    any_val |= bool(rs)
                    cells.append(f" {geomean(rs):>10.2f}" if rs else f" {'-':>10}")
                if any_val:
                    lines.append("  " + f"{_opname(key, varied):<{w}} {rname:<11}" + "".join(cells))
    return lines


def describe_run(label: str, run: dict) -> str:
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
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="Plot every run's algbw and busbw vs size on one figure.")
@click.option("--labels", default=None, help="Comma-separated names of the runs (default: file names).")
@click.option("--title", default="", help="Figure title.")
def report(files, plot_path, labels, title):
    """Summarize saved runs (`moecomm bench --json/--csv`): ratio tables, and one figure with all runs."""
    from .output import load_run

    try:
        runs = [load_run(f) for f in files]
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    names = [s.strip() for s in labels.split(",")] if labels else _labels(files)
    if len(names) != len(runs):
        raise click.BadParameter(f"{len(names)} labels for {len(runs)} files", param_hint="--labels")
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

        fig = plot_runs([(n if len(runs) > 1 else "", r["rows"]) for n, r in zip(names, runs)], plot_path,
                      title=title or "moecomm report: " + ", ".join(names))
        click.echo(f"# wrote {fig.path.resolve()}")
    sys.stdout.flush()
