"""The multi-node testbed itself (benchmarks/testbed.py): isolation, shaping, cleanup, the CLI.

Jobs across its nodes are tested in tests/test_multinode.py. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.testbed import STATE_ROOT, choose_subnet, parse_rate, split_cpus
from benchmarks.testbed import testbeds as list_testbeds
from testbed import leftovers, make_testbed, namespace_inodes, skip_without_namespaces  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def _in(tb, i: int, code: str) -> str:
    p = tb.run(i, [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_rates_subnets_and_cpu_shares():
    assert parse_rate("4400mbit") == 4_400_000_000 and parse_rate("1gbit") == 10**9 and parse_rate("100MBps") == 8 * 10**8
    for bad in ("fast", "-1gbit", "0mbit"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    cpus = sorted(os.sched_getaffinity(0))
    shares = split_cpus(len(cpus))
    assert shares == [str(c) for c in cpus]  # one CPU each
    assert len(split_cpus(len(cpus) + 1)) == len(cpus) + 1  # more nodes than CPUs: shared round robin


def test_a_range_that_overlaps_this_machine_is_refused():
    skip_without_namespaces()
    with open("/proc/net/route") as f:  # this machine's first routed IPv4 network
        rows = [line.split() for line in f.readlines()[1:]]
    dst = next((r for r in rows if r[1] != "00000000"), None)
    if dst is None:
        pytest.skip("no routed IPv4 network here to collide with")
    net = ipaddress.ip_network((int(dst[1], 16).to_bytes(4, "little"), bin(int(dst[7], 16)).count("1")), strict=False)
    with pytest.raises(ValueError, match="overlaps"):
        choose_subnet(str(net), 2)


def test_nodes_share_only_the_network(make_testbed):  # noqa: F811 - fixture
    tb = make_testbed(2, rate="800mbit")
    probe = """
        import os, socket, subprocess
        from collectives.topology import node_identity
        name = f"/dev/shm/tb-probe-{socket.gethostname()}"
        open(name, "w").close()
        ipc = subprocess.run(["ipcmk", "-M", "4096"], capture_output=True, text=True).stdout.split()[-1]
        print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), node_identity(),
              sorted(os.listdir("/dev/shm")), ipc, sorted(os.sched_getaffinity(0)))
    """
    seen = [_in(tb, i, probe).split(" ", 3) for i in range(2)]
    for i, (host, addr, ident, rest) in enumerate(seen):
        assert host == f"node{i}" and addr == tb.nodes[i].address
        assert f"tb-probe-node{1 - i}" not in rest and f"tb-probe-node{i}" in rest  # /dev/shm of its own
    assert seen[0][2] != seen[1][2], "two nodes with one node identity"
    assert not os.path.exists("/dev/shm/tb-probe-node0"), "a node wrote into the host's /dev/shm"
    ipcs = _in(tb, 1, "import subprocess; print(subprocess.run(['ipcs', '-m'], capture_output=True, text=True).stdout)")
    assert ipcs.count("0x") == 1, f"node 1 sees SysV segments other than its own:\n{ipcs}"  # IPC namespace
    # the shaped links: a token bucket of the rate on both ends of every node's link
    for i, n in enumerate(tb.nodes):
        for tc in (["tc", "-j", "qdisc", "show", "dev", f"{tb.tag}h{i}"],
                   ["tc", "-n", n.netns, "-j", "qdisc", "show", "dev", "tb0"]):
            q = json.loads(subprocess.run(tc, capture_output=True, text=True, check=True).stdout)
            assert any(x["kind"] == "tbf" for x in q), q
    # node 0 reaches node 1 by name through the bridge
    server = tb.popen(1, [sys.executable, "-c", "import socket; s = socket.create_server(('0.0.0.0', 7000)); "
                                                "c, a = s.accept(); c.sendall(a[0].encode())"])
    got = _in(tb, 0, """
        import socket, time
        for _ in range(100):
            try:
                print(socket.create_connection(("node1", 7000)).recv(64).decode()); break
            except OSError:
                time.sleep(0.05)
    """)
    server.wait(timeout=10)
    assert got == tb.nodes[0].address


def test_leftovers_of_a_crashed_owner_are_removed_by_the_next_testbed(make_testbed):  # noqa: F811 - fixture
    crash = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, subprocess
        from benchmarks.testbed import Testbed
        tb = Testbed(2).up()
        tb.popen(1, ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(tb.tag, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    tag = crash.stdout.split()[0]
    state = next(s for s in list_testbeds() if s["tag"] == tag)
    assert not state["alive"]
    inodes = {(kind, os.stat(f"/proc/{n['pid']}/ns/{kind}").st_ino) for n in state["nodes"] for kind in ("net", "mnt")}
    fresh = make_testbed(1)  # its up() removes what the crashed run left
    assert leftovers(tag, inodes - namespace_inodes(fresh)) == []  # (the kernel reuses freed namespace inodes)


def test_cli_up_status_run_down():
    skip_without_namespaces()
    from click.testing import CliRunner

    from benchmarks.cli import main

    name = "mtbclit"

    def moecomm(*args: str):
        return CliRunner().invoke(main, ["testbed", *args])

    up = moecomm("up", "-n", "2", "--name", name, "--rate", "1gbit")
    inodes = set()
    try:
        assert up.exit_code == 0 and "node1" in up.output, up.output
        inodes = {(kind, os.stat(f"/proc/{n['pid']}/ns/{kind}").st_ino)
                  for s in list_testbeds() if s["tag"] == name for n in s["nodes"] for kind in ("net", "mnt")}
        st = moecomm("status")
        assert f"{name}: 2 node(s)" in st.output and "1000 Mbit/s" in st.output, st.output
        # the command's exit status comes back: 3 only where node 1 is node1
        run = moecomm("run", "--name", name, "--node", "1", "--", "sh", "-c", 'test "$(hostname)" = node1 && exit 3')
        assert run.exit_code == 3, run.output
    finally:
        down = moecomm("down", "--name", name)
    assert down.exit_code == 0, down.output
    assert leftovers(name, inodes) == [] and not (STATE_ROOT / name).exists()
    missing = moecomm("run", "--name", name, "--", "true")
    assert missing.exit_code != 0 and "no testbed" in missing.output
