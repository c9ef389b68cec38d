"""Several "nodes" on one Linux machine: network namespaces joined by a bridge, for multi-node runs without a cluster.

Each node is a network namespace with one veth interface (``tb0``) on a bridge and an address in a private
range (10.77.0.0/24 unless that overlaps a route of this machine), its own hostname (UTS namespace) and its
own ``/dev/shm`` and ``/etc/hosts`` (a mount namespace): nodes share nothing but the network and the file
system, as the machines of a cluster share a network file system. The hosts file maps every node's hostname
to its address, so launchers (torchrun, MPICH's Hydra) and rendezvous resolve node names to the nodes'
own addresses and traffic never leaves the bridge. The links between nodes may be shaped (``tc``: a token
bucket for the rate, netem for a delay where the kernel has it), in both directions of every node's link,
as a NIC limits what it sends and what it receives.

Names: everything a testbed makes starts with its tag (``mtb`` plus 4 characters): namespaces
``<tag>n<i>``, host-side veths ``<tag>h<i>``, the bridge ``<tag>br``, and ``/run/moecomm-testbed/<tag>/``,
which holds the state, the hosts file, the mount and UTS namespaces (bind-mounted files, as ``ip netns``
keeps network namespaces) and the ``ssh`` stand-in for Hydra. A testbed tears down what it made on
:meth:`Testbed.down`, at the end of a ``with`` block, at interpreter exit and on SIGTERM; :meth:`Testbed.up`
first removes what a crashed earlier run left (a testbed whose owner process is gone, or anything with the
``mtb`` prefix that no live testbed claims). Needs root, ``ip``, ``tc``, ``nsenter`` and ``unshare``
(iproute2, util-linux): :func:`unavailable` says what is missing.

Launching across the nodes: :meth:`Testbed.torchrun` runs ``torchrun --nnodes N --node-rank i --master-addr
<node0>`` in every node; :meth:`Testbed.mpiexec` runs MPICH's ``mpiexec -hosts node0,node1,...
-launcher ssh -launcher-exec <tag>/ssh`` in node 0, where the ``ssh`` script runs Hydra's proxy inside the
namespaces of the node it is given, as ssh would run it on that host.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .testbed_state import (FAMILY, STATE_ROOT, _sh, _start_time, _teardown, link_names, netns_names, remove,
                            remove_leftovers, testbeds)

__all__ = ["Testbed", "Node", "unavailable", "parse_rate", "choose_subnet", "split_cpus", "node_env", "STATE_ROOT",
           "FAMILY", "NODE_IFACE", "remove", "remove_leftovers", "testbeds", "netns_names", "link_names"]

log = logging.getLogger("moecomm.testbed")

NODE_IFACE = "tb0"  # the node's interface, the same name in every node (so `mpiexec -iface tb0` fits all)
DEFAULT_SUBNETS = ("10.77.0.0/24", "10.78.0.0/24", "10.79.0.0/24", "172.30.77.0/24")
TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "umount", "hostname", "taskset")
_live: set["Testbed"] = set()
_lock = threading.Lock()


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can.

    Returns:
        A sentence naming what is missing (root, a tool), or None.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or in CI, which runs as root)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tool(s) {missing} (iproute2 and util-linux provide them)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--ipc", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here: unshare says {probe.stderr.strip() or probe.returncode}"
    return None


def parse_rate(rate: str | int | float) -> int:
    """A link rate in bits per second.

    Args:
        rate: bits/s as a number, or tc's notation: "800mbit", "1gbit", "100kbit", or bytes: "100MBps".
    Returns:
        The rate in bits per second (> 0). Raises ValueError for anything else.
    """
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        text = str(rate).strip().lower()
        units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0, "gbps": 8e9, "mbps": 8e6, "kbps": 8e3, "bps": 8.0}
        for unit, scale in units.items():
            if text.endswith(unit):
                try:
                    value = float(text[: -len(unit)]) * scale
                except ValueError:
                    raise ValueError(f"testbed: bad rate {rate!r}; use e.g. '800mbit', '1gbit' or '100MBps'") from None
                break
        else:
            raise ValueError(f"testbed: bad rate {rate!r}; use e.g. '800mbit', '1gbit' or '100MBps'")
    if not value > 0:
        raise ValueError(f"testbed: the rate must be positive, got {rate!r}")
    return int(value)


def check_name(tag: str) -> str:
    """``tag`` if it can name a testbed (``mtb`` plus up to 6 lower-case letters or digits), else ValueError."""
    if not (isinstance(tag, str) and tag.startswith(FAMILY) and tag.isascii() and tag.isalnum() and tag.islower()
            and len(tag) <= 9):
        raise ValueError(f"testbed: name must be {FAMILY!r} plus up to 6 lower-case letters or digits, "
                         f"got {tag!r} (interface names have 15 characters at most)")
    return tag


def check_delay(delay_ms: float) -> float:
    """``delay_ms`` if it is a one-way delay netem can add (finite, >= 0), else ValueError."""
    try:
        ok = math.isfinite(delay_ms) and delay_ms >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"testbed: the delay must be a finite number of ms >= 0, got {delay_ms!r}")
    return delay_ms


def parse_subnet(cidr: str, nodes: int) -> ipaddress.IPv4Network:
    """``cidr`` as an IPv4 range with room for ``nodes`` addresses, else ValueError saying what is wrong."""
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        raise ValueError(f"testbed: bad subnet {cidr!r}; give an IPv4 range such as 10.77.0.0/24") from None
    if net.version != 4:
        raise ValueError(f"testbed: the subnet must be an IPv4 range such as 10.77.0.0/24, got {cidr!r}")
    if net.num_addresses - 2 < nodes:
        raise ValueError(f"testbed: {net} has room for {max(net.num_addresses - 2, 0)} node(s), not {nodes}")
    return net


def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine routes or has an address in (to keep the testbed's range clear)."""
    nets = []
    for argv in (["ip", "-j", "-4", "route", "show", "table", "all"], ["ip", "-j", "-4", "addr"]):
        p = _sh(*argv, check=False, quiet=True)
        try:
            rows = json.loads(p.stdout or "[]")
        except json.JSONDecodeError:
            continue
        for row in rows:
            dst = row.get("dst")
            if dst and dst != "default":
                try:
                    nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
                except ValueError:
                    pass
            for a in row.get("addr_info", []):
                nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def choose_subnet(wanted: str | None, nodes: int) -> ipaddress.IPv4Network:
    """The testbed's private range: ``wanted``, or the first of DEFAULT_SUBNETS that overlaps nothing here.

    Args:
        wanted: a CIDR range, or None for the first free default.
        nodes: how many addresses it must hold.
    Returns:
        The network. Raises ValueError if ``wanted`` overlaps a route or address of this machine or is too
        small, RuntimeError if every default does.
    """
    taken = _host_networks()
    for cidr in ([wanted] if wanted else DEFAULT_SUBNETS):
        net = parse_subnet(cidr, nodes)
        clash = [str(t) for t in taken if t.overlaps(net) and t.prefixlen > 0]
        if not clash:
            return net
        if wanted:
            raise ValueError(f"testbed: {net} overlaps {clash} of this machine; pick another range (subnet=)")
    raise RuntimeError(f"testbed: every default range {DEFAULT_SUBNETS} overlaps a network of this machine; "
                       "pass subnet= with a free private range")


@dataclass(frozen=True)
class Node:
    """One node of a testbed: its index, hostname, address and namespaces."""

    index: int
    hostname: str
    address: str
    netns: str
    pid: int = 0  # the node's holder process: it keeps the node's namespaces (`nsenter -t pid` enters them)
    cpus: str = ""  # the CPUs its processes run on (a kernel cpulist); "" for any


_SSH_SCRIPT = """#!/bin/sh
# Hydra's ssh launcher calls `<this> -x <host> <command>`: run the command in <host>'s namespaces, through a
# shell as sshd would (Hydra quotes its arguments for that shell). Written by benchmarks/testbed.py.
while [ "$#" -gt 0 ]; do
  case "$1" in
    -x|-q|-T) shift ;;
    -o|-p|-l) shift 2 ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "testbed ssh: unknown host $host (nodes: {names})" >&2; exit 255 ;;
esac
exec nsenter --target "$pid" --net --mount --uts --ipc --wd="$PWD" -- $pin /bin/sh -c "$*"
"""


class Testbed:
    """N nodes on this machine (see the module docstring); a context manager that tears them down on exit.

    Args:
        nodes: how many nodes, >= 1.
        rate: shape every node's link to this rate in each direction (bits/s or "800mbit"); None: unshaped.
        delay_ms: one-way delay added on every node's link in each direction (needs netem in the kernel).
        subnet: the private range (default: the first of DEFAULT_SUBNETS that overlaps nothing here).
        name: the tag (``mtb`` plus up to 6 letters or digits); default: a fresh random one.
        persistent: leave it up when this process exits (the CLI's ``testbed up``); otherwise it is torn
            down at exit, and a later ``up`` removes it if this process crashed.
        shm_bytes: size of every node's private /dev/shm.
        pin_cpus: run each node's processes on its own share of this process's CPUs (:func:`split_cpus`),
            as real nodes have their own: without it every rank sees all CPUs, believes its node is not
            oversubscribed, and busy-polls while the ranks of the other nodes wait for a core.
    """

    def __init__(self, nodes: int, *, rate: str | int | float | None = None, delay_ms: float | None = None,
                 subnet: str | None = None, name: str | None = None, persistent: bool = False,
                 shm_bytes: int = 1 << 30, pin_cpus: bool = True):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 99:
            raise ValueError(f"testbed: nodes must be an int in 1..99, got {nodes!r}")
        self.tag = check_name(name) if name is not None else FAMILY + secrets.token_hex(2)
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.delay_ms = check_delay(delay_ms) if delay_ms is not None else None
        if subnet is not None:
            parse_subnet(subnet, nodes)  # a bad range fails here, before anything is made
        self.size = nodes
        self.subnet_wanted = subnet
        self.persistent = persistent
        self.shm_bytes = int(shm_bytes)
        self.pin_cpus = pin_cpus
        self.dir = STATE_ROOT / self.tag
        self.bridge = f"{self.tag}br"
        self.nodes: list[Node] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self._procs: list[subprocess.Popen] = []  # launched in the nodes, holders included (reaped by down)
        self._is_up = False

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> Testbed:
        """Create the nodes (removing leftovers of crashed runs first).

        Returns:
            self. Raises RuntimeError naming the failed step (everything made so far is removed).
        """
        why = unavailable()
        if why:
            raise RuntimeError(f"testbed: {why}")
        remove_leftovers(keep_persistent=True, also=self.tag)
        self.subnet = choose_subnet(self.subnet_wanted, self.size)
        hosts = list(self.subnet.hosts())
        cpus = split_cpus(self.size) if self.pin_cpus else [""] * self.size
        self.nodes = [Node(i, f"node{i}", str(hosts[i]), f"{self.tag}n{i}", cpus=cpus[i]) for i in range(self.size)]
        with _lock:
            _live.add(self)
        _install_exit_handlers()
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        self._is_up = True
        log.info("testbed %s up: %s", self.tag, ", ".join(f"{n.hostname}={n.address}" for n in self.nodes))
        return self

    def _create(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_state()  # first, so that a crash from here on leaves a state a later up() can clean
        # IPv4-mapped forms too: torch's TCPStore sees its peers as ::ffff:a.b.c.d and looks their names up
        # (without them every connection logs "The hostname of the client socket cannot be retrieved")
        (self.dir / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n::ffff:127.0.0.1 localhost\n"
                                        + "".join(f"{n.address} {n.hostname}\n::ffff:{n.address} {n.hostname}\n"
                                                  for n in self.nodes))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        for n in self.nodes:
            host_end = f"{self.tag}h{n.index}"
            _sh("ip", "netns", "add", n.netns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", NODE_IFACE, "netns", n.netns)
            _sh("ip", "link", "set", host_end, "master", self.bridge)
            _sh("ip", "link", "set", host_end, "up")
            _sh("ip", "-n", n.netns, "addr", "add", f"{n.address}/{self.subnet.prefixlen}", "dev", NODE_IFACE)
            _sh("ip", "-n", n.netns, "link", "set", NODE_IFACE, "up")
            _sh("ip", "-n", n.netns, "link", "set", "lo", "up")
            if self.rate_bps or self.delay_ms:
                self._shape(["tc"], host_end)  # into the node
                self._shape(["tc", "-n", n.netns], NODE_IFACE)  # out of the node
            self.nodes[n.index] = self._start_holder(n)
        self._write_ssh_script()
        self._write_state()

    def _start_holder(self, n: Node) -> Node:
        """Start node ``n``'s holder: in the node's network namespace and in new mount, UTS and IPC namespaces
        (mount propagation private, so nothing leaks to the host), it mounts the node's own /dev/shm, /sys (of
        its network namespace, as `ip netns exec` does) and /etc/hosts, sets its hostname, says "ready" and
        sleeps. The IPC namespace keeps SysV shared memory per node: UCX (under MPICH) otherwise moves data
        between "nodes" of one machine through it, around the shaped links (measured, 2 nodes x 2 ranks: a
        32 MiB all_reduce took 47 ms at 500 Mbit/s and 45 ms at 4.4 Gbit/s; with the IPC namespace 705 ms
        and 103 ms at 500 Mbit/s and 4.4 Gbit/s). The PID namespace stays shared: setns cannot enter a
        sibling's PID namespace, and Hydra's proxies are started from node 0. The namespaces live as long as
        the holder; `nsenter -t pid` joins them from anywhere (inside another node too)."""
        setup = (f"mount -t tmpfs -o size={self.shm_bytes},mode=1777 tmpfs /dev/shm && "
                 "umount -l /sys && mount -t sysfs sysfs /sys && "
                 f"mount --bind {self.dir / 'hosts'} /etc/hosts && hostname {n.hostname} && echo ready && "
                 "exec sleep infinity")
        holder = subprocess.Popen(["nsenter", f"--net=/run/netns/{n.netns}", "--", "unshare", "--mount", "--uts",
                                   "--ipc", "--propagation", "private", "--", "/bin/sh", "-c", setup],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True, text=True)
        line = holder.stdout.readline().strip()
        if line != "ready":
            holder.kill()
            _, err = holder.communicate(timeout=5)
            raise RuntimeError(f"testbed: setting up {n.hostname}'s namespaces failed: {err.strip() or line}")
        holder.stdout.close()
        holder.stderr.close()
        self._procs.append(holder)
        return Node(n.index, n.hostname, n.address, n.netns, holder.pid, n.cpus)

    def _shape(self, tc: list[str], dev: str) -> None:
        """Limit what leaves ``dev``: netem (delay, and rate if asked) where the kernel has it, else tbf."""
        if self.delay_ms:
            args = ["netem", "delay", f"{self.delay_ms}ms"]
            if self.rate_bps:
                args += ["rate", f"{self.rate_bps}bit"]
            p = _sh(*tc, "qdisc", "add", "dev", dev, "root", *args, check=False)
            if p.returncode != 0:
                raise RuntimeError(f"testbed: cannot add a delay ({p.stderr.strip()}): this kernel has no netem "
                                   "(CONFIG_NET_SCH_NETEM); shape by rate only (rate= without delay_ms=)")
            return
        # A token bucket: the burst must hold the largest packet (veth passes 64 KiB GSO segments) and at
        # least one timer tick of traffic (tc-tbf(8)); latency bounds the queue.
        burst = max(256 << 10, self.rate_bps // 8 // 100)
        _sh(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst),
            "latency", "200ms")

    def _write_ssh_script(self) -> None:
        cases = "\n".join(f'  {n.hostname}|{n.address}) pid={n.pid}; pin="{" ".join(_pin(n))}" ;;'
                          for n in self.nodes)
        path = self.dir / "ssh"
        path.write_text(_SSH_SCRIPT.format(cases=cases, names=" ".join(n.hostname for n in self.nodes)))
        path.chmod(0o755)

    def _write_state(self) -> None:
        state = {"tag": self.tag, "owner": None if self.persistent else os.getpid(),
                 "owner_start": None if self.persistent else _start_time(os.getpid()),
                 "subnet": str(self.subnet) if self.subnet else None, "rate_bps": self.rate_bps,
                 "delay_ms": self.delay_ms, "shm_bytes": self.shm_bytes,
                 "nodes": [n.__dict__ for n in self.nodes]}
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))

    def down(self) -> None:
        """Stop every process in the nodes and remove everything this testbed made (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                _kill_group(p)
        _teardown(self.tag, self.size)
        self._procs.clear()
        self._is_up = False
        with _lock:
            _live.discard(self)

    @classmethod
    def attach(cls, name: str) -> Testbed:
        """The testbed ``name`` that is up (made by ``moecomm testbed up`` or another process).

        Returns:
            A Testbed that runs commands in it; its :meth:`down` removes it. Raises LookupError if none.
        """
        try:
            state = json.loads((STATE_ROOT / name / "state.json").read_text())
        except (OSError, json.JSONDecodeError):
            raise LookupError(f"no testbed {name!r} is up (see `moecomm testbed status`)") from None
        tb = cls(len(state["nodes"]), name=name, persistent=True, shm_bytes=state.get("shm_bytes", 1 << 30))
        tb.rate_bps, tb.delay_ms = state.get("rate_bps"), state.get("delay_ms")
        tb.subnet = ipaddress.ip_network(state["subnet"]) if state.get("subnet") else None
        tb.nodes = [Node(**n) for n in state["nodes"]]
        for n in tb.nodes:  # the holder must still be the process in the node's network namespace
            try:
                held = os.stat(f"/proc/{n.pid}/ns/net").st_ino == os.stat(f"/run/netns/{n.netns}").st_ino
            except OSError:
                held = False
            if not held:
                raise LookupError(f"testbed {name!r} is broken: {n.hostname}'s holder process {n.pid} is gone; "
                                  f"remove it with `moecomm testbed down --name {name}`")
        tb._is_up = True
        return tb

    # ---- running commands --------------------------------------------------------------------
    def node(self, i: int) -> Node:
        """Node ``i`` (IndexError naming the nodes if there is none)."""
        if not 0 <= i < len(self.nodes):
            raise IndexError(f"testbed {self.tag} has nodes 0..{len(self.nodes) - 1}, not {i}")
        return self.nodes[i]

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside node ``i``'s namespaces, in the current directory."""
        n = self.node(i)
        return ["nsenter", f"--target={n.pid}", "--net", "--mount", "--uts", "--ipc", f"--wd={os.getcwd()}",
                "--", *_pin(n), *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in node ``i`` (its own process group; killed by :meth:`down`).

        Args:
            i: the node.
            argv: the command.
            **kwargs: for :class:`subprocess.Popen` (env, stdout, ...).
        Returns:
            The process.
        """
        p = subprocess.Popen(self.command(i, argv), start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``i`` to its end (kwargs as for :func:`subprocess.run`)."""
        return subprocess.run(self.command(i, argv), **kwargs)

    @property
    def ssh_script(self) -> str:
        """The ``-launcher-exec`` script for Hydra: ``<script> -x <node> <command>`` runs the command there."""
        return str(self.dir / "ssh")

    def torchrun_commands(self, nproc_per_node: int, argv: Sequence[str], *, port: int = 29500,
                          torchrun: str | None = None) -> list[list[str]]:
        """The torchrun command of every node (static rendezvous on node 0's address).

        Args:
            nproc_per_node: ranks per node.
            argv: the script and its arguments (what follows torchrun's options).
            port: the rendezvous port on node 0.
            torchrun: the torchrun executable (default: the one beside this Python).
        Returns:
            [nodes] the argv to run in node i (not yet wrapped by :meth:`command`).
        """
        exe = torchrun or str(Path(sys.executable).parent / "torchrun")
        return [[exe, "--nnodes", str(self.size), "--node-rank", str(n.index), "--nproc-per-node",
                 str(nproc_per_node), "--master-addr", self.nodes[0].address, "--master-port", str(port),
                 *argv] for n in self.nodes]

    def torchrun(self, nproc_per_node: int, argv: Sequence[str], *, port: int = 29500,
                 **kwargs: Any) -> list[subprocess.Popen]:
        """Start ``torchrun ... argv`` in every node (see :meth:`torchrun_commands`).

        Returns:
            [nodes] the torchrun processes, node order.
        """
        return [self.popen(i, cmd, **kwargs) for i, cmd in enumerate(self.torchrun_commands(nproc_per_node, argv,
                                                                                            port=port))]

    def mpiexec_command(self, ranks_per_node: int, argv: Sequence[str], *, mpiexec: str | None = None,
                        extra: Sequence[str] = ()) -> list[str]:
        """MPICH's mpiexec over every node, to run in node 0 (Hydra starts its proxies through :attr:`ssh_script`).

        Args:
            ranks_per_node: ranks on each node (block placement: ranks 0..k-1 on node0, ...).
            argv: the program and its arguments.
            mpiexec: the mpiexec executable (default: the one beside this Python, the mpich wheel's).
            extra: more mpiexec options (e.g. ``-disable-auto-cleanup``).
        Returns:
            The argv (not yet wrapped by :meth:`command`).
        """
        exe = mpiexec or str(Path(sys.executable).parent / "mpiexec")
        return [exe, "-hosts", ",".join(n.hostname for n in self.nodes), "-ppn", str(ranks_per_node),
                "-n", str(ranks_per_node * self.size), "-launcher", "ssh", "-launcher-exec", self.ssh_script,
                "-iface", NODE_IFACE, *extra, *argv]

    def mpiexec(self, ranks_per_node: int, argv: Sequence[str], *, extra: Sequence[str] = (),
                **kwargs: Any) -> subprocess.Popen:
        """Start mpiexec over every node from node 0 (see :meth:`mpiexec_command`; kwargs for Popen)."""
        return self.popen(0, self.mpiexec_command(ranks_per_node, argv, extra=extra), **kwargs)

    def describe(self) -> str:
        """One line per node: hostname, address, namespace; then the shaping."""
        lines = [f"testbed {self.tag}: {self.size} node(s) on {self.subnet}, bridge {self.bridge}"]
        lines += [f"  {n.hostname}  {n.address}  netns {n.netns}  cpus {n.cpus or 'all'}" for n in self.nodes]
        shaping = ", ".join(x for x in (f"rate {self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "",
                                        f"delay {self.delay_ms:g} ms" if self.delay_ms else "") if x)
        lines.append(f"  links: {shaping or 'unshaped'} (each direction of every node's link)")
        return "\n".join(lines)


def split_cpus(nodes: int) -> list[str]:
    """Each node's share of this process's CPUs, as kernel cpulists: disjoint, contiguous, as even as it goes
    (the first nodes get one more); with fewer CPUs than nodes, node i gets CPU i modulo their number (shared).

    Args:
        nodes: how many nodes.
    Returns:
        [nodes] cpulists such as "0-3".
    """
    from collectives.topology.formats import format_cpulist

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < nodes:
        return [str(cpus[i % len(cpus)]) for i in range(nodes)]
    share, extra = divmod(len(cpus), nodes)
    out, at = [], 0
    for i in range(nodes):
        k = share + (1 if i < extra else 0)
        out.append(format_cpulist(cpus[at: at + k]))
        at += k
    return out


def _pin(n: Node) -> list[str]:
    """The taskset prefix that keeps a command on node ``n``'s CPUs (empty when it is not pinned)."""
    return ["taskset", "-c", n.cpus] if n.cpus else []


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _down_all_live() -> None:
    with _lock:
        live = [tb for tb in _live if not tb.persistent]
    for tb in live:
        try:
            tb.down()
        except Exception as e:  # noqa: BLE001 - at exit: do the others
            log.warning("testbed %s: teardown at exit failed: %s", tb.tag, e)


_handlers_installed = False


def _install_exit_handlers() -> None:
    """Tear down at interpreter exit and on SIGTERM/SIGHUP (where nobody else handles them)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_down_all_live)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            def handler(signum: int, frame: Any, _sig: int = sig) -> None:
                _down_all_live()
                signal.signal(_sig, signal.SIG_DFL)
                os.kill(os.getpid(), _sig)
            signal.signal(sig, handler)


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a job in the nodes: launcher variables of an enclosing job removed, and
    this Python's bin directory first on PATH (as in an activated virtual environment), so that the nodes
    run the same python, torchrun, mpiexec and moecomm.

    Args:
        extra: variables to set on top.
    Returns:
        The environment.
    """
    drop = ("PMI_", "HYDRA_", "MPI_LOCAL", "OMPI_", "PMIX_", "MASTER_", "TORCHELASTIC_", "GROUP_", "LOCAL_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    env.update(extra or {})
    return env
