"""``moecomm predict --path P [--measured RUN.json]``, and the reading of the options it shares with the rest
of ``moecomm predict`` (benchmarks/predict.py, which imports this module: so these live here, below it).

- The options: ``--op`` (:func:`parse_op_option`: collectives or MoE ops, and a usage error for an option
  the chosen kind ignores), the sweep ``-b/-e/-f/-i/-d`` (:func:`sweep_option`), counts such as
  ``--nodes`` (:func:`int_list`), ``--algorithms``/``--protocols`` (:func:`parse_algorithms`,
  :func:`parse_protocols`).
- ``--path P`` (:func:`path_prediction`): the model of one path bytes take with the system and
  algorithms of that path (:func:`benchmarks.predict_path.path_model`), alone (a sweep of ``-b/-e/-f`` on
  ``--nodes``, run by the command's collective sweep) or, with ``--measured RUN.json``, beside every row
  of a ``moecomm bench --path P`` run (:func:`benchmarks.report.predicted_beside`) with the measured /
  predicted busbw ratio per row (:func:`ratio_points`) and its mean per op (:func:`ratio_lines`).

Nothing is printed or written here: :func:`path_prediction` returns what the command's ``emit`` prints
and writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import click
from click.core import ParameterSource

from transports.paths import PATHS, check_path

from .common import parse_dtypes, parse_ops, sweep_sizes
from .options import comma_list
from .predict_path import (LINK_OPTIONS, PathModel, check_nodes, path_model, path_rows, run_transport, system_summary,
                           verb)
from .report import PREDICTED, describe_run, predicted_beside, run_shape
from .table import Column, Table

if TYPE_CHECKING:
    from collectives.model import System

# (system, options, notes, rows, printed lines): what the command's emit prints and writes
Output = tuple["System", dict[str, Any], list[str], list[dict[str, Any]], list[str]]
# the command's collective sweep: (system, ops, nodes list, ranks per node, dtypes, sizes, algorithms,
# protocols) -> (options, rows, notes, printed lines)
CollectiveRun = Callable[..., tuple[dict, list[dict], list[str], list[str]]]


# ---- the options ---------------------------------------------------------------------------------
MOE_OPS = ("moe_dispatch", "moe_combine")
# options that only one kind of prediction reads: giving one to the other kind is a usage error
_COLLECTIVE_ONLY = {"minbytes": "-b", "maxbytes": "-e", "stepfactor": "-f", "stepbytes": "-i", "dtype": "-d",
                    "nodes": "--nodes", "plot_path": "--plot", "algorithms": "--algorithms", "protocols": "--protocols",
                    "path": "--path", "measured": "--measured", "link_rate": "--link-rate",
                    "link_delay_ms": "--link-delay-ms", "testbed": "--testbed"}
_MOE_ONLY = {"tokens": "--tokens", "hidden": "--hidden", "topk": "--topk", "experts": "--experts", "ep": "--ep",
             "dispatch_dtype": "--dispatch-dtype", "mode": "--mode", "topk_groups": "--topk-groups",
             "engine": "--engine"}


def int_list(text: str, hint: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (each >= 1, no repeats), or a usage error naming the option."""
    if "," in text and not all(t.strip() for t in text.split(",")):
        raise click.BadParameter(f"{text!r} has an empty entry; give counts >= 1 separated by commas, e.g. 1,2,4",
                                 param_hint=hint)
    try:
        values = [int(t) for t in comma_list(text)]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of whole numbers", param_hint=hint) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: give one or more counts >= 1, e.g. 1,2,4", param_hint=hint)
    return list(dict.fromkeys(values))


def _check_kind(ctx: click.Context, moe: bool) -> None:
    """A usage error for an option the chosen kind of prediction would ignore."""
    wrong = _COLLECTIVE_ONLY if moe else _MOE_ONLY
    given = [flag for name, flag in wrong.items() if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    if given:
        kind = (f"MoE dispatch/combine (--op {','.join(MOE_OPS)}) takes {', '.join(_MOE_ONLY.values())}, and the "
                "node count from --ep and --gpus-per-node" if moe else
                f"collectives take sizes, dtypes and --nodes; {', '.join(_MOE_ONLY.values())} are for --op "
                f"{'/'.join(MOE_OPS)}")
        raise click.UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply here: {kind}")


def parse_op_option(ctx: click.Context, system: "System | None") -> list[str]:
    """``--op``'s names: collectives, or MoE ops alone (a usage error for a mix, and for an option the chosen
    kind of prediction ignores); ``all`` on a calibrated ``system`` means the ops it was fitted for."""
    text = ctx.params["ops"]
    try:
        op_list = parse_ops(text, also=MOE_OPS)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--op") from None
    if text.strip() == "all" and system is not None and system.calibration:  # a fitted system knows its run's ops
        op_list = [op for op in op_list if op in system.calibration]
    moe = [o for o in op_list if o in MOE_OPS]
    if moe and len(moe) != len(op_list):
        raise click.BadParameter(f"{', '.join(moe)} and collectives are predicted by separate commands: give "
                                 "either", param_hint="--op")
    _check_kind(ctx, bool(moe))
    return op_list


def sweep_option(ctx: click.Context) -> tuple[list[int], list[str]]:
    """(sizes, dtypes) of ``-b/-e/-f/-i/-d``, or a usage error naming them."""
    p = ctx.params
    try:
        return sweep_sizes(p["minbytes"], p["maxbytes"], p["stepfactor"], p["stepbytes"]), parse_dtypes(p["dtype"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-b/-e/-f/-i/-d") from None


def parse_algorithms(text: str | None) -> list[str] | None:
    """``--algorithms``: names of :data:`collectives.model.ALGORITHMS`, or ``nccl`` (NCCL's own)."""
    from collectives.model import ALGORITHMS, NCCL_ALGORITHMS

    if text is None:
        return None
    if text.strip() == "nccl":
        return list(NCCL_ALGORITHMS)
    return _known_names(text, ALGORITHMS, "algorithm", "--algorithms",
                        also=f", or nccl ({', '.join(NCCL_ALGORITHMS)})")


def parse_protocols(text: str | None) -> list[str] | None:
    """``--protocols``: names of :data:`collectives.model.PROTOCOLS` (NCCL_PROTO's)."""
    from collectives.model import PROTOCOLS

    return None if text is None else _known_names(text, PROTOCOLS, "protocol", "--protocols")


def _known_names(text: str, known: Sequence[str], what: str, option: str, *, also: str = "") -> list[str]:
    """The comma-separated names of ``text``, each one of ``known``, once each in the order given;
    a usage error of ``option`` naming the unknown ones otherwise."""
    names = comma_list(text)
    bad = [name for name in names if name not in known]
    if bad or not names:
        raise click.BadParameter(f"unknown {what}(s) {', '.join(map(repr, bad)) or 'none given'}; give some of "
                                 f"{', '.join(known)}{also}", param_hint=option)
    return list(dict.fromkeys(names))


# ---- --path P [--measured RUN.json] ------------------------------------------------------------------
# the options of `predict --path`: any of them given makes the command predict a path (path_prediction)
PATH_OPTIONS = ("path", "measured", *LINK_OPTIONS)
MIB = 1 << 20
# options the run fixes, with --measured
_RUN_FIXES = {"minbytes": "-b", "maxbytes": "-e", "stepfactor": "-f", "stepbytes": "-i", "dtype": "-d",
              "nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "plot_path": "--plot"}
RATIO_TABLE = Table([*PREDICTED.columns[:8], Column("ratio", 7, ".3f"), PREDICTED.columns[9]],
                    groups=[("measured", 4, 5), ("predicted", 6, 7)])
SUMMARY_TABLE = Table([Column("op", 14, align="<", gap=2), Column("peer", 8, align="<"), Column("n", 3),
                       Column("ratio >=1MiB", 12, ".3f"), Column("n", 3), Column("ratio all", 9, ".3f")])


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE


def _link_options(p: Mapping[str, Any]) -> dict[str, Any]:
    return {name: p[name] for name in LINK_OPTIONS}


def _path_algorithms(p: Mapping[str, Any], model: PathModel) -> tuple[list[str] | None, list[str] | None]:
    """(algorithms, protocols): ``--algorithms``/``--protocols`` where given, else those the path's transport runs."""
    algorithms = parse_algorithms(p["algorithms"]) or model.algorithms
    protocols = parse_protocols(p["protocols"]) or model.protocols
    return (list(algorithms) if algorithms else None), (list(protocols) if protocols else None)


def path_prediction(ctx: click.Context, collective_run: CollectiveRun) -> Output:
    """``moecomm predict --path P [--measured RUN.json]`` (the options are ``ctx.params``).

    Args:
        ctx: the command's context; collective_run: the command's collective sweep
            (:func:`benchmarks.predict.collective_run`), which ``--path P`` alone runs with the path's system.

    Returns:
        What the command's ``emit`` prints and writes. Raises click.UsageError/BadParameter as the
        command reports them.
    """
    p = ctx.params
    if p["path"] is None:
        given = [flag for name, flag in {"measured": "--measured", **LINK_OPTIONS}.items() if p[name] is not None]
        raise click.UsageError(f"{', '.join(given)} {verb(given, 'goes', 'go')} with --path P (one of "
                               f"{', '.join(PATHS)})")
    try:
        path = check_path(p["path"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--path") from None
    if p["measured"]:
        return _path_measured(ctx, path)
    return _path_alone(ctx, path, collective_run)


def _path_alone(ctx: click.Context, path: str, collective_run: CollectiveRun) -> Output:
    """``--path P`` without a run: the sweep of ``-b/-e/-f`` on ``--nodes`` over that path."""
    p = ctx.params
    nodes_list = int_list(p["nodes"], "--nodes")
    check_nodes(path, nodes_list, f"--nodes gives {min(nodes_list)}", sweep=True)
    model = path_model(ctx, path, ranks_per_node=p["gpus_per_node"])
    op_list = parse_op_option(ctx, model.system)
    if model.testbed_nodes and not _given(ctx, "nodes"):
        nodes_list = [model.testbed_nodes]  # socket's: no node count it cannot predict
    byte_sizes, dtypes = sweep_option(ctx)
    algorithms, protocols = _path_algorithms(p, model)
    options, rows, notes, lines = collective_run(model.system, op_list, nodes_list, model.system.gpus_per_node,
                                                 dtypes, byte_sizes, algorithms, protocols)
    extra = [*model.notes, *model.op_notes(op_list, max(nodes_list), model.system.gpus_per_node)]
    options.update(path=path, **_link_options(p), system_file=p["system_file"], calibrate=p["calibrate_run"])
    return (model.system, options, [*extra, *notes], rows,
            [system_summary(model.system), *model.lines, *(f"# note: {n}" for n in extra), *lines])


def _path_measured(ctx: click.Context, path: str) -> Output:
    """``--path P --measured RUN.json``: every row of the run over P beside the prediction."""
    from .output import load_run

    p = ctx.params
    fixed = [flag for name, flag in _RUN_FIXES.items() if _given(ctx, name)]
    if fixed:
        raise click.UsageError(f"{', '.join(fixed)} {verb(fixed, 'does', 'do')} not apply with --measured: the run "
                               "gives the sizes, dtypes, nodes and ranks (and `moecomm report --plot` draws a run)")
    try:
        run = load_run(p["measured"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--measured") from None
    name = Path(p["measured"]).name
    rows, key = path_rows(run["rows"], path, name)
    op_list = parse_op_option(ctx, None)
    if _given(ctx, "ops"):
        rows = [r for r in rows if r["op"] in op_list]
        if not rows:
            raise click.BadParameter(f"{name} has no row of path {path} for {', '.join(op_list)}", param_hint="--op")
    nodes, ranks = run_shape(run)
    if ranks < 1 or ranks % nodes:
        raise click.UsageError(f"{name}: {ranks} ranks on {nodes} node(s) is not a whole number per node")
    check_nodes(path, [nodes], f"{name} ran on {nodes} node(s)", sweep=False)
    model = path_model(ctx, path, ranks_per_node=ranks // nodes, transport=run_transport(run, rows, path))
    model_nodes, model_ranks = model.model_shape(nodes, ranks)
    algorithms, protocols = _path_algorithms(p, model)
    points, skipped = ratio_points(rows, model, nodes=model_nodes, ranks=model_ranks, algorithms=algorithms,
                                   protocols=protocols)
    if not points:
        raise click.UsageError(f"no row of path {path} in {name} can be predicted: {'; '.join(skipped)}")
    notes = [*model.notes, *model.op_notes([r["op"] for r in rows], nodes, ranks // nodes), *skipped]
    shape = f"{ranks} ranks on {nodes} node(s)" + (
        f", predicted as {model_ranks} ranks on one node (--path {path} stays inside a node)"
        if (model_nodes, model_ranks) != (nodes, ranks) else "")
    head = [describe_run(name, run), system_summary(model.system), *model.lines,
            f"# {name}: {shape}; {len(rows)} rows of path {path} (matched by {key})",
            *(f"# note: {n}" for n in notes)]
    options = dict(path=path, measured=p["measured"], nodes=nodes, ranks=ranks, model_nodes=model_nodes,
                   model_ranks=model_ranks, algorithms=algorithms, protocols=protocols, **_link_options(p),
                   system_file=p["system_file"], calibrate=p["calibrate_run"])
    out_rows = [{"system": model.system.name, "path": path, **pt} for pt in points]
    return model.system, options, notes, out_rows, [*head, *ratio_lines(points)]


def ratio_points(rows: Sequence[Mapping[str, Any]], model: PathModel, *, nodes: int, ranks: int,
                 algorithms: Sequence[str] | None,
                 protocols: Sequence[str] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`predicted_beside` per op, each point with ``ratio`` = measured busbw / predicted busbw.

    Returns:
        (points, notes): an op the model cannot predict over the path is left out with a note.
    """
    peers = list(dict.fromkeys(r["transport"] for r in rows))
    points: list[dict[str, Any]] = []
    notes = []
    for op in dict.fromkeys(r["op"] for r in rows):
        try:
            got = predicted_beside([r for r in rows if r["op"] == op], model.system, nodes=nodes, ranks=ranks,
                                   peers=peers, algorithms=algorithms, protocols=protocols)
        except ValueError as e:
            notes.append(f"no prediction of {op} over {model.path}: {e}")
            continue
        points += [{**pt, "ratio": pt["busbw"] / pt["pred_busbw"]} for pt in got]
    return points, notes


def ratio_lines(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """The table of :func:`ratio_points` (by op, peer, dtype, size), then the mean ratio per op and peer
    at >= 1 MiB and over every size."""
    order = {key: i for i, key in enumerate(dict.fromkeys((p["op"], p["peer"], p["dtype"]) for p in points))}
    points = sorted(points, key=lambda p: (order[p["op"], p["peer"], p["dtype"]], p["size"]))
    lines = ["# measured vs predicted; ratio = measured busbw / predicted busbw (> 1: faster than the model)",
             *RATIO_TABLE.header()]
    lines += [RATIO_TABLE.line(p["op"], p["size"], p["dtype"], p["peer"], p["time_us"], p["busbw"], p["pred_time_us"],
                               p["pred_busbw"], p["ratio"], f"{p['algorithm']}/{p['protocol']}") for p in points]
    lines += ["", "# mean of measured / predicted busbw per op, at >= 1 MiB and over every size",
              *SUMMARY_TABLE.header()]
    for op, peer in dict.fromkeys((p["op"], p["peer"]) for p in points):
        every = [p for p in points if p["op"] == op and p["peer"] == peer]
        big = [p["ratio"] for p in every if p["size"] >= MIB]
        lines.append(SUMMARY_TABLE.line(op, peer, len(big), sum(big) / len(big) if big else "-", len(every),
                                        sum(p["ratio"] for p in every) / len(every)))
    return lines
