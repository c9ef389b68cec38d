"""`moecomm predict --path P [--measured RUN.json]` (benchmarks/predict_path.py): the socket path's system from
the link's numbers (TCP payload over what tc counts, netem's delay twice per hop), the measured/predicted busbw
ratio per row and its summary, the rows a run is matched by (path, else transport), the testbed's state, the
other paths' systems and algorithms, and one-line usage errors. In-process (CliRunner), no rank started:
the runs are synthetic, their times made from a known link so that the expected ratio is known by hand."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from benchmarks import predict_path as pp
from benchmarks import testbed_state
from benchmarks.cli import main
from benchmarks.common import Row
from benchmarks.output import make_run, save_json

MIB = 1 << 20
# 1 gbit of what tc counts carries TCP payload at 1448/1514 of it (MSS with timestamps over a 1500-byte MTU,
# Ethernet header included), written out here rather than taken from the code under test
PAYLOAD_1GBIT = 1e9 / 8 * 1448 / 1514  # B/s
# bytes each node's link carries per byte of size on 2 nodes x 2 ranks (ring: 2(n-1)/n, (n-1)/n), = bus factor
LINK_BYTES = {"all_reduce": 1.5, "all_gather": 0.75}
SIZES = (64 << 10, 256 << 10, 1 * MIB, 8 * MIB, 64 * MIB)


def invoke(*args, ok: bool = True):
    res = CliRunner().invoke(main, ["predict", *map(str, args)])
    if ok:
        assert res.exit_code == 0, res.output + repr(res.exception)
    return res


def usage_error(*args, says: str) -> str:
    """Exit 2 with one ``Error:`` line (the last) saying ``says``, no traceback."""
    res = invoke(*args, ok=False)
    out = res.output
    assert res.exit_code == 2, (res.exit_code, out, repr(res.exception))
    assert "Traceback" not in out and out.count("Error:") == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("Error:") and says in last, (says, out)
    return last


def link_rows(*, rate: float = PAYLOAD_1GBIT, transport: str = "gloo", path: str = "socket",
              slow_below: int = 0) -> list[Row]:
    """all_reduce and all_gather rows measured at exactly ``rate`` B/s per node link (half of it below
    ``slow_below`` bytes): busbw = that rate, since the bus factor is the link bytes per byte of size."""
    rows = []
    for op, per_byte in LINK_BYTES.items():
        for size in SIZES:
            seconds = per_byte * size / (rate / 2 if size < slow_below else rate)
            algbw = size / seconds / 1e9
            rows.append(Row(op=op, transport=transport, size=size, count=size // 4 // (1 if op == "all_reduce" else 4),
                            dtype="float32", redop="sum", time_us=seconds * 1e6, algbw=algbw,
                            busbw=algbw * per_byte, wrong=0, nranks=4, path=path))
    return rows


def write_run(tmp_path, rows, *, nodes: int = 2, nranks: int = 4, name: str = "run.json", **env):
    p = tmp_path / name
    save_json(p, make_run(rows, {"nodes": nodes, "nranks": nranks, **env}, {}))
    return p


def predicted(tmp_path, *args) -> dict:
    """The ``-J`` document of ``moecomm predict ARGS``."""
    out = tmp_path / "predicted.json"
    invoke(*args, "-J", out)
    return json.loads(out.read_text())


# ---- the socket path's system ------------------------------------------------------------------------
def test_socket_busbw_is_the_tcp_payload_rate(tmp_path):
    doc = predicted(tmp_path, "--path", "socket", "--link-rate", "1gbit", "--nodes", 2, "--gpus-per-node", 2,
                    "-b", "1M", "-e", "64M", "-f", 8)
    assert doc["system"]["nic"]["bandwidth_gbps"] == pytest.approx(PAYLOAD_1GBIT / 1e9, rel=1e-12)
    rows = doc["rows"]
    assert {(r["nodes"], r["gpus_per_node"], r["algorithm"], r["protocol"]) for r in rows} == {(2, 2, "ring", "Simple")}
    for r in rows:  # >= 1 MiB: within 2% of the payload rate (latency), 0.1% at 64 MiB
        assert r["busbw"] == pytest.approx(PAYLOAD_1GBIT / 1e9, rel=0.02 if r["size"] < 64 * MIB else 1e-3), r
        assert r["busbw"] < PAYLOAD_1GBIT / 1e9
    # 800mbit: the same fraction of a lower rate
    doc = predicted(tmp_path, "--path", "socket", "--link-rate", "800mbit", "--nodes", 2, "--gpus-per-node", 2,
                    "-b", "64M", "-e", "64M")
    assert doc["rows"][0]["busbw"] == pytest.approx(0.8 * PAYLOAD_1GBIT / 1e9, rel=1e-3)


def test_socket_delay_is_paid_twice_per_hop(tmp_path):
    args = ("--path", "socket", "--link-rate", "1gbit", "--nodes", 2, "--gpus-per-node", 2, "-b", "8K", "-e", "8K")
    fast = predicted(tmp_path, *args)
    slow = predicted(tmp_path, *args, "--link-delay-ms", 5)
    # netem on the sender's link out and on the receiver's link in: 2 x 5 ms per hop between nodes
    assert slow["system"]["nic"]["latency_us"] == 2 * 5000 + pp.TCP_STACK_US
    assert fast["system"]["nic"]["latency_us"] == pp.TCP_STACK_US
    # a ring all_reduce on 2 nodes crosses between them at least twice in a row
    assert slow["rows"][0]["time_us"] - fast["rows"][0]["time_us"] >= 2 * 2 * 5000


def test_socket_prediction_at_1mib_does_not_depend_on_loopback(tmp_path, monkeypatch):
    args = ("--path", "socket", "--link-rate", "1gbit", "--nodes", 2, "--gpus-per-node", 2, "-b", "1M", "-e", "64M",
            "--op", "all_reduce,all_gather,all_to_all")
    base = [r["busbw"] for r in predicted(tmp_path, *args)["rows"]]
    for scale in (0.25, 10.0):
        monkeypatch.setattr(pp, "LOOPBACK_TCP_GBPS", 2.0 * scale)
        doc = predicted(tmp_path, *args)
        assert doc["system"]["intra"]["bandwidth_gbps"] == 2.0 * scale
        assert [r["busbw"] for r in doc["rows"]] == base


# ---- beside a measured run ---------------------------------------------------------------------------
def test_measured_at_the_payload_rate_reads_ratio_one(tmp_path):
    run = write_run(tmp_path, link_rows(slow_below=1 * MIB))
    out = invoke("--path", "socket", "--link-rate", "1gbit", "--measured", run, "-J", tmp_path / "r.json",
                 "--csv", tmp_path / "r.csv").output
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = doc["rows"]
    assert len(rows) == len(SIZES) * len(LINK_BYTES)
    assert doc["options"]["path"] == "socket" and (doc["options"]["nodes"], doc["options"]["ranks"]) == (2, 4)
    for r in rows:
        assert r["path"] == "socket" and r["peer"] == "gloo"
        assert r["ratio"] == pytest.approx(r["busbw"] / r["pred_busbw"], rel=1e-12)
        measured = PAYLOAD_1GBIT / 1e9 / (2 if r["size"] < MIB else 1)
        assert r["busbw"] == pytest.approx(measured, rel=1e-9)  # what the run says, not recomputed
        if r["size"] == 64 * MIB:  # the payload rate exactly: only the model's latency left
            assert r["ratio"] == pytest.approx(1.0, abs=5e-3) and r["ratio"] > 1.0
        if r["size"] < MIB:
            assert r["ratio"] < 0.75
    # the table's ratio column and the per-op summary: means over >= 1 MiB and over every size
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["all_reduce"], ["all_gather"])]
    per_row = {(f[0], int(f[1])): float(f[8]) for f in table if len(f) == 10}
    assert per_row == {(r["op"], r["size"]): pytest.approx(r["ratio"], abs=5e-4) for r in rows}
    summary = {f[0]: f for f in table if len(f) == 6}
    for op in LINK_BYTES:
        mine = [r for r in rows if r["op"] == op]
        big = [r["ratio"] for r in mine if r["size"] >= MIB]
        assert summary[op][1:3] == ["gloo", str(len(big))] and summary[op][4] == str(len(mine))
        assert float(summary[op][3]) == pytest.approx(sum(big) / len(big), abs=5e-4)
        assert float(summary[op][5]) == pytest.approx(sum(r["ratio"] for r in mine) / len(mine), abs=5e-4)
        assert float(summary[op][5]) < float(summary[op][3])
    header = (tmp_path / "r.csv").read_text().splitlines()[5].split(",")
    assert {"ratio", "busbw", "pred_busbw", "path"} <= set(header)


def test_rows_matched_by_path_else_by_transport(tmp_path):
    # a run with paths: the rows over socket, whatever their transport; a transport named socket does not count
    newer = write_run(tmp_path, link_rows() + link_rows(transport="socket", path="shm"), name="newer.json")
    out = invoke("--path", "socket", "--link-rate", "1gbit", "--measured", newer, "-J", tmp_path / "n.json").output
    rows = json.loads((tmp_path / "n.json").read_text())["rows"]
    assert len(rows) == len(SIZES) * len(LINK_BYTES) and {r["peer"] for r in rows} == {"gloo"}
    assert "matched by path" in out
    # an older run (no row has a path): the rows whose transport is the path
    older = write_run(tmp_path, link_rows(transport="socket", path="") + link_rows(transport="shm", path=""),
                      name="older.json")
    out = invoke("--path", "socket", "--link-rate", "1gbit", "--measured", older, "-J", tmp_path / "o.json").output
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert len(rows) == len(SIZES) * len(LINK_BYTES) and {r["peer"] for r in rows} == {"socket"}
    assert "matched by transport" in out
    usage_error("--path", "socket", "--link-rate", "1gbit", "--measured", older, "--op", "broadcast",
                says="no row of path socket for broadcast")


def test_the_transport_that_measured_the_path_picks_the_algorithms(tmp_path):
    args = ("--path", "socket", "--link-rate", "1gbit", "--op", "all_reduce", "--measured")
    # bench --path records the transport in env.paths: NCCL over sockets runs its tree, which sends a 2-node
    # all_reduce's bytes across once where gloo's ring sends 2(n-1)/n of them
    nccl = write_run(tmp_path, link_rows(), name="nccl.json", paths={"socket": {"transport": "nccl", "ranks": 4}})
    gloo = write_run(tmp_path, link_rows(), name="gloo.json", paths={"socket": {"transport": "gloo", "ranks": 4}})
    by_nccl = {r["size"]: r for r in predicted(tmp_path, *args, nccl)["rows"]}
    by_gloo = {r["size"]: r for r in predicted(tmp_path, *args, gloo)["rows"]}
    assert by_nccl[64 * MIB]["algorithm"] == "tree" and by_nccl[64 * MIB]["ratio"] < 0.95
    assert {r["algorithm"] for r in by_gloo.values()} == {"ring"} and by_gloo[64 * MIB]["ratio"] > 0.99
    # without env.paths: the transport every row's algorithm names ("gloo:allreduce")
    rows = [Row(**{**r.as_dict(), "algorithm": "nccl:ring"}) for r in link_rows()]
    named = write_run(tmp_path, rows, name="named.json")
    assert predicted(tmp_path, *args, named)["rows"][-1]["algorithm"] == "tree"
    shm_by_nccl = write_run(tmp_path, link_rows(path="shm"), name="shm.json", paths={"shm": {"transport": "nccl"}})
    usage_error("--path", "shm", "--measured", shm_by_nccl, says="path shm was measured by nccl")


# ---- the testbed's state -----------------------------------------------------------------------------
def _fake_testbed(root, tag: str, *, rate_bps, delay_ms, nodes: int) -> None:
    d = root / tag
    d.mkdir(parents=True)
    state = {"tag": tag, "owner": None, "owner_start": None, "subnet": "10.77.0.0/24", "rate_bps": rate_bps,
             "delay_ms": delay_ms, "shm_bytes": 1 << 30,
             "nodes": [{"index": i, "hostname": f"node{i}", "address": f"10.77.0.{i + 1}", "netns": f"{tag}n{i}",
                        "pid": 1, "cpus": ""} for i in range(nodes)]}
    (d / "state.json").write_text(json.dumps(state))


def test_testbed_state_gives_the_link_and_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(testbed_state, "STATE_ROOT", tmp_path / "state")
    _fake_testbed(tmp_path / "state", "mtbpp", rate_bps=800_000_000, delay_ms=2.5, nodes=3)
    _fake_testbed(tmp_path / "state", "mtbflat", rate_bps=None, delay_ms=None, nodes=2)
    from_state = predicted(tmp_path, "--path", "socket", "--testbed", "mtbpp", "-b", "1M", "-e", "1M")
    by_hand = predicted(tmp_path, "--path", "socket", "--link-rate", "800mbit", "--link-delay-ms", 2.5, "--nodes", 3,
                        "-b", "1M", "-e", "1M")
    assert from_state["system"] == by_hand["system"]
    assert from_state["system"]["nic"]["latency_us"] == 2 * 2500 + pp.TCP_STACK_US
    assert [r["nodes"] for r in from_state["rows"]] == [3]  # the testbed's nodes unless --nodes says otherwise
    assert from_state["rows"][0]["time_us"] == by_hand["rows"][0]["time_us"]
    usage_error("--path", "socket", "--testbed", "mtbflat", says="does not limit its links' rate")
    usage_error("--path", "socket", "--testbed", "mtbgone", says="no testbed 'mtbgone' is up")
    usage_error("--path", "socket", "--testbed", "mtbpp", "--link-rate", "1gbit", says="--testbed gives the link")


# ---- the other paths ---------------------------------------------------------------------------------
def test_shm_uses_the_shipped_calibration_s_shm_terms(tmp_path):
    doc = predicted(tmp_path, "--path", "shm", "--gpus-per-node", 2, "--op", "all", "-b", "64K", "-e", "1M")
    assert doc["rows"] and all(r["algorithm"].startswith("shm/") for r in doc["rows"])
    assert all(c["algorithm"].startswith("shm/") for r in doc["rows"] for c in r["candidates"])
    run = write_run(tmp_path, link_rows(rate=5e9, transport="shm", path="shm"), nodes=1, nranks=2)
    doc = predicted(tmp_path, "--path", "shm", "--measured", run)
    assert doc["rows"] and all(r["algorithm"].startswith("shm/") for r in doc["rows"])


def test_nvlink_runs_ncclS_algorithms_within_a_node(tmp_path):
    plain = predicted(tmp_path, "--system", "dgx-h100", "-b", "8K", "-e", "8K")
    assert plain["rows"][0]["algorithm"] in pp.IPC_ALGORITHMS  # what the model picks without the path
    doc = predicted(tmp_path, "--path", "nvlink", "--system", "dgx-h100", "-b", "8K", "-e", "8K")
    assert doc["rows"][0]["algorithm"] not in pp.IPC_ALGORITHMS
    run = write_run(tmp_path, link_rows(rate=300e9, transport="nccl", path="nvlink"), nodes=2, nranks=16)
    doc = predicted(tmp_path, "--path", "nvlink", "--system", "dgx-h100", "--measured", run)
    assert (doc["options"]["model_nodes"], doc["options"]["model_ranks"]) == (1, 8)
    assert {r["algorithm"] for r in doc["rows"]} <= {"ring", "tree", "nvls", "nvls_tree", "pairwise"}


# ---- usage errors ------------------------------------------------------------------------------------
def test_usage_errors_are_one_line(tmp_path):
    run = write_run(tmp_path, link_rows())
    one_node_ib = write_run(tmp_path, link_rows(transport="nccl", path="ib"), nodes=1, nranks=4, name="ib.json")
    usage_error("--path", "carrier-pigeon", says="unknown path 'carrier-pigeon'")
    usage_error("--path", "shm", "--measured", run, says="run.json has no row of path shm: its rows' paths are socket")
    usage_error("--path", "socket", "--measured", run, says="--path socket needs the link's numbers: --link-rate")
    usage_error("--path", "socket", "--link-delay-ms", 3, says="--link-rate RATE")
    usage_error("--path", "socket", "--link-rate", "fast", says="--link-rate")
    usage_error("--path", "socket", "--link-rate", "1gbit", "--link-delay-ms", -1, says="--link-delay-ms")
    usage_error("--path", "ib", "--system", "dgx-h100", "--measured", one_node_ib,
                says="--path ib is the model's NET path, between nodes: it needs >= 2 nodes, and ib.json ran on 1 node")
    usage_error("--path", "roce", "--system", "dgx-h100", says="needs >= 2 nodes")
    usage_error("--measured", run, says="--measured goes with --path P")
    usage_error("--path", "nvlink", "--system", "dgx-h100", "--link-rate", "1gbit", says="--link-rate describes")
    usage_error("--path", "pcie", "--system", "dgx-h100", says="not pcie")
    usage_error("--path", "socket", "--link-rate", "1gbit", "--system", "dgx-h100", says="drop --system")
    usage_error("--path", "socket", "--link-rate", "1gbit", "--measured", run, "-b", "1M", says="-b does not apply")
