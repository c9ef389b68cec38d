"""Smoke test of `moecomm bench-hf --quick` at 2 ranks, both sections (no timing asserts: timings belong to
benchmarks)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from benchmarks.bench_hf import DEFAULT_VARIANTS, EXCHANGE_IMPLS, EXCHANGE_MODES
from benchmarks.cli import main


def test_bench_hf_quick_every_variant_agrees(tmp_path):
    out = tmp_path / "hf.json"
    res = CliRunner().invoke(main, ["bench-hf", "--quick", "--nprocs", "2", "-J", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = res.output.splitlines()
    assert lines[0].startswith("# moecomm bench-hf: Qwen3-MoE 2 layers, 8 experts top-2, hidden 64"), lines[0]
    assert "experts_implementation=" in lines[0]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("# EP exchange per MoE layer"))
    assert "8/P experts (hidden 64, expert 32), 32 random tokens per rank, top-2" in lines[at], lines[at]
    rows = {ln.split()[1]: ln.split() for ln in lines[:at] if ln.split() and ln.split()[0] == "2"}
    assert sorted(rows) == sorted(DEFAULT_VARIANTS), res.output
    assert all(r[-1] == "ok" and float(r[-2]) <= 1e-4 for r in rows.values()), res.output
    assert float(rows["a2a-gloo"][4]) == 1.0 and float(rows["a2a-gloo"][5]) == 1.0  # the baseline's ratios
    # the second section: P, impl, (fwd, bwd, fwd+bwd, x faster) x (exchange, with experts), thr, max_rel_err, check
    xrows = {ln.split()[1]: ln.split() for ln in lines[at:] if ln.split() and ln.split()[0] == "2"}
    assert sorted(xrows) == sorted(EXCHANGE_IMPLS) and all(len(r) == 13 for r in xrows.values()), res.output
    assert xrows["moecomm"][-1] == "ok" and float(xrows["moecomm"][-2]) <= 1e-5, res.output
    assert xrows["all_to_all"][-2:] == ["-", "ref"] and xrows["all_to_all"][5] == xrows["all_to_all"][9] == "1.00"
    doc = json.loads(out.read_text())
    assert doc["schema"] == "moecomm-bench-hf/1" and doc["options"]["nprocs"] == [2]
    assert doc["options"]["exchange"] and doc["options"]["exchange_tolerance"] == 1e-5
    by_impl = {r["impl"]: r for r in doc["exchange_rows"]}
    assert sorted(by_impl) == sorted(EXCHANGE_IMPLS)
    for name, r in by_impl.items():
        assert r["ok"] and r["ranks"] == 2 and r["local_experts"] == 4, r
        for mode in EXCHANGE_MODES:
            assert r[mode]["step_s"] > 0 and all(len(steps) == 2 for steps in r[mode]["bwd_s_steps"]), r
    errs = by_impl["moecomm"]["rel_errs"]  # outputs and gradients, the experts' weights' with experts
    assert sorted(errs["exchange"]) == ["out", "weights_grad", "x_grad"], errs
    assert {"down_proj_grad", "gate_up_proj_grad"} <= set(errs["with_experts"]), errs
    assert max(v for d in errs.values() for v in d.values()) == by_impl["moecomm"]["max_rel_err"] <= 1e-5
    by_variant = {r["variant"]: r for r in doc["rows"]}
    assert sorted(by_variant) == sorted(DEFAULT_VARIANTS)
    for name, r in by_variant.items():
        assert r["ok"] and r["max_rel_err"] <= 1e-4, r
        assert r["ranks"] == (1 if name == "unsharded" else 2)
        assert r["local_experts"] == (8 if name == "unsharded" else [4]), r  # whole experts per rank
        assert all(len(steps) == 2 for steps in r["step_s_steps"])  # --quick: -n 2


@pytest.mark.parametrize("args,message", [
    (["--variants", "a2a-gloo,bogus"], "bogus"),
    (["--nprocs", "3"], "not divisible by 3 ranks"),
    (["--nprocs", "2,x"], "comma-separated list"),
    (["--tokens", "10", "--batch", "3"], "not divisible by --batch"),
    (["--no-exchange", "--exchange-only"], "exclude each other"),
])
def test_bench_hf_rejects_bad_options(args, message):
    res = CliRunner().invoke(main, ["bench-hf", *args])
    assert res.exit_code == 2 and message in res.output, res.output


def test_rows_flag_wrong_logits_and_failed_variants(capsys):
    """The check itself, on made-up rank results: a logits error above 1e-4 is WRONG, a rank's error a FAILED row."""
    import torch

    from benchmarks.bench_hf import _print_rows, _summary

    ref = torch.ones(2, 3, 5)
    good = {"logits": torch.ones(1, 3, 5), "fwd": [0.1, 0.3, 0.2], "step": [0.4, 0.6, 0.5], "threads": 1,
            "local_experts": [4]}
    off = dict(good, logits=torch.full((1, 3, 5), 1.001), step=[0.2, 0.3, 0.25])
    rows = [_summary("a2a-gloo", 2, [good, dict(good, step=[1.0, 1.0, 1.0])], ref),
            _summary("moecomm-gloo", 2, [good, off], ref),
            _summary("a2a-moecomm", 2, [good, {"error": "RuntimeError: boom"}], ref)]
    assert rows[0]["ok"] and rows[0]["step_s"] == 1.0 and rows[0]["step_s_per_rank"] == [0.5, 1.0]
    assert not rows[1]["ok"] and abs(rows[1]["max_rel_err"] - 1e-3) < 1e-6
    assert not rows[2]["ok"] and rows[2]["error"] == "RuntimeError: boom"
    _print_rows(rows, {"tokens": 8}, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-1] == "ok" and out[1].split()[-1] == "WRONG", out
    assert float(out[1].split()[5]) == 2.0  # fwd+bwd x faster: 1.0 s / 0.5 s
    assert "FAILED: RuntimeError: boom" in out[2], out


def _exchange_rank_result(scale: float = 1.0, diff: float = 0.0) -> dict:
    times = {"fwd": [0.1, 0.3, 0.2], "bwd": [0.2, 0.2, 0.2], "step": [0.3, 0.5, 0.4]}
    slow = {k: [v * 2 for v in vs] for k, vs in times.items()}  # all_to_all: twice as slow
    return {"times": {mode: {"moecomm": {k: [v * scale for v in vs] for k, vs in times.items()}, "all_to_all": slow}
                      for mode in EXCHANGE_MODES},
            "diffs": {mode: {"out": diff, "x_grad": 0.0} for mode in EXCHANGE_MODES}, "threads": 1, "local_experts": 4}


def test_exchange_rows_flag_differences_and_failed_ranks(capsys):
    """The exchange section's summary on made-up rank results: the slowest rank, x faster against all_to_all,
    a difference above 1e-5 WRONG, a rank's error FAILED rows; all of them in the exit-1 message."""
    from benchmarks.bench_hf import _exchange_summary, _failures, _print_exchange_rows

    good = _exchange_summary(2, [_exchange_rank_result(), _exchange_rank_result(scale=1.5, diff=1e-6)])
    assert [r["impl"] for r in good] == list(EXCHANGE_IMPLS) and all(r["ok"] for r in good)
    mc = good[0]["exchange"]
    assert abs(mc["step_s"] - 0.6) < 1e-9 and abs(mc["x_faster"] - 0.8 / 0.6) < 1e-9  # slowest rank: 0.4 x 1.5
    assert good[0]["max_rel_err"] == 1e-6 and good[1]["max_rel_err"] is None
    wrong = _exchange_summary(2, [_exchange_rank_result(), _exchange_rank_result(diff=1e-4)])
    assert not wrong[0]["ok"] and wrong[1]["ok"]
    failed = _exchange_summary(2, [_exchange_rank_result(), {"error": "RuntimeError: boom"}])
    assert not any(r["ok"] for r in failed)
    for rows in (good, wrong, failed):
        _print_exchange_rows(rows, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-1] == "ok" and out[1].split()[-2:] == ["-", "ref"], out
    assert out[2].split()[-1] == "WRONG" and "FAILED: RuntimeError: boom" in out[4], out
    msgs = _failures([], wrong + failed)
    assert len(msgs) == 3 and "with_experts out 1.00e-04" in msgs[0] and "boom" in msgs[1], msgs
