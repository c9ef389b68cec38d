"""`moecomm predict` and `moecomm report --predict`: what they print and write is what
collectives.model computes (called directly here), every way of naming a system, and a usage error
saying what to do for every way of getting the command line wrong. In-process (CliRunner): fast."""

from __future__ import annotations

import csv
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import common as cm
from benchmarks import predict as predict_cli
from benchmarks.cli import main
from benchmarks.output import load_run
from benchmarks.report import predicted_beside, run_shape
from collectives import model
from collectives.model.calibrate import calibrate
from collectives.model.moe import DISPATCH_DTYPES, ENGINES, MODES, UCCL_EP_PROXY_PER_PEER_US, predict_moe
from spmd import plot_lines_only

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "results" / "cpu-compare-mpiexec.json"
README = ROOT / "README.md"
# the README's Predict example: a text block "$ moecomm predict ..." followed by what it printed
EXAMPLE = re.compile(r"^```text\n\$ moecomm (predict [^\n]*)\n(.*?)^```", flags=re.S | re.M)
# nccl-tests' bus factors written out (src/*_perf.cu), not taken from the code under test
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def invoke(*args: str, ok: bool = True):
    res = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert res.exit_code == 0, res.output + repr(res.exception)
    return res


def usage_error(*args: str, says: tuple[str, ...]) -> str:
    res = invoke(*args, ok=False)
    assert res.exit_code == 2, res.output + repr(res.exception)
    for text in says:
        assert text in res.output, (text, res.output)
    return res.output


def table_rows(out: str, first: tuple[str, ...]) -> list[list[str]]:
    """Data lines (not '#') of the output whose first field is one of ``first``."""
    return [line.split() for line in out.splitlines() if not line.startswith("#") and line.split()[:1]
            and line.split()[0] in first]


def assert_same_row(row: dict, direct: dict) -> None:
    """A JSON row holds the model's own prediction (floats compared exactly: no rounding on the way)."""
    for key, value in direct.items():
        assert row[key] == (json.loads(json.dumps(value)) if isinstance(value, (list, tuple, dict)) else value), key


# ---- collectives ---------------------------------------------------------------------------------
def test_collective_sweep_json_table_and_csv_are_the_model(tmp_path):
    system = model.get_system("dgx-h100")
    res = invoke("predict", "--system", "dgx-h100", "--nodes", "1,2,4", "--op", "all_reduce,all_gather", "-b", "1K",
                 "-e", "1G", "-f", "32", "--json", tmp_path / "p.json", "--csv", tmp_path / "p.csv")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["schema"] == "moecomm-predict/1" and doc["system"]["name"] == "dgx-h100"
    assert model.System.from_dict(doc["system"]) == system
    assert doc["options"]["nodes"] == [1, 2, 4] and doc["options"]["gpus_per_node"] == 8
    sizes = cm.sizes(1 << 10, 1 << 30, 32)
    assert doc["options"]["sizes"] == sizes
    rows = doc["rows"]
    assert [(r["op"], r["nodes"], r["size"]) for r in rows] == [
        (op, nodes, s) for op in ("all_reduce", "all_gather") for nodes in (1, 2, 4) for s in sizes]
    printed = table_rows(res.output, ("all_reduce", "all_gather"))
    assert len(printed) == len(rows)
    for r, line in zip(rows, printed):
        p = model.predict_collective(system, r["op"], r["size"], nodes=r["nodes"], gpus_per_node=8, dtype="float32")
        assert_same_row(r, p.as_dict())
        n = 8 * r["nodes"]
        for key in ("op", "nodes", "gpus_per_node", "size", "time_us", "algbw", "busbw", "algorithm", "bottleneck"):
            assert key in r
        # nccl-tests' conventions: count per rank, algbw = size / time, busbw = algbw x factor
        assert r["count"] == cm.counts_for(r["op"], r["size"], n, 4)
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * FACTOR[r["op"]](n))
        assert (r["runner_up_algorithm"], r["runner_up_protocol"], r["runner_up_time_us"]) == (
            p.candidates[1].algorithm, p.candidates[1].protocol, p.candidates[1].time_us)
        # the table line: op nodes ranks size count type time algbw busbw algorithm protocol bottleneck runner-up time
        assert line[:6] == [r["op"], str(r["nodes"]), str(n), str(r["size"]), str(r["count"]), "float32"]
        assert line[6:9] == [f"{r['time_us']:.2f}", f"{r['algbw']:.3f}", f"{r['busbw']:.3f}"]
        assert line[9:13] == [r["algorithm"], r["protocol"], r["bottleneck"],
                              f"{r['runner_up_algorithm']}/{r['runner_up_protocol']}"]
    assert res.output.count("Avg bus bandwidth") == 6
    # CSV: the same rows' scalar fields, plus the envelope as comment lines
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0] == '# schema: "moecomm-predict/1"'
    back = list(csv.DictReader(line for line in lines if not line.startswith("# ")))
    assert len(back) == len(rows)
    for r, b in zip(rows, back):
        assert float(b["time_us"]) == pytest.approx(r["time_us"]) and b["algorithm"] == r["algorithm"]
        assert int(b["size"]) == r["size"] and b["bottleneck"] == r["bottleneck"]


def test_op_all_dtype_and_sizes_too_small_for_a_rank(tmp_path):
    res = invoke("predict", "--system", "dgx-a100", "--op", "all", "-d", "bf16", "--nodes", "2", "-b", "8", "-e", "64K",
                 "-f", "8", "--json", tmp_path / "p.json")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert list(dict.fromkeys(r["op"] for r in rows)) == list(cm.ALL_OPS)
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    # 16 ranks x 2 B: the blocked ops need 32 B, so 8 B is left out of them and said so
    for op in cm.ALL_OPS:
        got = [r["size"] for r in rows if r["op"] == op]
        assert got == ([8, 64, 512, 4096, 32768] if op in ("all_reduce", "broadcast") else [64, 512, 4096, 32768])
    assert "# note: all_gather of bfloat16 on 16 ranks: sizes below 32 B give a rank no element; left out 8" \
        in res.output
    for r in rows:
        assert r["count"] == cm.counts_for(r["op"], r["size"], 16, 2)


def test_gpus_per_node_below_the_systems(tmp_path):
    invoke("predict", "--system", "dgx-h100", "--gpus-per-node", "4", "--nodes", "2", "-b", "1M", "-e", "1M",
           "--json", tmp_path / "p.json")
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    direct = model.predict_collective(model.get_system("dgx-h100"), "all_reduce", 1 << 20, nodes=2, gpus_per_node=4)
    assert row["gpus_per_node"] == 4 and row["time_us"] == direct.time_us


def test_only_the_algorithms_nccl_runs(tmp_path):
    invoke("predict", "--system", "dgx-h100", "--op", "all_reduce", "-b", "64K", "-e", "64K", "--algorithms", "nccl",
           "--json", tmp_path / "p.json")
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    direct = model.predict_collective(model.get_system("dgx-h100"), "all_reduce", 64 << 10,
                                      algorithms=model.NCCL_ALGORITHMS)
    assert_same_row(row, direct.as_dict())
    assert {c["algorithm"] for c in row["candidates"]} <= set(model.NCCL_ALGORITHMS)
    invoke("predict", "--system", "dgx-h100", "--op", "all_reduce", "-b", "64K", "-e", "64K", "--algorithms",
           "ring,two_shot", "--json", tmp_path / "q.json")
    (row,) = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert {c["algorithm"] for c in row["candidates"]} == {"ring", "two_shot"}


def test_only_the_protocols_asked_for(tmp_path):
    # --protocols is NCCL_PROTO: every candidate runs one of them, and the pick is the model's with the same filter
    invoke("predict", "--system", "dgx-a100", "--nodes", "2", "--op", "all_reduce", "-b", "8", "-e", "8",
           "--algorithms", "nccl", "--protocols", "Simple", "--json", tmp_path / "p.json")
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    direct = model.predict_collective(model.get_system("dgx-a100"), "all_reduce", 8, nodes=2,
                                      algorithms=model.NCCL_ALGORITHMS, protocols=["Simple"])
    assert_same_row(row, direct.as_dict())
    assert {c["protocol"] for c in row["candidates"]} == {"Simple"}
    assert (row["algorithm"], row["protocol"]) == ("tree", "Simple")
    unfiltered = model.predict_collective(model.get_system("dgx-a100"), "all_reduce", 8, nodes=2,
                                          algorithms=model.NCCL_ALGORITHMS)
    assert unfiltered.protocol == "LL" and row["time_us"] > unfiltered.time_us


def test_a_system_file_with_simple_only_networking(tmp_path):
    # what aws-ofi-nccl does on EFA without in-order delivery: a system file can say so, the header shows it
    desc = model.get_system("dgx-a100").to_dict()
    desc.update(name="p4d-like", network_protocols=["Simple"])
    (tmp_path / "sys.json").write_text(json.dumps(desc))
    out = invoke("predict", "--system-file", tmp_path / "sys.json", "--nodes", "1,2", "--op", "all_reduce", "-b", "8",
                 "-e", "8", "--json", tmp_path / "p.json")
    assert "across nodes NCCL protocol(s) Simple only" in out.output
    one_node, two_nodes = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert {c["protocol"] for c in two_nodes["candidates"]} == {"Simple"}
    assert "LL" in {c["protocol"] for c in one_node["candidates"]}


def test_plot_one_line_per_node_count(tmp_path, monkeypatch):
    from benchmarks.plot import plot_predictions
    from benchmarks.predict import predicted_series

    res = invoke("predict", "--system", "dgx-h100", "--nodes", "1,2,4,8,16,32", "--op", "all_reduce,all_to_all",
                 "-b", "1K", "-e", "4G", "-f", "16", "--json", tmp_path / "p.json", "--plot", tmp_path / "p.png")
    assert f"# wrote {tmp_path / 'p.png'}" in res.output
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    plot_lines_only(monkeypatch)  # the command above drew this figure to a real file
    fig = plot_predictions(predicted_series(rows), tmp_path / "again.svg")
    labels = [f"{n} node{'s' if n > 1 else ''} x 8 GPUs" for n in (1, 2, 4, 8, 16, 32)]
    assert fig.lines == {"all_reduce": labels, "all_to_all": labels}


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = invoke("predict", "--system", "dgx-h100", "-b", "1K", "-e", "1M", "--json", tmp_path / "p.json",
                 "--plot", tmp_path / "p.png", ok=False)
    assert res.exit_code == 1 and "no plot written: matplotlib is not installed: `pip install matplotlib`" in res.output
    assert (tmp_path / "p.json").exists() and not (tmp_path / "p.png").exists()  # the predictions are kept


# ---- MoE ---------------------------------------------------------------------------------------
def test_moe_dispatch_and_combine_over_ep_sizes(tmp_path):
    system = model.get_system("dgx-h100")
    res = invoke("predict", "--system", "dgx-h100", "--op", "moe_dispatch,moe_combine", "--tokens", "128",
                 "--hidden", "7168", "--topk", "8", "--experts", "256", "--ep", "8,16,32", "--dispatch-dtype", "fp8",
                 "--mode", "low_latency", "--json", tmp_path / "m.json")
    doc = json.loads((tmp_path / "m.json").read_text())
    rows = doc["rows"]
    assert doc["schema"] == "moecomm-predict/1" and doc["options"]["ep"] == [8, 16, 32]
    assert [(r["op"], r["ep"]) for r in rows] == [(op, ep) for op in ("moe_dispatch", "moe_combine") for ep in (8, 16, 32)]
    printed = table_rows(res.output, ("moe_dispatch", "moe_combine"))
    assert len(printed) == 6
    for r, line in zip(rows, printed):
        direct = predict_moe(system, r["op"], tokens=128, hidden=7168, topk=8, experts=256, ep=r["ep"],
                                   dispatch_dtype="fp8", mode="low_latency")
        assert_same_row(r, direct.as_dict())
        for key in ("time_us", "nvlink_bytes", "network_bytes", "expected_ranks_per_token", "expected_nodes_per_token"):
            assert key in r
        assert line[:3] == [r["op"], "low_latency", str(r["ep"])] and line[9] == f"{r['time_us']:.2f}"
        assert line[11:13] == [f"{r['nvlink_bytes'] / 1e6:.3f}", f"{r['network_bytes'] / 1e6:.3f}"]
    # one node at EP 8 on an 8-GPU node: nothing crosses the network; more nodes: something does
    assert rows[0]["network_bytes"] == 0 and rows[1]["network_bytes"] > 0 and rows[0]["nodes"] == 1
    # 4 GPUs per node: EP 8 spans 2 nodes
    invoke("predict", "--system", "dgx-h100", "--op", "moe_dispatch", "--ep", "8", "--gpus-per-node", "4",
           "--topk-groups", "2", "--json", tmp_path / "g.json")
    (row,) = json.loads((tmp_path / "g.json").read_text())["rows"]
    direct = predict_moe(system, "moe_dispatch", tokens=4096, hidden=7168, topk=8, experts=256, ep=8, gpus_per_node=4,
                         topk_groups=2)
    assert_same_row(row, direct.as_dict())
    assert row["nodes"] == 2 and row["network_bytes"] > 0
    assert json.loads((tmp_path / "g.json").read_text())["notes"] == []  # InfiniBand: no EFA caveat


def test_moe_choices_are_the_models():
    # The CLI spells its MoE choices out (importing the model pulls in torch, which `moecomm --help`
    # should not wait for); they must stay the model's own.
    choices = {o.name: list(o.type.choices) for o in predict_cli.predict.params if o.name in ("engine", "mode",
                                                                                            "dispatch_dtype")}
    assert choices == {"engine": list(ENGINES), "mode": list(MODES), "dispatch_dtype": list(DISPATCH_DTYPES)}


def test_moe_across_efa_nodes_says_what_the_model_assumes(tmp_path):
    # EFA has no GPU-initiated RDMA: the note says what the model assumes there and what each engine measured
    res = invoke("predict", "--system", "p5en", "--op", "moe_dispatch", "--ep", "8,16", "--json", tmp_path / "e.json")
    notes = json.loads((tmp_path / "e.json").read_text())["notes"]
    assert notes == [predict_cli.EFA_MOE_NOTE] and f"# note: {notes[0]}" in res.output
    assert "GPU-initiated" in notes[0] and "UCCL-EP" in notes[0] and "pplx-garden" in notes[0]
    assert f"UCCL-EP's {UCCL_EP_PROXY_PER_PEER_US:g} us per remote rank" in notes[0]  # the model's constant
    # --engine picks the per-remote-rank cost; the rows say which engine they are
    invoke("predict", "--system", "p5en", "--op", "moe_dispatch", "--ep", "16", "--mode", "low_latency",
           "--engine", "uccl-ep", "--json", tmp_path / "u.json")
    (uccl,) = json.loads((tmp_path / "u.json").read_text())["rows"]
    (deepep,) = [r for r in json.loads((tmp_path / "e.json").read_text())["rows"] if r["ep"] == 16]
    assert uccl["engine"] == "uccl-ep" and deepep["engine"] == "deepep" and deepep["proxy_us"] == 0
    assert uccl["proxy_us"] == pytest.approx(8 * UCCL_EP_PROXY_PER_PEER_US)
    # one EFA node: nothing crosses the network, so no caveat
    invoke("predict", "--system", "p5en", "--op", "moe_dispatch", "--ep", "8", "--json", tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text())["notes"] == []


# ---- systems --------------------------------------------------------------------------------------
def test_list_systems_prints_every_preset():
    res = invoke("predict", "--list-systems")
    systems = model.list_systems()
    assert {s.name for s in systems} >= {"dgx-a100", "dgx-h100", "dgx-h200", "b200-8", "p5en"}
    lines = table_rows(res.output, tuple(s.name for s in systems))
    assert [line[0] for line in lines] == [s.name for s in systems]
    for s, line in zip(systems, lines):
        assert line[1] == str(s.gpus_per_node) and line[3] == s.intra.name
        assert line[4] == f"{s.intra.bandwidth_gbps:.1f}" and s.description.split()[0] in line
        assert (line[5] == s.nic.name) if s.nic else line[5] == "-"
        assert ("yes" if s.nvls else "no") in line


def test_system_file_round_trip(tmp_path):
    invoke("predict", "--system", "p5en", "--nodes", "4", "--op", "all_to_all", "-b", "1M", "-e", "1G", "-f", "32",
           "--save-system", tmp_path / "sys.json", "--json", tmp_path / "a.json")
    assert model.load_system_file(tmp_path / "sys.json") == model.get_system("p5en")
    invoke("predict", "--system-file", tmp_path / "sys.json", "--nodes", "4", "--op", "all_to_all", "-b", "1M",
           "-e", "1G", "-f", "32", "--json", tmp_path / "b.json")
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["rows"] == b["rows"] and b["options"]["system_file"] == str(tmp_path / "sys.json")
    # an edited file is another machine: half the NIC bandwidth, never a faster all_to_all
    d = json.loads((tmp_path / "sys.json").read_text())
    d["name"], d["nic"]["bandwidth_gbps"] = "p5en-half", d["nic"]["bandwidth_gbps"] / 2
    (tmp_path / "half.json").write_text(json.dumps(d))
    invoke("predict", "--system-file", tmp_path / "half.json", "--nodes", "4", "--op", "all_to_all", "-b", "1M",
           "-e", "1G", "-f", "32", "--json", tmp_path / "c.json")
    c = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert all(x["time_us"] >= y["time_us"] for x, y in zip(c, a["rows"]))
    assert c[-1]["time_us"] > a["rows"][-1]["time_us"] and c[-1]["system"] == "p5en-half"


def test_calibrate_from_a_bench_run(tmp_path):
    system = calibrate(RUN, name="local")
    nranks = load_run(RUN)["env"]["nranks"]
    invoke("predict", "--system", "local", "--calibrate", RUN, "--op", "all", "-b", "64K", "-e", "32M", "-f", "8",
           "--json", tmp_path / "p.json", "--save-system", tmp_path / "local.json")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert rows and all(r["system"] == "local" and r["gpus_per_node"] == nranks and r["nodes"] == 1 for r in rows)
    # `--op all` of a fitted system: the ops its run measured (this run has no broadcast)
    assert list(dict.fromkeys(r["op"] for r in rows)) == [op for op in cm.ALL_OPS if op in system.calibration] \
        == list(cm.OPS)
    for r in rows:
        p = model.predict_collective(system, r["op"], r["size"], nodes=1, gpus_per_node=nranks)
        assert_same_row(r, p.as_dict())
    # the fitted system saved and read back predicts the same; --calibrate alone means --system local
    invoke("predict", "--system-file", tmp_path / "local.json", "--op", "all", "-b", "64K", "-e", "32M", "-f", "8",
           "--json", tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == rows
    invoke("predict", "--calibrate", RUN, "--op", "all", "-b", "64K", "-e", "32M", "-f", "8", "--json",
           tmp_path / "alone.json")
    assert json.loads((tmp_path / "alone.json").read_text())["rows"] == rows


# ---- report --predict -----------------------------------------------------------------------------
def test_report_puts_the_prediction_beside_the_run(tmp_path):
    run = load_run(RUN)
    system = calibrate(RUN, name="local")
    nodes, ranks = run_shape(run)
    res = invoke("report", RUN, "--predict", "local", "--calibrate", RUN, "--plot", tmp_path / "r.png")
    assert "# measured vs predicted (local)" in res.output and "# prediction error (local)" in res.output
    points = predicted_beside(run["rows"], system, nodes=nodes, ranks=ranks)
    auto = [r for r in run["rows"] if r["transport"] == "auto" and cm.best_algbw(r)]
    assert len(points) == len(auto) > 0 and {p["peer"] for p in points} == {"auto"}  # auto by default
    for p in points:
        r = next(r for r in auto if (r["op"], r["size"], r["dtype"]) == (p["op"], p["size"], p["dtype"]))
        direct = model.predict_collective(system, p["op"], p["size"], nodes=nodes, gpus_per_node=ranks // nodes,
                                          dtype=p["dtype"])
        assert p["pred_time_us"] == direct.time_us and p["pred_busbw"] == direct.busbw
        assert p["time_us"] == pytest.approx(r["size"] / cm.best_algbw(r) / 1e3)
        assert p["error_pct"] == pytest.approx(100 * (direct.time_us - p["time_us"]) / p["time_us"])
    # the printed table: measured and predicted time, busbw, error per point
    printed = table_rows(res.output.split("# measured vs predicted")[1].split("# prediction error")[0], cm.ALL_OPS)
    assert len(printed) == len(points)
    by_key = {(p["op"], p["size"]): p for p in points}
    for line in printed:
        p = by_key[line[0], int(line[1])]
        assert line[3:9] == ["auto", f"{p['time_us']:.2f}", f"{p['busbw']:.3f}", f"{p['pred_time_us']:.2f}",
                             f"{p['pred_busbw']:.3f}", f"{p['error_pct']:+.1f}"]
    # the summary: mean and max |error| per op over the sizes of each range
    summary = res.output.split("# prediction error (local)")[1]
    for op in cm.OPS:
        errs = [abs(p["error_pct"]) for p in points if p["op"] == op and p["size"] >= 64 << 10]
        line = next(f for f in table_rows(summary, (op,)) if f[2] == ">=64KiB")
        assert line[1:] == ["auto", ">=64KiB", str(len(errs)), f"{sum(errs) / len(errs):.1f}", f"{max(errs):.1f}"]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_report_against_a_preset_and_chosen_peers(tmp_path, monkeypatch):
    res = invoke("report", RUN, "--predict", "dgx-h100", "--peer", "shm,mpi4py")
    points = predicted_beside(load_run(RUN)["rows"], model.get_system("dgx-h100"), nodes=1, ranks=2,
                              peers=["shm", "mpi4py"])
    assert {p["peer"] for p in points} == {"shm", "mpi4py"}
    block = res.output.split("# measured vs predicted")[1].split("# prediction error")[0]
    assert len(table_rows(block, cm.ALL_OPS)) == len(points)
    # the overlay drawn dashed: one line per op, at the predicted bandwidths
    from benchmarks.plot import plot_runs
    from benchmarks.report import prediction_overlay

    every = invoke("report", RUN, "--predict", "dgx-h100", "--peer", "all").output
    block = every.split("# measured vs predicted")[1].split("# prediction error")[0]
    measured = {r["transport"] for r in load_run(RUN)["rows"] if r.get("library") != cm.REFERENCE}  # not memcpy
    assert {line[3] for line in table_rows(block, cm.ALL_OPS)} == measured
    overlay = prediction_overlay(points, "predicted")
    plot_lines_only(monkeypatch)  # test_report_puts_the_prediction_beside_the_run draws an overlay to a real file
    fig = plot_runs([("", load_run(RUN)["rows"])], tmp_path / "o.png", predicted=overlay)
    assert all("predicted" in fig.lines[op] for op in overlay)


# ---- what the command line must refuse ---------------------------------------------------------------
def test_usage_errors_say_what_to_do(tmp_path):
    names = [s.name for s in model.list_systems()]
    usage_error("predict", "--system", "dgx-z900", says=("unknown system 'dgx-z900'", *names))
    usage_error("predict", says=("no system", "--system NAME", "--calibrate", "--system-file"))
    usage_error("predict", "--system", "local", says=("--calibrate RUN.json",))
    usage_error("predict", "--system", "dgx-h100", "--calibrate", RUN, says=("--system local",))
    usage_error("predict", "--system", "dgx-h100", "--gpus-per-node", "16",
                says=("16 is more than the 8 GPUs per node of dgx-h100", "--system-file"))
    box = model.get_system("pcie-l40s-8").to_dict()
    box.update(name="one-box", nic=None, nics_per_node=0)
    (tmp_path / "box.json").write_text(json.dumps(box))
    usage_error("predict", "--system-file", tmp_path / "box.json", "--nodes", "1,2",
                says=("one-box is a single-node machine", "--nodes 1"))
    usage_error("predict", "--system", "dgx-h100", "--nodes", "0", says=("--nodes", ">= 1"))
    usage_error("predict", "--system", "dgx-h100", "--nodes", "two", says=("--nodes", "whole numbers"))
    usage_error("predict", "--system", "dgx-h100", "--op", "allreduce", says=("unknown op 'allreduce'", "moe_dispatch"))
    usage_error("predict", "--system", "dgx-h100", "--op", "all_reduce,moe_dispatch", says=("either",))
    usage_error("predict", "--system", "dgx-h100", "--op", "moe_combine", "-b", "1K", "--nodes", "2",
                says=("-b, --nodes do not apply", "--ep"))
    usage_error("predict", "--system", "dgx-h100", "--tokens", "128", says=("--tokens does not apply", "moe_dispatch"))
    usage_error("predict", "--system", "dgx-h100", "--algorithms", "ring,bruck", says=("unknown algorithm(s) 'bruck'",
                                                                                      "nccl"))
    usage_error("predict", "--system", "dgx-h100", "--protocols", "LL,Fast", says=("unknown protocol(s) 'Fast'",
                                                                                  "LL, LL128, Simple"))
    usage_error("predict", "--system", "dgx-h100", "--op", "all_reduce", "--nodes", "1", "--gpus-per-node", "1",
                "--protocols", "LL", says=("no candidate for all_reduce", "drop the protocols filter"))
    usage_error("predict", "--system", "dgx-h100", "--op", "moe_dispatch", "--protocols", "LL",
                says=("--protocols does not apply",))
    usage_error("predict", "--system", "dgx-h100", "-b", "1M", "-e", "1K", says=("-b 1 MiB is larger than -e 1 KiB",))
    usage_error("predict", "--system", "dgx-h100", "-f", "1", says=("-f > 1 or -i > 0",))
    usage_error("predict", "--system", "dgx-h100", "-d", "float128", says=("unknown dtype 'float128'",))
    usage_error("predict", "--system", "dgx-h100", "--op", "moe_dispatch", "--ep", "0", says=("--ep",))
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    usage_error("predict", "--system-file", tmp_path / "bad.json", says=("--system-file", "--save-system"))
    usage_error("predict", "--system-file", tmp_path / "bad.json", "--system", "dgx-h100",
                says=("without --system",))
    usage_error("predict", "--system", "local", "--calibrate", tmp_path / "bad.json",
                says=("--calibrate", "moecomm bench --json"))
    usage_error("predict", "--calibrate", RUN, "--op", "broadcast", says=("not for broadcast on 2 ranks",))
    usage_error("predict", "--calibrate", RUN, "--nodes", "2", says=("single-node machine",))
    usage_error("report", RUN, "--predict", "dgx-z900", says=("unknown system 'dgx-z900' for --predict",))
    usage_error("report", RUN, "--predict", "local", says=("--predict local", "--calibrate"))
    usage_error("report", RUN, "--predict", "dgx-h100", "--peer", "nccl", says=("no peer nccl", "auto"))
    one = model.get_system("dgx-h100").to_dict()
    one.update(name="one-gpu", gpus_per_node=1, nvls=False, nvls_efficiency=0.0)
    (tmp_path / "one.json").write_text(json.dumps(one))
    usage_error("report", RUN, "--system-file", tmp_path / "one.json",
                says=("ran 2 ranks per node; one-gpu has 1 GPUs per node",))


def test_shared_sweep_helpers():
    assert cm.sweep_sizes(8, 1024, None, 0) == [8, 32, 128, 512]  # -f defaults to 4, as bench's
    assert cm.sweep_sizes(1000, 3000, None, 1000) == [1000, 2000, 3000]  # -i alone steps additively
    with pytest.raises(ValueError, match="larger than"):
        cm.sweep_sizes(2, 1, 2, 0)
    assert cm.parse_ops("all", also=("moe_dispatch",)) == list(cm.ALL_OPS)
    assert cm.parse_ops("moe_dispatch,all_reduce", also=("moe_dispatch",)) == ["moe_dispatch", "all_reduce"]
    with pytest.raises(ValueError, match="moe_dispatch"):
        cm.parse_ops("moe_dispatch")


def test_readme_predict_example_is_what_the_command_prints():
    match = EXAMPLE.search(README.read_text())
    assert match, "README lost its Predict example (a ```text block starting with `$ moecomm predict`)"
    res = invoke(*shlex.split(match.group(1)))
    assert res.output == match.group(2), \
        "README's Predict example is not what the command prints now: `python tests/test_predict_cli.py --write-readme`"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-readme"]:
        sys.exit("usage: python tests/test_predict_cli.py --write-readme   (re-run README's Predict example, paste its output)")
    sys.path.insert(0, str(ROOT))
    text = README.read_text()
    match = EXAMPLE.search(text)
    out = CliRunner().invoke(main, shlex.split(match.group(1))).output
    README.write_text(text[: match.start(2)] + out + text[match.end(2) :])
