"""``bench --path socket,shm`` across two testbed nodes whose link is shaped to 1 Gbit/s, against the model.

One torchrun job, 2 nodes x 2 ranks: socket (gloo over TCP, all 4 ranks; the ring crosses the shaped veth)
and shm (within each node) in one invocation, each verified. The socket row's busbw at 64 MiB must be within
20% of what 1 Gbit/s carries as TCP payload, and ``predict --path socket`` with the link's numbers within
25% of the measured socket rows from 1 MiB: their mean ratio, and every row from 4 MiB. The 1 MiB row alone
read 0.69-1.03 of the prediction over five runs: on this VM a small gloo all_reduce between testbed nodes
takes ~6.5 ms (torch's own gloo, unshaped link), which partly overlaps a 13 ms transfer and which no link
number can tell (docs/benchmarks.md). Skipped where the testbed cannot be made (not root, no tc).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.testbed import node_env
from testbed import make_testbed  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[1]
RATE = "1gbit"
PAYLOAD_GBPS = 1e9 * 1448 / 1514 / 8 / 1e9  # TCP payload of a 1500-byte MTU, as the qdisc counts bytes


def test_socket_row_follows_the_shaped_link_and_the_model(make_testbed, tmp_path):  # noqa: F811 - fixture
    tb = make_testbed(2, rate=RATE)
    run = tmp_path / "run.json"
    argv = ["-m", "benchmarks.cli", "bench", "--path", "socket,shm", "--ops", "all_reduce", "-b", "1M", "-e", "64M",
            "-f", "4", "-n", "3", "-w", "1", "-c", "0", "-q", "--no-save", "-J", str(run)]
    env = node_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    try:
        procs = [tb.popen(i, cmd, env=env, stdout=logs[i], stderr=subprocess.STDOUT, cwd=ROOT)
                 for i, cmd in enumerate(tb.torchrun_commands(2, argv))]
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for f in logs:
            f.close()
    text = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], text[-4000:]
    doc = json.loads(run.read_text())
    rows = doc["rows"]
    assert {(r["transport"], r["path"], r["nranks"]) for r in rows} == {("socket", "socket", 4), ("shm", "shm", 2)}
    assert doc["env"]["paths"]["shm"]["within_node"] and not doc["env"]["paths"]["socket"]["within_node"]
    socket_rows = {r["size"]: r for r in rows if r["path"] == "socket"}
    big = socket_rows[64 << 20]
    busbw = max(big["busbw"], big["ip_busbw"])
    assert abs(busbw / PAYLOAD_GBPS - 1) <= 0.20, (busbw, PAYLOAD_GBPS, text[-3000:])
    shm_big = max(r["busbw"] for r in rows if r["path"] == "shm" and r["size"] == 64 << 20)
    assert shm_big > 3 * busbw  # inside a node the bytes never meet the shaped link
    # the model with the link's numbers, beside the measured rows
    out = tmp_path / "predicted.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "predict", "--path", "socket", "--measured", str(run),
                        "--link-rate", RATE, "-J", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    points = json.loads(out.read_text())["rows"]
    assert sorted(pt["size"] for pt in points) == sorted(socket_rows) == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    ratios = {pt["size"]: pt["ratio"] for pt in points}
    assert abs(sum(ratios.values()) / len(ratios) - 1) <= 0.25, p.stdout
    assert all(abs(r - 1) <= 0.25 for size, r in ratios.items() if size >= 4 << 20), p.stdout
