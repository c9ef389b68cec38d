"""Bandwidth-vs-size figures of one or several runs (matplotlib, Agg backend: no display needed).

The memcpy reference of a run (``bench --compare``) is no peer line: it is drawn in every busbw
panel as a dashed grey line labelled "memcpy reference", the rate the ops' busbw is a fraction of.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from .common import MEMCPY, best_algbw, format_size

_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def series(rows: Sequence[dict]) -> dict[tuple, list[tuple[int, float, float]]]:
    """(op, peer, dtype, redop) -> [(size, algbw, busbw)] sorted by size; bandwidths are each
    peer's better checked variant (:func:`common.best_algbw`), sizes with none are left out; the
    memcpy reference is not a series (:func:`reference_series`)."""
    out: dict[tuple, list] = {}
    for r in rows:
        alg, bus = best_algbw(r), best_algbw(r, bus=True)
        if alg is None or r["size"] <= 0 or r["op"] == MEMCPY:
            continue
        out.setdefault((r["op"], r["transport"], r["dtype"], r["redop"]), []).append((r["size"], alg, bus))
    return {k: sorted(v) for k, v in out.items()}


def reference_series(rows: Sequence[dict]) -> list[tuple[int, float]]:
    """The memcpy reference of a run: [(size, busbw GB/s)] sorted by size (empty when it has none)."""
    return sorted((r["size"], bw) for r in rows
                  if r["op"] == MEMCPY and r["size"] > 0 and (bw := best_algbw(r, bus=True)))


class Figure(NamedTuple):
    """What :func:`plot_runs` wrote."""

    path: Path
    lines: dict[str, list[str]]  # op -> legend labels of its lines


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display); ValueError saying how to get
    matplotlib where it is not installed (the commands print it as "no plot")."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("matplotlib is not installed: `pip install matplotlib` to draw figures") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _size_axes(ax: Any, all_sizes: Sequence[int], ylabel: str, title: str) -> None:
    """Log-log axes over message sizes: at most ~8 size ticks written as 4 KiB, 1 MiB, ..."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(list(all_sizes)[:: max(1, (len(all_sizes) + 7) // 8)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(v)))
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)


def _save(fig: Any, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100, bbox_inches="tight")
    return p


def plot_runs(runs: Sequence[tuple[str, Sequence[dict]]], path: str | os.PathLike, *, title: str = "",
              predicted: Mapping[str, Mapping[str, Sequence[tuple[int, float, float]]]] | None = None) -> Figure:
    """Write a figure: one row of panels per op (algbw left, busbw right), one line per run and peer.

    Args:
        runs: [(label, rows)]; label is "" for a single run (lines are then named by peer alone).
        path: the file; its extension picks the format (png, pdf, svg, ...).
        title: the figure's title.
        predicted: op -> label -> [(size, algbw, busbw)] drawn as dashed black lines over the runs
            (``moecomm report --predict``); ops the runs do not hold are not drawn.

    Returns:
        The file and the lines drawn per op. Raises ValueError if no row can be drawn.
    """
    plt = _pyplot()
    per_run = [(label, series(rows)) for label, rows in runs]
    references = [(label, reference_series(rows)) for label, rows in runs]
    ops = list(dict.fromkeys(k[0] for _, s in per_run for k in s))
    if not ops:
        raise ValueError("nothing to plot: no rows with a positive size and a checked result")
    peers = list(dict.fromkeys(k[1] for _, s in per_run for k in s))  # one colour per peer
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(ops), 2, figsize=(14, 3.4 * len(ops) + 0.9), squeeze=False, layout="constrained")
    all_sizes = sorted({p[0] for _, s in per_run for v in s.values() for p in v})
    drawn: dict[str, list[str]] = {}
    for row, op in enumerate(ops):
        multi = {i: len({k[i] for _, s in per_run for k in s if k[0] == op}) > 1 for i in (2, 3)}
        variants = list(dict.fromkeys(k[2:] for _, s in per_run for k in s if k[0] == op))  # (dtype, redop)
        for col, (idx, what) in enumerate(((1, "algbw"), (2, "busbw"))):
            ax = axes[row][col]
            for ri, (label, s) in enumerate(per_run):
                for key, pts in s.items():
                    if key[0] != op:
                        continue
                    pi, vi = peers.index(key[1]), variants.index(key[2:])
                    name = key[1] + "".join(f" {key[i]}" for i in (2, 3) if multi[i])
                    ax.plot([p[0] for p in pts], [p[idx] for p in pts], _STYLES[ri % len(_STYLES)],
                            marker=_MARKERS[(pi + vi) % len(_MARKERS)], markersize=4, color=cmap(pi % 10),
                            label=f"{label}: {name}" if label else name)
            for ri, (label, points) in enumerate(references):
                if what == "busbw" and points:  # the rate the ops' busbw is a fraction of
                    ax.plot([p[0] for p in points], [p[1] for p in points], linestyle=(0, (5, 2 + ri)), color="grey",
                            linewidth=1.5, label=f"{label}: memcpy reference" if label else "memcpy reference")
            for li, (label, points) in enumerate((predicted or {}).get(op, {}).items()):
                ax.plot([p[0] for p in points], [p[idx] for p in points], _STYLES[1 + li % (len(_STYLES) - 1)],
                        color="black", linewidth=1.2, label=label)
            _size_axes(ax, all_sizes, f"{what} (GB/s)", f"{op}: {what}")
        # both panels of a row hold the same lines: one legend, right of the row
        handles, names = axes[row][1].get_legend_handles_labels()
        drawn[op] = list(names)
        axes[row][1].legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                            ncol=1 + len(names) // 22, frameon=False)
    head = title or "moecomm bench"
    fig.suptitle(f"{head}\n(each peer's better of out-of-place and in-place, results checked; GB/s = 1e9 B/s)",
                 fontsize=10)
    p = _save(fig, path)
    plt.close(fig)
    return Figure(p, drawn)


def plot_predictions(lines: Mapping[str, Mapping[str, Sequence[tuple[int, float, float]]]], path: str | os.PathLike,
                     *, title: str = "") -> Figure:
    """Write a figure of predicted busbw vs size: one panel per op, one line per label (node count).

    Args:
        lines: op -> label -> [(size, algbw, busbw)] (:func:`benchmarks.predict.predicted_series`).
        path: the file; its extension picks the format.
        title: the figure's title.

    Returns:
        The file and the lines drawn per op. Raises ValueError if there is nothing to draw.
    """
    lines = {op: {k: [p for p in v if p[0] > 0 and p[2] > 0] for k, v in by.items()} for op, by in lines.items()}
    lines = {op: {k: v for k, v in by.items() if v} for op, by in lines.items()}
    lines = {op: by for op, by in lines.items() if by}
    if not lines:
        raise ValueError("nothing to plot: no prediction with a positive size and bus bandwidth")
    plt = _pyplot()
    cmap = plt.get_cmap("viridis")
    cols = min(len(lines), 2)
    rows = (len(lines) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.2 * rows + 0.6), squeeze=False, layout="constrained")
    drawn: dict[str, list[str]] = {}
    for i, (op, by_label) in enumerate(lines.items()):
        ax = axes[i // cols][i % cols]
        for j, (label, pts) in enumerate(by_label.items()):
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker=_MARKERS[j % len(_MARKERS)], markersize=3,
                    color=cmap(j / max(len(by_label) - 1, 1) * 0.9), label=label)
        _size_axes(ax, sorted({p[0] for v in by_label.values() for p in v}), "predicted busbw (GB/s)", op)
        ax.legend(fontsize=7, loc="upper left", frameon=False)
        drawn[op] = list(by_label)
    for k in range(len(lines), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(f"{title or 'moecomm predict'}\n(model prediction, not a measurement; GB/s = 1e9 B/s)", fontsize=10)
    p = _save(fig, path)
    plt.close(fig)
    return Figure(p, drawn)
