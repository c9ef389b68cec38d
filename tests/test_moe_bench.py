"""Smoke test of `moecomm bench-moe` at toy sizes (no timing asserts: timings belong to benchmarks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from benchmarks.cli import main


def test_bench_moe_smoke():
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "48", "--hidden", "32", "--experts", "8", "-k", "3",
                                    "--nprocs", "2", "--iters", "2", "--warmup", "1", "--dtype", "float32"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = res.output.splitlines()
    assert lines[0].startswith("# moecomm bench-moe: 2 ranks, 48 tokens/rank, hidden 32, top-3 of 8 experts")
    rows = [ln.split() for ln in lines if ln.split() and ln.split()[0] in ("0", "1")]
    assert sorted((r[0], r[1]) for r in rows) == [("0", "moecomm"), ("0", "torch-gloo"),
                                                  ("1", "moecomm"), ("1", "torch-gloo")]
    assert all(r[-1] == "ok" for r in rows)
    # both implementations deliver the same number of (token, rank) rows to each rank
    assert {r[0]: r[7] for r in rows if r[1] == "moecomm"} == {r[0]: r[7] for r in rows if r[1] == "torch-gloo"}


def test_bench_moe_rejects_bad_options():
    res = CliRunner().invoke(main, ["bench-moe", "--experts", "9", "-k", "2", "--nprocs", "2", "--cpu-scale"])
    assert res.exit_code != 0 and "not divisible" in res.output


def test_bench_moe_device_cuda_without_a_gpu_is_a_usage_error(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "-k", "2",
                                    "--nprocs", "2", "--iters", "1", "--warmup", "0", "--device", "cuda"])
    assert res.exit_code == 2 and "--device cuda needs a CUDA GPU" in res.output, res.output


# ---- the torch.distributed baseline's store: no port picked, released and bound again ----------
def _squat_released_ports(comm, o):
    """bench-moe's rank body on a machine where any loopback port that a Python socket binds and
    then releases is taken at once by another program (the gap the old code left open)."""
    import socket

    from benchmarks.bench_moe import _bench_rank

    bound, squatters = {}, []
    real_bind, real_close = socket.socket.bind, socket.socket.close

    def bind(self, address):
        real_bind(self, address)
        bound[self.fileno()] = self.getsockname()[:2]

    def close(self):
        where = bound.pop(self.fileno(), None)
        real_close(self)
        if where is not None:
            squatter = socket.socket()
            real_bind(squatter, where)
            squatter.listen()
            squatters.append(squatter)

    socket.socket.bind, socket.socket.close = bind, close
    try:
        return _bench_rank(comm, o)
    finally:
        socket.socket.bind, socket.socket.close = real_bind, real_close


def test_bench_moe_baseline_survives_a_busy_machine():
    import collectives

    o = dict(tokens=16, hidden=8, top_k=2, experts=4, dtype="float32", iters=1, warmup=0, baseline=True,
             cpu_scale=False, tokens_full=16, hidden_full=8, keep_freed_memory=False, timeout=30.0, device="cpu")
    stats = collectives.launch(_squat_released_ports, 2, o, timeout=30.0)[0]
    rows = [r for per_rank in stats for r in per_rank]
    assert sorted((int(r[0]), int(r[1])) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r[9] == 1 for r in rows)  # both implementations correct on both ranks (the ok field)


def _fake_comm(single_node: bool):
    return SimpleNamespace(rank=0, size=1, broadcast=lambda x, src=0: x,
                           topology=SimpleNamespace(single_node=single_node, hosts=("this-node", "node2")))


def test_torch_store_listens_on_loopback_alone_on_one_node_and_off_it_across_nodes(monkeypatch):
    """One node: 127.0.0.1 only. Across nodes: this host's address on the route to the other
    ranks' hosts (not loopback, which they cannot reach); the port is the OS's pick, held."""
    import socket

    from benchmarks.peers import torch_store
    from collectives.rendezvous import store_client

    store, where = torch_store(_fake_comm(True), 10.0)
    addr, port = where.split(":")
    assert addr == "127.0.0.1" and int(port) > 0
    store.set("k", "v")
    assert store_client(addr, int(port), 10.0).get("moecomm-benchmarks/k") == b"v"

    real = socket.getaddrinfo
    # node2: an address off this host (TEST-NET-1); a UDP connect sends nothing
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real("192.0.2.77", *a, **k)
                        if host == "node2" else real(host, *a, **k))
    try:
        store, where = torch_store(_fake_comm(False), 10.0)
    except OSError as e:  # no route off this host at all
        pytest.skip(f"no network route: {e}")
    addr, port = where.rsplit(":", 1)
    assert not addr.startswith("127.") and int(port) > 0
    store.set("k", "w")
    assert store_client(addr, int(port), 10.0).get("moecomm-benchmarks/k") == b"w"


def _store_fails_on_rank_0(comm):
    from benchmarks import peers

    if comm.rank == 0:
        def unroutable(c):
            raise OSError("no route to node2")

        peers._store_address = unroutable
    try:
        peers.torch_store(comm, 10.0)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_torch_store_failure_on_rank_0_reaches_every_rank():
    import collectives

    for message in collectives.launch(_store_fails_on_rank_0, 2, timeout=30.0):
        assert message.startswith("rank 0 could not start the torch.distributed store") and \
            "no route to node2" in message, message


# ---- node-aware vs flat summary (the numbers come from the rows; checked against hand arithmetic) ----
def test_node_summary_ratios(capsys):
    from benchmarks.bench_moe import IMPLS, _print_node_summary
    from collectives.model import expected_distinct

    aware, flat = IMPLS.index("moecomm"), IMPLS.index("moecomm-flat")
    # [rank, impl, layout s, dispatch s, combine s, rows, moved, inter B, intra B, ok, nodes]
    stats = [[[r, aware, 0.001, 0.002, 0.003, 10, 100, 1_000_000 + r, 5, 1, 2],
              [r, flat, 0.0005, 0.004, 0.006, 10, 100, 2_000_000 + 3 * r, 5, 1, 2]] for r in range(4)]
    _print_node_summary(stats, {"nodes": 2, "nprocs_run": 4, "top_k": 8, "experts": 64})
    out = capsys.readouterr().out
    inter_a, inter_f = sum(1_000_000 + r for r in range(4)), sum(2_000_000 + 3 * r for r in range(4))
    predicted = expected_distinct(8, 2, 64) / expected_distinct(8, 4, 64)
    assert f"ratio {inter_a / inter_f:.4f}; routing predicts {predicted:.4f}" in out, out
    assert f"node-aware {inter_a / 1e6:.3f} MB, flat {inter_f / 1e6:.3f} MB" in out, out
    assert "node-aware 5000.0 us, flat 10000.0 us, ratio 0.500" in out, out
    assert "with the layout: node-aware 6000.0 us, flat 10500.0 us" in out, out
    # without a flat row (one node) nothing is printed
    _print_node_summary([[row[0]] for row in stats], {"nodes": 1, "nprocs_run": 4, "top_k": 8, "experts": 64})
    assert capsys.readouterr().out == ""


def test_bench_moe_transport_reaches_the_communicator():
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "-k", "2",
                                    "--nprocs", "2", "--iters", "1", "--warmup", "0", "--dtype", "float32",
                                    "--transport", "shm", "--no-baseline"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [ln.split() for ln in res.output.splitlines() if ln.split() and ln.split()[0] in ("0", "1")]
    assert sorted(r[0] for r in rows) == ["0", "1"] and all(r[-1] == "ok" for r in rows), res.output
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "16", "--hidden", "8", "--experts", "4", "-k", "2",
                                    "--nprocs", "2", "--transport", "mpi", "--no-baseline"])
    assert res.exit_code != 0 and "'mpi'" in repr(res.exception) + res.output


def test_baseline_summary_ratios():
    """x faster = t(baseline) / t(moecomm) per phase, from the means over ranks (hand arithmetic)."""
    from benchmarks.bench_moe import IMPLS, baseline_summary

    mine, base = IMPLS.index("moecomm"), IMPLS.index("torch-gloo")
    # [rank, impl, layout s, dispatch s, combine s, rows, moved, inter B, intra B, ok, nodes]
    stats = [[[0, mine, 0.001, 0.002, 0.004, 10, 100, 0, 5, 1, 1], [0, base, 0.003, 0.006, 0.010, 10, 400, -1, -1, 1, 1]],
             [[1, mine, 0.001, 0.004, 0.006, 10, 100, 0, 5, 1, 1], [1, base, 0.005, 0.012, 0.020, 10, 400, -1, -1, 1, 1]]]
    got = baseline_summary(stats)
    want = {"dispatch": 0.009 / 0.003, "combine": 0.015 / 0.005, "dispatch+combine": 0.024 / 0.008,
            "with the layout": 0.028 / 0.009}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-12 for k in want), got
    assert baseline_summary([[row[0]] for row in stats]) is None      # no baseline row


def test_bench_moe_json_and_summary(tmp_path):
    import json

    out = tmp_path / "moe.json"
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "24", "--hidden", "16", "--experts", "4", "-k", "2",
                                    "--nprocs", "2", "--iters", "1", "--warmup", "0", "--dtype", "bfloat16",
                                    "-J", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "# x faster than the baseline (mean over ranks): dispatch " in res.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == "moecomm-bench-moe/1" and doc["options"]["tokens"] == 24
    assert sorted((r["rank"], r["impl"]) for r in doc["rows"]) == [(0, "moecomm"), (0, "torch-gloo"),
                                                                   (1, "moecomm"), (1, "torch-gloo")]
    assert all(r["ok"] and r["combine_us"] > 0 for r in doc["rows"])
    assert set(doc["x_faster_than_baseline"]) == {"dispatch", "combine", "dispatch+combine", "with the layout"}


def test_bench_moe_low_latency_in_emulation_checks_every_variant(tmp_path, monkeypatch):
    """--mode low_latency on the CPU: the dispatcher's kernels in Triton's interpreter, checked; times mean nothing."""
    import json

    pytest.importorskip("triton")
    monkeypatch.setenv("MOECOMM_IPC_EMULATE", "1")  # the CLI sets it for its ranks; restored after the test
    out = tmp_path / "ll.json"
    res = CliRunner().invoke(main, ["bench-moe", "--mode", "low_latency", "--fp8", "--tokens", "8", "--hidden", "256",
                                    "--experts", "8", "-k", "3", "--nprocs", "2", "--iters", "1", "--warmup", "0",
                                    "-J", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [ln.split() for ln in res.output.splitlines() if ln.split() and ln.split()[0] in ("0", "1")]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (str(rank), impl) for rank in range(2) for impl in ("moecomm", "torch-gloo", "moecomm-ll", "moecomm-ll-fp8"))
    assert all(r[-1] == "ok" for r in rows), res.output
    assert "the times mean nothing" in res.output
    doc = json.loads(out.read_text())
    assert set(doc["low_latency"]) == {"moecomm-ll", "moecomm-ll-fp8"}
    ll = [r for r in doc["rows"] if r["impl"].startswith("moecomm-ll")]
    # DeepEP's byte counts per sent (token, expert) selection: 8 tokens x top-3 per rank
    assert {r["impl"]: r["dispatch_bytes"] for r in ll} == {"moecomm-ll": 24 * 512, "moecomm-ll-fp8": 24 * (256 + 8 + 16)}
    assert all(r["combine_bytes"] == 24 * 512 for r in ll)
    # every selection arrives somewhere: the ranks' received rows add up to both ranks' selections
    assert sum(r["recv_rows"] for r in ll if r["impl"] == "moecomm-ll") == 2 * 24


def test_bench_moe_low_latency_options(monkeypatch):
    import torch

    res = CliRunner().invoke(main, ["bench-moe", "--fp8", "--nprocs", "2"])
    assert res.exit_code == 2 and "add --mode low_latency" in res.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["bench-moe", "--mode", "low_latency", "--cuda-graph", "10", "--nprocs", "2"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_low_latency_summary_ratios():
    """x faster = the normal mode's (baseline's) layout + dispatch + combine / the variant's dispatch + combine."""
    from benchmarks.bench_moe import IMPLS, low_latency_summary

    mine, base, ll = IMPLS.index("moecomm"), IMPLS.index("torch-nccl"), IMPLS.index("moecomm-ll-fp8")
    row = [0.0] * 13
    stats = [[[r, mine, 0.001, 0.002, 0.003, *row[5:]], [r, base, 0.002, 0.004, 0.006, *row[5:]],
              [r, ll, 0.0, 0.0001 * (r + 1), 0.0002, *row[5:]]] for r in range(2)]
    got = low_latency_summary(stats)["moecomm-ll-fp8"]
    t = 0.00015 + 0.0002
    assert abs(got["dispatch+combine_us"] - t * 1e6) < 1e-9
    assert abs(got["x_faster_than_normal"] - 0.006 / t) < 1e-9 and abs(got["x_faster_than_baseline"] - 0.012 / t) < 1e-9
    assert low_latency_summary([[r[0]] for r in stats]) is None
