"""Command-line mistakes that must be one-line usage errors (exit code 2, no traceback, no hang), issue 37
item 11: testbed ports, nodes, shaping and names; report on a corrupt file; bench-ddp's --lr and its overhead
line; validate-gpu's --budget; predict's --nodes. In-process (CliRunner), nothing launched: the testbed is
replaced by one whose up() and launches fail the test, so no namespace is made (and a regression cannot hang)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from benchmarks import bench_ddp as bd
from benchmarks import gpu_validate as gv
from benchmarks import testbed as tbm
from benchmarks import testbed_cli
from benchmarks.cli import main

UP = "mtbr3up"  # a testbed the fake says is up, with 2 nodes


def _moecomm(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def usage_error(*args, says: tuple[str, ...] = ()) -> str:
    """Run ``moecomm ARGS``: it must exit 2 with a usage error (no traceback) containing ``says``."""
    res = _moecomm(*args)
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert "Traceback" not in res.output
    for text in says:
        assert text in res.output, (text, res.output)
    return res.output


# ---- moecomm testbed ---------------------------------------------------------------------------------
class _NoTestbed(tbm.Testbed):
    """A Testbed that must never come up or launch anything here (checks come first)."""

    def up(self) -> tbm.Testbed:
        raise AssertionError("testbed: up() reached")

    def popen(self, i, argv, **kwargs):
        self.node(i)  # the real lookup (IndexError before the fix)
        raise AssertionError("testbed: a command was launched")

    @classmethod
    def attach(cls, name: str) -> tbm.Testbed:
        if name != UP:
            return tbm.Testbed.attach.__func__(cls, name)  # the real lookup: LookupError for one not up
        tb = cls(2, name=name, persistent=True)
        tb.nodes = [tbm.Node(i, f"node{i}", f"10.77.0.{i + 1}", f"{name}n{i}", pid=1) for i in range(2)]
        return tb


@pytest.fixture
def fake_testbed(monkeypatch):
    monkeypatch.setattr(testbed_cli, "unavailable", lambda: None)  # as where namespaces can be made
    monkeypatch.setattr(testbed_cli, "Testbed", _NoTestbed)
    real = testbed_cli.testbeds
    monkeypatch.setattr(testbed_cli, "testbeds", lambda: [*real(), {"tag": UP, "owner": None, "alive": True,
                                                                     "nodes": [{}, {}]}])


def test_testbed_port_0_with_torchrun_is_refused_not_hung(fake_testbed):
    usage_error("testbed", "run", "-n", "2", "--port", "0", "--torchrun", "1", "--", "true",
                says=("--port", "same port"))
    usage_error("testbed", "run", "--name", UP, "--port", "0", "--torchrun", "1", "--", "true", says=("--port",))


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_testbed_port_out_of_range(fake_testbed, port):
    usage_error("testbed", "run", "-n", "2", f"--port={port}", "--torchrun", "1", "--", "true",
                says=("--port", "1..65535"))


@pytest.mark.parametrize("how", [("-n", "2"), ("--name", UP)])
@pytest.mark.parametrize("node", ["5", "2", "-1"])
def test_testbed_node_outside_the_testbed(fake_testbed, how, node):
    usage_error("testbed", "run", *how, f"--node={node}", "--", "true", says=("--node",))


def test_testbed_node_in_range_is_launched(fake_testbed):
    res = _moecomm("testbed", "run", "--name", UP, "--node", "1", "--", "true")
    assert isinstance(res.exception, AssertionError) and "launched" in str(res.exception)  # past the checks


@pytest.mark.parametrize("option, value", [("--rate", "fast"), ("--rate", "-1gbit"), ("--delay-ms", "-1"),
                                           ("--delay-ms", "nan"), ("--delay-ms", "inf"), ("--subnet", "10.0.0"),
                                           ("--subnet", "fd00::/64"), ("--subnet", "10.77.0.0/31"),
                                           ("--name", "foo"), ("--name", "mtbTOOLONG1")])
@pytest.mark.parametrize("command", ["up", "run"])
def test_testbed_bad_shaping_and_names(fake_testbed, command, option, value):
    extra = ["-n", "2"] if command == "run" or option != "--name" else []
    tail = ["--", "true"] if command == "run" else []
    usage_error("testbed", command, *extra, option, value, *tail, says=(option,))


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2 to see this machine's networks")
def test_testbed_subnet_overlapping_this_machine(monkeypatch, fake_testbed):
    from benchmarks.testbed import choose_subnet

    def up(self):
        choose_subnet(self.subnet_wanted, self.size)  # what the real up() checks first
        raise AssertionError("testbed: up() went on")

    monkeypatch.setattr(_NoTestbed, "up", up)
    usage_error("testbed", "up", "--name", "mtbr3x", "--subnet", "127.0.0.0/24", says=("--subnet", "overlaps"))


def test_testbed_unknown_names(fake_testbed):
    usage_error("testbed", "run", "--name", "mtbzz9q", "--", "true", says=("no testbed 'mtbzz9q'",))
    usage_error("testbed", "down", "--name", "mtbzz9q", says=("no testbed 'mtbzz9q'",))
    usage_error("testbed", "run", "--name", "../x", "--", "true", says=("--name",))
    usage_error("testbed", "down", "--name", "foo", says=("--name",))


# ---- moecomm report ----------------------------------------------------------------------------------
def test_report_on_a_corrupt_file(tmp_path):
    bad = tmp_path / "run.json"
    bad.write_text('{"schema": "moecomm-bench/1", "rows": [')
    usage_error("report", bad, says=("run.json", "not a moecomm bench JSON file"))
    (tmp_path / "other.json").write_text("[1, 2]")
    usage_error("report", tmp_path / "other.json", says=("no 'rows'",))


# ---- moecomm bench-ddp --------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", ["nan", "inf", "-inf", "0", "-0.1"])
def test_bench_ddp_lr_must_be_positive_and_finite(monkeypatch, lr):
    def no_ranks(*a, **k):
        raise AssertionError("bench-ddp launched its ranks")

    monkeypatch.setattr(bd, "on_ranks", no_ranks)
    usage_error("bench-ddp", f"--lr={lr}", says=("--lr",))


def test_bench_ddp_never_prints_a_negative_overhead():
    times = {"local": 2.0e-3, "moecomm": 1.9e-3, "gloo": 2.5e-3}  # moecomm's mean below local's: noise
    r = {"times": {n: {"mean": t, "p50": t, "min": t} for n, t in times.items()}, "max_param_diff": 0.0,
         "buckets": 3, "threads": 1, "ranks": 2, "params": 1000}
    o = {"width": 10, "depth": 2, "batch": 3, "bucket_mb": 1.0, "iters": 2, "reps": 2, "warmup": 1}
    runner = CliRunner()
    with runner.isolation() as (out, _err, *_):
        assert bd._report(r, o)
        text = out.getvalue().decode()
    line = next(t for t in text.splitlines() if "overhead" in t)
    assert not re.search(r"-\d", line), line
    assert "gloo 0.500 ms" in line and "within noise" in line, line


# ---- moecomm validate-gpu ------------------------------------------------------------------------------
def _forbid(*_a, **_k):
    raise AssertionError("validate-gpu went on")


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-5"])
@pytest.mark.parametrize("quick", [False, True])
def test_validate_gpu_budget_must_be_finite(monkeypatch, tmp_path, budget, quick):
    monkeypatch.setattr(gv, "run_plan", _forbid)
    monkeypatch.setattr(gv, "setup", _forbid)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    usage_error("validate-gpu", *(["--quick"] if quick else []), "--dry-run", "--gpu-name", "G", "--date", "D",
                "--results-dir", tmp_path, f"--budget={budget}", says=("--budget",))


@pytest.mark.parametrize("quick", [False, True])
def test_validate_gpu_dry_run_honours_the_budget(monkeypatch, tmp_path, quick):
    monkeypatch.setattr(gv, "run_plan", _forbid)
    monkeypatch.setattr(gv, "setup", _forbid)
    res = _moecomm("validate-gpu", *(["--quick"] if quick else []), "--dry-run", "--gpu-name", "G", "--date", "D",
                   "--results-dir", tmp_path, "--budget", "100")
    assert res.exit_code == 0, res.output
    assert re.search(r"plan: \d+ steps, \d+ s of 100 s budget", res.output), res.output
    # the first step that would run past the 100 s says so, and none before it
    steps = re.findall(r"^\d+\. \S+ \((\d+) s(;[^)]*)?\)", res.output, flags=re.MULTILINE)
    total, past = 0, None
    for i, (seconds, note) in enumerate(steps):
        total += int(seconds)
        if total > 100:
            past = i
            break
    assert past is not None and past > 0, res.output
    assert "if the steps before" in steps[past][1] and not any(note for _, note in steps[:past]), res.output


# ---- moecomm predict --------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", ["1,,2", "1,2,", ",1", " ", "1, ,2"])
def test_predict_nodes_empty_entries(nodes):
    usage_error("predict", "--system", "dgx-h100", "--nodes", nodes, says=("--nodes",))
