"""``moecomm predict``: what the performance model (:mod:`collectives.model`) predicts for a
collective sweep, or for expert-parallel dispatch/combine, on a described machine.

Nothing numeric is computed here: times, bandwidths, bytes, the algorithm/protocol choice and the
bottleneck come from :func:`collectives.model.predict_collective` and
:func:`collectives.model.predict_moe`. This module picks the system (a preset, a JSON file, or one
fitted to a ``moecomm bench --json`` run: :mod:`benchmarks.predict_path`), walks ``moecomm bench``'s
sizes, lays the predictions out in nccl-tests' columns and writes them as JSON, CSV or a figure.

``--path P [--measured RUN.json]`` (one path bytes take, alone or beside a ``moecomm bench --path P``
run) is :func:`benchmarks.predict_measured.path_prediction`, which also reads the options the two
share (``--op``, the sweep, ``--nodes``, ``--algorithms``/``--protocols``); this module prints and
writes what it returns.
"""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import click

from .common import ALL_OPS, DTYPES, counts_for, format_size, itemsize
from .options import BYTES, COUNT, FIGURE
from .predict_measured import (MOE_OPS, PATH_OPTIONS, int_list, parse_algorithms, parse_op_option, parse_protocols,
                               path_prediction, sweep_option)
from .predict_path import check_gpus_per_node, resolve_system, system_summary
from .table import Column, Table

if TYPE_CHECKING:
    from collectives.model import System

SCHEMA = "moecomm-predict/1"

COLLECTIVE_TABLE = Table(
    [Column("op", 14), Column("nodes", 5), Column("ranks", 6), Column("size", 12, unit="(B)"),
     Column("count", 12, unit="(elements)"), Column("type", 9),
     Column("time", 10, ".2f", "(us)", gap=2), Column("algbw", 9, ".3f", "(GB/s)"), Column("busbw", 9, ".3f", "(GB/s)"),
     Column("algorithm", 12, align="<", gap=2), Column("protocol", 8, align="<"), Column("bottleneck", 10, align="<"),
     Column("runner-up", 19, align="<", gap=2), Column("time", 10, ".2f", "(us)")],
    groups=[("predicted", 6, 11), ("runner-up", 12, 13)])
MOE_TABLE = Table(
    [Column("op", 12), Column("mode", 11), Column("ep", 5), Column("nodes", 5), Column("tokens", 7),
     Column("hidden", 6), Column("topk", 4), Column("experts", 7), Column("dispatch", 8),
     Column("time", 10, ".2f", "(us)", gap=2), Column("algbw", 9, ".2f", "(GB/s)"),
     Column("nvlink", 10, ".3f", "(MB/rank)"), Column("network", 10, ".3f", "(MB/rank)"),
     Column("ranks/tok", 9, ".3f"), Column("nodes/tok", 9, ".3f"), Column("bottleneck", 10, align="<", gap=2)])
SYSTEMS_TABLE = Table(
    [Column("system", 12, align="<", gap=2), Column("GPUs/node", 9), Column("arch", 5, align="<", gap=2),
     Column("intra link", 12, align="<"), Column("GB/s", 7, ".1f"), Column("NIC", 9, align="<", gap=2),
     Column("GB/s x NICs", 11, align="<"), Column("NVLS", 4, align="<", gap=2),
     Column("description", align="<", gap=2)])


# ---- the system ---------------------------------------------------------------------------------
def systems_lines(systems: Sequence["System"]) -> list[str]:
    """The ``--list-systems`` table (GB/s = 1e9 B/s, one direction)."""
    lines = SYSTEMS_TABLE.header()
    for s in systems:
        nic = (s.nic.name, f"{s.nic.bandwidth_gbps:g} x {s.nics_per_node}") if s.nic else ("-", "-")
        lines.append(SYSTEMS_TABLE.line(s.name, s.gpus_per_node, s.arch, s.intra.name, s.intra.bandwidth_gbps, *nic,
                                        "yes" if s.nvls else "no", s.description))
    return lines


# ---- predictions ---------------------------------------------------------------------------------
def collective_rows(system: "System", ops: Sequence[str], dtypes: Sequence[str], byte_sizes: Sequence[int],
                    nodes_list: Sequence[int], gpus_per_node: int, *,
                    algorithms: Sequence[str] | None = None,
                    protocols: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Predictions of a sweep: every op x node count x dtype x size (in that order).

    Args:
        system: the machine; ops: collectives of :data:`common.ALL_OPS`; dtypes: names of
            :data:`common.DTYPES`; byte_sizes: nccl-tests sizes (bytes); nodes_list: node counts;
            gpus_per_node: ranks per node; algorithms, protocols: consider only these (None: every one).

    Returns:
        (rows, notes): each row :meth:`Prediction.as_dict` plus ``system`` and the runner-up's
        ``runner_up_algorithm``/``runner_up_protocol``/``runner_up_time_us`` (None without one);
        notes name the sizes left out because they give a rank no element (as ``moecomm bench``).
        Raises click.UsageError with the model's message for a case it cannot predict.
    """
    from collectives.model import predict_collective

    rows, notes = [], []
    for op in ops:
        for nodes in nodes_list:
            n = nodes * gpus_per_node
            for dtype in dtypes:
                skipped = [s for s in byte_sizes if s > 0 and counts_for(op, s, n, itemsize(dtype)) == 0]
                if skipped:
                    notes.append(f"{op} of {dtype} on {n} ranks: sizes below "
                                 f"{itemsize(dtype) * (1 if op in ('all_reduce', 'broadcast') else n)} B give a rank "
                                 f"no element; left out {', '.join(map(str, skipped))}")
                for size in byte_sizes:
                    if size in skipped:
                        continue
                    try:
                        p = predict_collective(system, op, size, nodes=nodes, gpus_per_node=gpus_per_node, dtype=dtype,
                                               algorithms=algorithms, protocols=protocols)
                    except ValueError as e:
                        raise click.UsageError(f"{system.name} cannot run {op} on {nodes} node(s) x {gpus_per_node} "
                                               f"GPUs: {e}") from None
                    rows.append(_with_runner_up(p, system.name))
    return rows, notes


def _with_runner_up(p: Any, system_name: str) -> dict[str, Any]:
    """A prediction's JSON row, with the system and the runner-up of its candidates."""
    row = {"system": system_name, **p.as_dict()}
    second = p.candidates[1] if len(p.candidates) > 1 else None
    row.update(runner_up_algorithm=second.algorithm if second else None,
               runner_up_protocol=second.protocol if second else None,
               runner_up_time_us=second.time_us if second else None)
    return row


def format_collective(row: Mapping[str, Any]) -> str:
    """One line of :data:`COLLECTIVE_TABLE` for a row of :func:`collective_rows`."""
    second = (f"{row['runner_up_algorithm']}/{row['runner_up_protocol']}", row["runner_up_time_us"]) \
        if row["runner_up_algorithm"] else ("-", "-")
    return COLLECTIVE_TABLE.line(row["op"], row["nodes"], row["nodes"] * row["gpus_per_node"], row["size"],
                                 row["count"], row["dtype"], row["time_us"], row["algbw"], row["busbw"],
                                 row["algorithm"], row["protocol"], row["bottleneck"], *second)


def moe_rows(system: "System", ops: Sequence[str], eps: Sequence[int], *, gpus_per_node: int | None,
             **shape: Any) -> list[dict[str, Any]]:
    """MoE dispatch/combine predictions, every op x EP size.

    Args:
        system: the machine; ops: of :data:`MOE_OPS`; eps: expert-parallel sizes (ranks);
        gpus_per_node: ranks per node (None: the system's);
        shape: tokens, hidden, topk, experts, topk_groups, dispatch_dtype, mode, engine
            (:func:`collectives.model.predict_moe`).

    Returns:
        :meth:`MoEPrediction.as_dict` rows plus ``system``. Raises click.UsageError with the
        model's message for a case it cannot predict.
    """
    from collectives.model.moe import predict_moe

    rows = []
    for op in ops:
        for ep in eps:
            try:
                p = predict_moe(system, op, ep=ep, gpus_per_node=gpus_per_node, **shape)
            except ValueError as e:
                raise click.UsageError(f"{system.name} cannot run {op} at EP {ep}: {e}") from None
            rows.append({"system": system.name, **p.as_dict()})
    return rows


def format_moe(row: Mapping[str, Any]) -> str:
    """One line of :data:`MOE_TABLE` (bytes per rank shown in MB = 1e6 B)."""
    return MOE_TABLE.line(row["op"], row["mode"], row["ep"], row["nodes"], row["tokens"], row["hidden"], row["topk"],
                          row["experts"], row["dispatch_dtype"], row["time_us"], row["algbw"],
                          row["nvlink_bytes"] / 1e6, row["network_bytes"] / 1e6, row["expected_ranks_per_token"],
                          row["expected_nodes_per_token"], row["bottleneck"])


def avg_busbw_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """nccl-tests' "Avg bus bandwidth" footer, one line per op, node count and dtype."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["nodes"], r["gpus_per_node"], r["dtype"]), []).append(r["busbw"])
    return [f"# {op} {dtype} on {nodes}x{gpn}: Avg bus bandwidth    : {sum(v) / len(v):.4f}"
            for (op, nodes, gpn, dtype), v in groups.items()]


# ---- output ---------------------------------------------------------------------------------------
def make_document(system: "System", options: Mapping[str, Any], notes: Sequence[str],
                  rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What ``--json`` writes: ``{"schema": "moecomm-predict/1", "env", "system", "options", "notes", "rows"}``
    (the envelope of ``moecomm bench --json``, with the system the predictions are for)."""
    from .output import _git_commit

    try:
        version = md.version("moecomm")
    except md.PackageNotFoundError:
        version = None
    env = {"moecomm": version, "moecomm_commit": _git_commit(),
           "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["moecomm", *sys.argv[1:]])}
    return {"schema": SCHEMA, "env": env, "system": system.to_dict(), "options": dict(options), "notes": list(notes),
            "rows": [dict(r) for r in rows]}


def write_csv(path: str | os.PathLike, doc: Mapping[str, Any]) -> Path:
    """``doc`` as CSV: ``# key: <json>`` lines for all but the rows, then the rows' scalar fields
    (nested ones, like the candidate list, only in the JSON). Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in doc["rows"] for k, v in r.items() if not isinstance(v, (list, dict))))
    with p.open("w", newline="") as f:
        for key in ("schema", "env", "system", "options", "notes"):
            f.write(f"# {key}: {json.dumps(doc.get(key))}\n")
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(doc["rows"])
    return p


def predicted_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[tuple[int, float, float]]]]:
    """op -> line label ("2 nodes x 8 GPUs", with the dtype when several) -> [(size, algbw, busbw)]."""
    several = len({r["dtype"] for r in rows}) > 1
    out: dict[str, dict[str, list]] = {}
    for r in rows:
        label = f"{r['nodes']} node{'s' if r['nodes'] > 1 else ''} x {r['gpus_per_node']} GPUs"
        label += f" {r['dtype']}" if several else ""
        out.setdefault(r["op"], {}).setdefault(label, []).append((r["size"], r["algbw"], r["busbw"]))
    return out


# ---- the command ---------------------------------------------------------------------------------
@click.command()
@click.option("--system", "system_name", default=None, metavar="NAME",
              help="A preset (--list-systems), or local with --calibrate.")
@click.option("--system-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSON description of any machine (--save-system writes one to start from).")
@click.option("--calibrate", "calibrate_run", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Fit --system local to a `moecomm bench --json` run of this machine (alpha-beta per transport "
                   "and algorithm, least squares over the sweep).")
@click.option("--save-system", type=click.Path(dir_okay=False), default=None,
              help="Write the system predicted for (preset, file or fitted) as JSON, for --system-file.")
@click.option("--list-systems", is_flag=True, help="List the preset systems and exit.")
@click.option("--op", "--ops", "ops", default="all_reduce", show_default=True,
              help=f"Comma-separated: collectives ({', '.join(ALL_OPS)}) or all (a calibrated system: all it was "
                   f"fitted for); or {', '.join(MOE_OPS)}.")
@click.option("--nodes", default="1", show_default=True, help="Node count(s), comma-separated (1,2,4,8).")
@click.option("--gpus-per-node", type=COUNT, default=None, help="Ranks per node [default: the system's GPUs].")
@click.option("-b", "--minbytes", type=BYTES, default="8", show_default=True, help="Smallest size (B, K, M, G).")
@click.option("-e", "--maxbytes", type=BYTES, default="8G", show_default=True, help="Largest size.")
@click.option("-f", "--stepfactor", type=COUNT, default=None,
              help="Multiply the size by this each step [default: 4, or additive steps when -i is given].")
@click.option("-i", "--stepbytes", type=BYTES, default="0", show_default=True, help="Add this many bytes each step.")
@click.option("-d", "--dtype", "--datatype", "dtype", default="float32", show_default=True,
              help=f"Data type(s): {', '.join(DTYPES)} (or float, half, bf16, ...), comma-separated, or all.")
# DeepSeek-V3's MoE shape (hidden 7168, top-8 of 256 routed experts) at DeepEP's normal-kernel
# benchmark batch of 4096 tokens (github.com/deepseek-ai/DeepEP: README, and its internode test)
@click.option("--tokens", type=COUNT, default=4096, show_default=True, help="MoE: tokens per rank.")
@click.option("--hidden", type=COUNT, default=7168, show_default=True, help="MoE: hidden size.")
@click.option("--topk", type=COUNT, default=8, show_default=True, help="MoE: experts per token.")
@click.option("--experts", type=COUNT, default=256, show_default=True, help="MoE: experts in all.")
@click.option("--topk-groups", type=COUNT, default=None,
              help="MoE: group-limited routing, at most this many node groups per token (DeepSeek-V3: 4) "
                   "[default: unlimited].")
@click.option("--ep", default="8", show_default=True, help="MoE: expert-parallel size(s) in ranks, comma-separated.")
@click.option("--dispatch-dtype", type=click.Choice(["fp8", "bf16"]), default="fp8", show_default=True,
              help="MoE: what dispatch sends (combine sends bf16).")
@click.option("--mode", type=click.Choice(["normal", "low_latency"]), default="normal", show_default=True,
              help="MoE: DeepEP's normal (throughput) or low-latency kernels.")
@click.option("--engine", type=click.Choice(["deepep", "pplx-garden", "uccl-ep"]), default="deepep",
              show_default=True,
              help="MoE: the engine's cost per remote rank: none for deepep (GPU-initiated on InfiniBand) and "
                   "pplx-garden; uccl-ep: UCCL-EP's CPU proxies (DeepEP's API on EFA).")
@click.option("--algorithms", default=None, metavar="LIST",
              help="Consider only these algorithms, comma-separated (ring, tree, nvls, nvls_tree, one_shot, two_shot, "
                   "hierarchical, pairwise), or nccl: what NCCL itself runs, to compare with nccl-tests "
                   "[default: all the model knows].")
@click.option("--protocols", default=None, metavar="LIST",
              help="Consider only these NCCL protocols, comma-separated (LL, LL128, Simple), as NCCL_PROTO does "
                   "[default: all three; across nodes, those the system's network allows].")
@click.option("--path", default=None, metavar="PATH",
              help="Predict one path bytes take (nvlink, pcie, cuda-ipc, shm, ib, roce, socket: `moecomm bench "
                   "--path`) with the algorithms its transport runs; the system: --system/--system-file (nvlink, pcie, "
                   "cuda-ipc: its intra link; ib, roce: its NIC), the shipped host calibration (shm), the link's "
                   "numbers (socket: --link-rate, --link-delay-ms or --testbed).")
@click.option("--measured", type=click.Path(exists=True, dir_okay=False), default=None, metavar="RUN.json",
              help="With --path: put the prediction beside every row of this `moecomm bench --path P --json` run "
                   "taken over P (older runs: rows whose transport is P), with measured/predicted busbw per row; "
                   "the run gives sizes, dtypes, nodes and ranks.")
@click.option("--link-rate", default=None, metavar="RATE",
              help="--path socket: the link's rate as tc shapes it ('1gbit', '800mbit'); the model uses the TCP "
                   "payload it leaves, RATE x 1448/1514.")
@click.option("--link-delay-ms", type=float, default=None, metavar="MS",
              help="--path socket: the one-way delay netem adds on each node's link, as `moecomm testbed --delay-ms` "
                   "(a packet between two nodes crosses two such links) [default: 0].")
@click.option("--testbed", default=None, metavar="NAME",
              help="--path socket: take --link-rate and --link-delay-ms (and --nodes) from testbed NAME's state.")
@click.option("-J", "--json", "json_path", default=None, metavar="FILE", help="Write the predictions as JSON.")
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Write the predictions as CSV.")
@click.option("--plot", "plot_path", type=FIGURE, default=None,
              help="Plot predicted busbw vs size, one line per node count.")
@click.pass_context
def predict(ctx: click.Context, system_name: str | None, system_file: str | None, calibrate_run: str | None,
            save_system: str | None, list_systems: bool, ops: str, nodes: str, gpus_per_node: int | None,
            minbytes: int, maxbytes: int, stepfactor: int | None, stepbytes: int, dtype: str, tokens: int,
            hidden: int, topk: int, experts: int, topk_groups: int | None, ep: str, dispatch_dtype: str, mode: str,
            engine: str, algorithms: str | None, protocols: str | None, path: str | None, measured: str | None,
            link_rate: str | None, link_delay_ms: float | None, testbed: str | None, json_path: str | None,
            csv_path: str | None, plot_path: str | None) -> None:
    """Predict collective or MoE all-to-all performance on a machine from the analytical model.

    Collectives: an nccl-tests-style table (the sizes, counts and bus factors of `moecomm bench`)
    with the predicted time, algbw, busbw, the algorithm and protocol the model picks, the link
    that limits it, and the runner-up. MoE: DeepEP-style dispatch/combine time per rank with the
    bytes each rank sends over NVLink and over the network. --path P: one path alone, or beside a
    measured run of it (--measured RUN.json) with measured/predicted busbw per row.
    """
    from collectives import model

    if list_systems:
        for line in systems_lines(model.list_systems()):
            click.echo(line)
        return
    if any(ctx.params[name] is not None for name in PATH_OPTIONS):
        emit(ctx, *path_prediction(ctx, collective_run))
        return
    system = resolve_system(system_name, system_file, calibrate_run)
    op_list = parse_op_option(ctx, system)
    moe = [o for o in op_list if o in MOE_OPS]
    check_gpus_per_node(system, gpus_per_node)
    if moe:
        shape = dict(tokens=tokens, hidden=hidden, topk=topk, experts=experts, topk_groups=topk_groups,
                     dispatch_dtype=dispatch_dtype, mode=mode, engine=engine)
        options, rows, notes, lines = _moe_run(system, moe, int_list(ep, "--ep"), gpus_per_node, shape)
    else:
        byte_sizes, dtypes = sweep_option(ctx)
        options, rows, notes, lines = collective_run(system, op_list, int_list(nodes, "--nodes"),
                                                      gpus_per_node or system.gpus_per_node, dtypes, byte_sizes,
                                                      parse_algorithms(algorithms), parse_protocols(protocols))
    options.update(system_file=system_file, calibrate=calibrate_run)
    emit(ctx, system, options, notes, rows, [system_summary(system), *lines])


def emit(ctx: click.Context, system: "System", options: dict[str, Any], notes: Sequence[str],
         rows: Sequence[Mapping[str, Any]], lines: Sequence[str]) -> None:
    """Print ``lines``, then write what ``--json``/``--csv``/``--save-system``/``--plot`` ask for."""
    p = ctx.params
    for line in lines:
        click.echo(line)
    _write(make_document(system, options, notes, rows), p["json_path"], p["csv_path"], p["save_system"])
    if p["plot_path"]:
        _plot(rows, p["plot_path"], system)



def collective_run(system: "System", ops: list[str], nodes_list: list[int], gpn: int, dtypes: list[str],
                    byte_sizes: list[int], algorithms: list[str] | None,
                    protocols: list[str] | None) -> tuple[dict, list[dict], list[str], list[str]]:
    """(options, rows, notes, printed lines) of a collective sweep."""
    if system.nic is None and max(nodes_list) > 1:
        raise click.BadParameter(f"{system.name} is a single-node machine (its description has no NIC): use --nodes "
                                 "1, or a system with a network (--list-systems)", param_hint="--nodes")
    options = dict(system=system.name, ops=ops, nodes=nodes_list, gpus_per_node=gpn, dtypes=dtypes, sizes=byte_sizes,
                   algorithms=algorithms, protocols=protocols)
    rows, notes = collective_rows(system, ops, dtypes, byte_sizes, nodes_list, gpn, algorithms=algorithms,
                                  protocols=protocols)
    head = (f"# moecomm predict: {','.join(ops)} on {','.join(map(str, nodes_list))} node(s) x {gpn} GPUs, dtype "
            f"{','.join(dtypes)}, sizes {sizes_text(byte_sizes)}")
    lines = [head, *(f"# note: {n}" for n in notes), *COLLECTIVE_TABLE.header(), *map(format_collective, rows),
             *avg_busbw_lines(rows)]
    return options, rows, notes, lines


def _moe_run(system: "System", ops: list[str], eps: list[int], gpus_per_node: int | None,
             shape: dict[str, Any]) -> tuple[dict, list[dict], list[str], list[str]]:
    """(options, rows, notes, printed lines) of MoE dispatch/combine predictions."""
    options = dict(system=system.name, ops=ops, ep=eps, gpus_per_node=gpus_per_node, **shape)
    rows = moe_rows(system, ops, eps, gpus_per_node=gpus_per_node, **shape)
    head = (f"# moecomm predict: {', '.join(ops)} ({shape['mode']}) at EP {','.join(map(str, eps))}: "
            f"{shape['tokens']} tokens per rank, hidden {shape['hidden']}, top-{shape['topk']} of "
            f"{shape['experts']} experts"
            + (f" within {shape['topk_groups']} node groups" if shape["topk_groups"] else "")
            + f", dispatch {shape['dispatch_dtype']}, engine {shape['engine']}; bytes each rank sends")
    notes = [EFA_MOE_NOTE] if system.network_is_efa and any(r["nodes"] > 1 for r in rows) else []
    return options, rows, notes, [head, *(f"# note: {n}" for n in notes), *MOE_TABLE.header(), *map(format_moe, rows)]


# What a MoE prediction across EFA nodes assumes; the numbers are in model-validation.md (UCCL-EP and
# pplx-garden rows).
EFA_MOE_NOTE = ("across EFA nodes there is no GPU-initiated RDMA: engines post the writes from CPU proxies, over "
                "every EFA card of the node. --engine deepep (the default) and pplx-garden add no cost per remote "
                "rank: pplx-garden's published p5en times come out within 29% at EP16-64; --engine uccl-ep adds "
                "UCCL-EP's 12.4 us per remote rank (collectives.model.moe.UCCL_EP_PROXY_PER_PEER_US, fitted on its "
                "p5en low-latency table; its p6-b200 table comes out within 22%), and UCCL-EP's published "
                "normal-mode times across nodes are up to 79% slower than the model's "
                "(benchmarks/results/model-validation.md)")


def _write(doc: dict[str, Any], json_path: str | None, csv_path: str | None, save_system: str | None) -> None:
    """``--json`` / ``--csv``; a path that cannot be written is a one-line error (exit 1)."""
    try:
        if save_system:
            p = Path(save_system)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc["system"], indent=1) + "\n")
            click.echo(f"# wrote {p.resolve()} (the system, for --system-file)")
        if json_path:
            p = Path(json_path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1) + "\n")
            click.echo(f"# wrote {p.resolve()}")
        if csv_path:
            click.echo(f"# wrote {write_csv(csv_path, doc).resolve()}")
    except OSError as e:
        raise click.ClickException(f"cannot write the predictions: {e}") from None


def _plot(rows: Sequence[Mapping[str, Any]], path: str, system: "System") -> None:
    """``--plot``: predicted busbw vs size, one panel per op, one line per node count."""
    from .plot import plot_predictions

    title = f"moecomm predict: {system.name} ({system.description})"
    try:
        fig = plot_predictions(predicted_series(rows), path, title=title)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"no plot written: {e}") from None
    click.echo(f"# wrote {fig.path.resolve()}")


def sizes_text(byte_sizes: Sequence[int]) -> str:
    """``8 B .. 8 GiB (16 sizes)`` for a header line."""
    count = f"{len(byte_sizes)} size{'s' if len(byte_sizes) > 1 else ''}"
    return f"{format_size(byte_sizes[0])} .. {format_size(byte_sizes[-1])} ({count})"
