"""Ratio tables (moecomm auto vs the best peer; one run vs another), each op's busbw as a fraction of
the memcpy reference, and ``moecomm report``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import click

from .common import MEMCPY, REFERENCE, best_algbw, geomean
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
    ops = [k for k in g if k[0] != MEMCPY]  # the reference copies uint8 whatever the sweep's dtypes
    varied = (len({k[1] for k in ops}) > 1, len({k[2] for k in ops if k[2] != "none"}) > 1)
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
    peers = list(dict.fromkeys(r["transport"] for r in rows if r.get("library", "moecomm") not in ("moecomm", REFERENCE)))
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


def memcpy_table(rows: Sequence[Mapping[str, Any]], *, base: str = "auto") -> list[str]:
    """Each op's busbw as a percentage of the memcpy reference measured at the same size in the same run.

    Per row the fraction is the peer's busbw (its better checked variant, out-of-place or in-place,
    :func:`common.best_algbw`) / the memcpy rows' busbw at that size; the table gives per op and size
    range (:data:`RANGES`) the reference's GB/s and, per peer (``base`` first), 100 x the fractions'
    geometric mean over the sizes.

    How to read it: a rank that must also copy its own block (out-of-place all_gather; all_to_all,
    whose in-place variant is not checked and so not counted) reads and writes the whole ``size``
    like the reference, but busbw counts only the (n-1)/n that crossed between ranks, so with one
    copying thread per rank it tops out near (n-1)/n of the reference (50% at 2 ranks); in-place
    all_gather (own block already in place) can reach 100%. Below the last-level cache size the
    reference's buffers stay cached across iterations (so do the ops', but they touch more buffers).

    Args:
        rows: :class:`common.Row` dicts of one run.
        base: the peer in the first column (moecomm auto) when the run has it.

    Returns:
        The table's lines; empty when the rows hold no memcpy reference (runs saved before it
        existed, or without ``--compare``/``--memcpy``).
    """
    ref = {}
    for r in rows:
        bw = best_algbw(r, bus=True) if r["op"] == MEMCPY else None
        if bw and r["size"] > 0:
            ref[r["size"]] = bw
    g: dict = {}
    for r in rows:
        bw = best_algbw(r, bus=True)
        if r["op"] == MEMCPY or r["size"] not in ref or not bw:
            continue
        g.setdefault((r["op"], r["dtype"], r["redop"]), {}).setdefault(r["size"], {})[r["transport"]] = bw / ref[r["size"]]
    if not g:
        return []
    peers = list(dict.fromkeys(p for by_size in g.values() for d in by_size.values() for p in d))
    peers.sort(key=lambda p: p != base)  # stable: base first, the others in the run's order
    _, varied = _groups(rows)
    table = Table(_range_columns(list(g), varied) + [Column("n", 3), Column("memcpy GB/s", 11, ".3f"),
                                                     *(Column(f"{p} %", 9, ".1f") for p in peers)])
    lines = ["# busbw as % of the memcpy reference at the same size (each peer's better checked variant of "
             "out-of-place and in-place); geometric mean over the sizes of each range", *table.header()]
    for key, by_size in g.items():
        for rname, lo, hi in RANGES:
            pts = [(s, d) for s, d in sorted(by_size.items()) if lo <= s <= hi]
            if pts:
                lines.append(table.line(_opname(key, varied), rname, len(pts), geomean(ref[s] for s, _ in pts),
                                        *(_ratio_cell([100 * d[p] for _, d in pts if p in d]) for p in peers)))
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


# ---- a measured run beside the model's prediction (--predict) ------------------------------------
PREDICTED = Table([Column("op", 14), Column("size", 12, unit="(B)"), Column("type", 9), Column("peer", 8, align="<", gap=2),
                   Column("time", 10, ".2f", "(us)", gap=2), Column("busbw", 9, ".3f", "(GB/s)"),
                   Column("time", 10, ".2f", "(us)", gap=2), Column("busbw", 9, ".3f", "(GB/s)"),
                   Column("error", 7, "+.1f", "(%)"), Column("algorithm", align="<", gap=2)],
                  groups=[("measured", 4, 5), ("predicted", 6, 9)])


def run_shape(run: Mapping[str, Any]) -> tuple[int, int]:
    """(nodes, ranks) a saved run was made with (its env; the rows' nranks for older runs)."""
    env = run.get("env", {})
    ranks = int(env.get("nranks") or max((int(r.get("nranks") or 0) for r in run["rows"]), default=0))
    return int(env.get("nodes") or 1), ranks


def predicted_beside(rows: Sequence[Mapping[str, Any]], system: Any, *, nodes: int, ranks: int,
                     peers: Sequence[str] | None = None, algorithms: Sequence[str] | None = None,
                     protocols: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Each measured point with the model's prediction for the same op, size, dtype, nodes and ranks.

    Args:
        rows: :class:`common.Row` dicts of one run.
        system: a :class:`collectives.model.System`.
        nodes, ranks: the run's shape (:func:`run_shape`); ranks per node = ranks / nodes.
        peers: the measured peers to compare (None: ``auto`` when the run has it, else every peer).
        algorithms, protocols: consider only these (:func:`collectives.model.predict_collective`; None: all).

    Returns:
        Dicts with op, size, dtype, peer, measured ``time_us``/``busbw`` (each peer's better checked
        variant, :func:`common.best_algbw`), ``pred_time_us``, ``pred_algbw``, ``pred_busbw``,
        ``algorithm``, ``protocol`` and ``error_pct`` = 100 (predicted - measured) / measured time.
        Raises ValueError (the model's) for a shape the system cannot hold.
    """
    from collectives.model import predict_collective

    rows = [r for r in rows if r["op"] != MEMCPY]  # the reference is no collective the model predicts
    if peers is None:
        have = list(dict.fromkeys(r["transport"] for r in rows))
        peers = ["auto"] if "auto" in have else have
    cache: dict[tuple, Any] = {}
    out = []
    for r in rows:
        algbw, busbw = best_algbw(r), best_algbw(r, bus=True)
        if r["transport"] not in peers or not algbw or r["size"] <= 0:
            continue
        key = (r["op"], r["size"], r["dtype"])
        if key not in cache:
            cache[key] = predict_collective(system, r["op"], r["size"], nodes=nodes, gpus_per_node=ranks // nodes,
                                            dtype=r["dtype"], algorithms=algorithms, protocols=protocols)
        p = cache[key]
        measured_us = r["size"] / algbw / 1e3  # algbw = size / time (GB/s = 1e3 B/us)
        out.append(dict(op=r["op"], size=r["size"], dtype=r["dtype"], peer=r["transport"], time_us=measured_us,
                        busbw=busbw, pred_time_us=p.time_us, pred_algbw=p.algbw, pred_busbw=p.busbw,
                        algorithm=p.algorithm, protocol=p.protocol,
                        error_pct=100.0 * (p.time_us - measured_us) / measured_us))
    return out


def prediction_lines(points: Sequence[Mapping[str, Any]], system_name: str) -> list[str]:
    """The table of :func:`predicted_beside` and the mean absolute error per op, peer and size range."""
    lines = [f"# measured vs predicted ({system_name}); error = (predicted - measured) / measured time",
             *PREDICTED.header()]
    order = {key: i for i, key in enumerate(dict.fromkeys((p["op"], p["peer"], p["dtype"]) for p in points))}
    points = sorted(points, key=lambda p: (order[p["op"], p["peer"], p["dtype"]], p["size"]))
    lines += [PREDICTED.line(p["op"], p["size"], p["dtype"], p["peer"], p["time_us"], p["busbw"], p["pred_time_us"],
                             p["pred_busbw"], p["error_pct"], f"{p['algorithm']}/{p['protocol']}") for p in points]
    table = Table([Column("op", 14, align="<", gap=2), Column("peer", 8, align="<"), Column("sizes", 11, align="<"),
                   Column("n", 3), Column("mean |error|", 12, ".1f", "(%)"), Column("max |error|", 11, ".1f", "(%)")])
    lines += ["", f"# prediction error ({system_name}) per op and size range", *table.header()]
    for op, peer in dict.fromkeys((p["op"], p["peer"]) for p in points):
        # + ">=64KiB": the size range the local goal (within 20%) is stated for
        for rname, lo, hi in RANGES + ((">=64KiB", 64 << 10, 1 << 62), ("all", 0, 1 << 62)):
            errs = [abs(p["error_pct"]) for p in points if p["op"] == op and p["peer"] == peer and lo <= p["size"] <= hi]
            if errs:
                lines.append(table.line(op, peer, rname, len(errs), sum(errs) / len(errs), max(errs)))
    return lines


def prediction_overlay(points: Sequence[Mapping[str, Any]], label: str) -> dict[str, dict[str, list]]:
    """op -> {label (+ dtype when several): [(size, predicted algbw, predicted busbw)]}: the dashed
    lines :func:`plot.plot_runs` draws over the measured ones."""
    several = len({p["dtype"] for p in points}) > 1
    out: dict[str, dict[str, set]] = {}
    for p in points:
        name = f"{label} {p['dtype']}" if several else label
        out.setdefault(p["op"], {}).setdefault(name, set()).add((p["size"], p["pred_algbw"], p["pred_busbw"]))
    return {op: {k: sorted(v) for k, v in by.items()} for op, by in out.items()}


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
@click.option("--predict", "predict_system", default=None, metavar="SYSTEM",
              help="Put the model's prediction for SYSTEM (moecomm predict --list-systems, or local with "
                   "--calibrate) beside each run, at the run's ranks and nodes; --plot draws it dashed.")
@click.option("--system-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With the prediction: the system described in a JSON file instead of --predict.")
@click.option("--calibrate", "calibrate_run", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --predict local: fit the system to this `moecomm bench --json` run.")
@click.option("--peer", "peer_names", default=None,
              help="With --predict: the measured peers to compare, comma-separated, or all [default: auto, else all].")
def report(files: tuple[str, ...], plot_path: str | None, labels: str | None, title: str, predict_system: str | None,
           system_file: str | None, calibrate_run: str | None, peer_names: str | None) -> None:
    """Summarize saved runs (`moecomm bench --json/--csv`): ratio tables, and one figure with all runs;
    with --predict, the model's prediction and its error beside every measured point."""
    from .output import load_run

    try:
        runs = [load_run(f) for f in files]
    except ValueError as e:  # not a run (corrupt JSON, another file): the argument is wrong
        raise click.BadParameter(str(e), param_hint="FILES") from None
    names = [s.strip() for s in labels.split(",")] if labels else _labels(files)
    if len(names) != len(runs) or not all(names):
        raise click.BadParameter(f"{len(names)} labels ({labels!r}) for {len(runs)} files; give one non-empty "
                                 "label per file", param_hint="--labels")
    for name, run in zip(names, runs):
        click.echo(describe_run(name, run))
    for name, run in zip(names, runs):
        tables = [t for t in (ratio_table(run["rows"]), memcpy_table(run["rows"])) if t]
        if tables:
            click.echo(f"\n# {name}")
        for i, table in enumerate(tables):
            for line in ([""] if i else []) + table:
                click.echo(line)
    cross = compare_runs(list(zip(names, [r["rows"] for r in runs])))
    if cross:
        click.echo("")
        for line in cross:
            click.echo(line)
    overlay: dict[str, dict[str, list]] = {}
    if predict_system or system_file or calibrate_run:
        overlay = _echo_predictions(names, runs, predict_system, system_file, calibrate_run, peer_names)
    if plot_path:
        from .plot import plot_runs

        try:
            fig = plot_runs([(n if len(runs) > 1 else "", r["rows"]) for n, r in zip(names, runs)], plot_path,
                            title=title or "moecomm report: " + ", ".join(names), predicted=overlay)
        except (OSError, ValueError) as e:
            raise click.ClickException(f"no plot written: {e}") from None
        click.echo(f"# wrote {fig.path.resolve()}")
    sys.stdout.flush()


def _echo_predictions(names: Sequence[str], runs: Sequence[Mapping[str, Any]], predict_system: str | None,
                      system_file: str | None, calibrate_run: str | None,
                      peer_names: str | None) -> dict[str, dict[str, list]]:
    """``report --predict``: print each run against the prediction; returns the lines to plot dashed."""
    from .options import comma_list
    from .predict_path import resolve_system, system_summary

    system = resolve_system(predict_system, system_file, calibrate_run, option="--predict")
    click.echo("\n" + system_summary(system))
    overlay: dict[str, dict[str, list]] = {}
    for name, run in zip(names, runs):
        nodes, ranks = run_shape(run)
        if ranks < 1 or ranks % nodes:
            click.echo(f"# {name}: no prediction: {ranks} ranks on {nodes} nodes is not a whole number per node")
            continue
        if ranks // nodes > system.gpus_per_node:
            raise click.UsageError(f"{name} ran {ranks // nodes} ranks per node; {system.name} has "
                                   f"{system.gpus_per_node} GPUs per node: predict a system with at least "
                                   f"{ranks // nodes} (--system-file describes any machine)")
        peers = None if peer_names in (None, "all") else comma_list(peer_names) or None
        if peer_names == "all":
            peers = list(dict.fromkeys(r["transport"] for r in run["rows"]))
        unknown = sorted(set(peers or ()) - {r["transport"] for r in run["rows"]})
        if unknown:
            raise click.BadParameter(f"{name} has no peer {', '.join(unknown)}; it has "
                                     f"{', '.join(dict.fromkeys(r['transport'] for r in run['rows']))}",
                                     param_hint="--peer")
        try:
            points = predicted_beside(run["rows"], system, nodes=nodes, ranks=ranks, peers=peers)
        except ValueError as e:
            raise click.UsageError(f"{system.name} cannot predict {name} ({ranks} ranks on {nodes} nodes): {e}") from None
        click.echo(f"\n# {name}: {ranks} ranks on {nodes} node(s)")
        for line in prediction_lines(points, system.name):
            click.echo(line)
        label = f"predicted ({system.name}, {ranks} ranks)"
        for op, lines in prediction_overlay(points, label).items():
            overlay.setdefault(op, {}).update(lines)
    return overlay
