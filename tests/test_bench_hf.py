"""Smoke test of `moecomm bench-hf --quick` at 2 ranks (no timing asserts: timings belong to benchmarks)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from benchmarks.bench_hf import DEFAULT_VARIANTS
from benchmarks.cli import main


def test_bench_hf_quick_every_variant_agrees(tmp_path):
    out = tmp_path / "hf.json"
    res = CliRunner().invoke(main, ["bench-hf", "--quick", "--nprocs", "2", "-J", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = res.output.splitlines()
    assert lines[0].startswith("# moecomm bench-hf: Qwen3-MoE 2 layers, 8 experts top-2, hidden 64"), lines[0]
    assert "experts_implementation=" in lines[0]
    rows = {ln.split()[1]: ln.split() for ln in lines if ln.split() and ln.split()[0] == "2"}
    assert sorted(rows) == sorted(DEFAULT_VARIANTS), res.output
    assert all(r[-1] == "ok" and float(r[-2]) <= 1e-4 for r in rows.values()), res.output
    assert float(rows["a2a-gloo"][4]) == 1.0 and float(rows["a2a-gloo"][5]) == 1.0  # the baseline's ratios
    doc = json.loads(out.read_text())
    assert doc["schema"] == "moecomm-bench-hf/1" and doc["options"]["nprocs"] == [2]
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
