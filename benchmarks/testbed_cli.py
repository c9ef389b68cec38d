"""``moecomm testbed``: several nodes on this machine (benchmarks/testbed.py) from the command line.

    moecomm testbed up -n 2 --rate 2gbit                 # a testbed named mtbcli, left up
    moecomm testbed run --node 1 -- hostname             # one command in one node
    moecomm testbed run --torchrun 2 -- train.py         # torchrun on every node (2 ranks each)
    moecomm testbed run --mpiexec 2 -- moecomm bench     # mpiexec from node 0 over every node
    moecomm testbed run -n 2 --rate 2gbit --mpiexec 2 -- moecomm bench   # up, run, down in one go
    moecomm testbed status / down [--all]
"""

from __future__ import annotations

import sys

import click

from .testbed import (
    Testbed,
    check_delay,
    check_name,
    node_env,
    parse_rate,
    parse_subnet,
    remove,
    remove_leftovers,
    testbeds,
    unavailable,
)

DEFAULT_NAME = "mtbcli"


def _need_namespaces() -> None:
    why = unavailable()
    if why:
        raise click.ClickException(f"cannot make a testbed here: {why}")


def _checked(nodes: int, *, name: str | None = None, rate: str | None = None, delay_ms: float | None = None,
             subnet: str | None = None, persistent: bool = False) -> Testbed:
    """The Testbed these options describe, not yet up; a bad option is a usage error naming it (exit 2)."""
    checks = {"--name": (name, check_name), "--rate": (rate, parse_rate), "--delay-ms": (delay_ms, check_delay),
              "--subnet": (subnet, lambda s: parse_subnet(s, nodes))}
    for hint, (value, check) in checks.items():
        try:
            if value is not None:
                check(value)
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix("testbed: "), param_hint=hint) from None
    return Testbed(nodes, rate=rate, delay_ms=delay_ms, subnet=subnet, name=name, persistent=persistent)


def _bring_up(tb: Testbed) -> Testbed:
    """``tb.up()``; a range that overlaps this machine's is a usage error (exit 2), a failed step exit 1."""
    try:
        return tb.up()
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("testbed: "), param_hint="--subnet") from None
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None


def _check_name(name: str) -> None:
    try:
        check_name(name)
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("testbed: "), param_hint="--name") from None


def _need_up(name: str) -> None:
    """A usage error unless testbed ``name`` is up."""
    if not any(s["tag"] == name for s in testbeds()):
        raise click.UsageError(f"no testbed {name!r} is up (see `moecomm testbed status`); make one with "
                               "`moecomm testbed up`, or pass -n N for one just for this run")


def _check_node(node: int | None, size: int | None) -> None:
    """A usage error unless ``node`` is None or one of the ``size`` nodes (None: not known yet)."""
    if node is not None and (node < 0 or (size is not None and node >= size)):
        has = f"the testbed has nodes 0..{size - 1}" if size is not None else "nodes count from 0"
        raise click.BadParameter(f"{has}, not {node}", param_hint="--node")


@click.group("testbed")
def testbed() -> None:
    """Several nodes on this machine: network namespaces with their own address, hostname and /dev/shm,
    joined by a bridge whose links may be shaped (rate, delay), to run multi-node jobs without a cluster."""


_shaping = [
    click.option("--rate", default=None, help="Shape every node's link to this rate, each direction: tc notation "
                                              "('2gbit', '800mbit') or bits/s."),
    click.option("--delay-ms", type=float, default=None, help="Add this one-way delay on every node's link "
                                                              "(needs netem in the kernel)."),
    click.option("--subnet", default=None, help="The nodes' private range (default: 10.77.0.0/24, or the next "
                                                "default that overlaps nothing on this machine)."),
]


def _with_shaping(fn):
    for opt in reversed(_shaping):
        fn = opt(fn)
    return fn


@testbed.command("up")
@click.option("-n", "--nodes", type=click.IntRange(1, 99), default=2, show_default=True, help="How many nodes.")
@click.option("--name", default=DEFAULT_NAME, show_default=True, help="Its tag ('mtb' plus up to 6 letters/digits).")
@_with_shaping
def up(nodes: int, name: str, rate: str | None, delay_ms: float | None, subnet: str | None) -> None:
    """Create a testbed and leave it up (replacing one of the same name); `down` removes it."""
    tb = _checked(nodes, rate=rate, delay_ms=delay_ms, subnet=subnet, name=name, persistent=True)
    _need_namespaces()
    tb = _bring_up(tb)
    click.echo(tb.describe())
    click.echo(f"run in it: moecomm testbed run --name {name} [--node I | --torchrun P | --mpiexec P] -- COMMAND")


@testbed.command("down")
@click.option("--name", default=DEFAULT_NAME, show_default=True, help="The testbed to remove.")
@click.option("--all", "everything", is_flag=True, help="Remove every testbed on this machine, and any leftovers.")
def down(name: str, everything: bool) -> None:
    """Stop everything running in a testbed and remove it."""
    if not everything:
        _check_name(name)
    _need_namespaces()
    if everything:
        removed = remove_leftovers(keep_persistent=False, also=None)
        for state in testbeds():  # live ones of other processes too
            remove(state["tag"])
            removed.append(state["tag"])
        click.echo(f"removed: {', '.join(removed) or 'nothing'}")
        return
    if not any(s["tag"] == name for s in testbeds()):
        raise click.UsageError(f"no testbed {name!r} is up (see `moecomm testbed status`)")
    remove(name)
    click.echo(f"removed {name}")


@testbed.command("status")
def status() -> None:
    """The testbeds on this machine: nodes, addresses, shaping, owner."""
    states = testbeds()
    if not states:
        click.echo("no testbed is up")
    for s in states:
        owner = "left up by `moecomm testbed up`" if s.get("owner") is None else \
            f"owned by pid {s['owner']}" + ("" if s["alive"] else " (gone: `up` or `down --all` removes it)")
        rate = f"{s['rate_bps'] / 1e6:g} Mbit/s" if s.get("rate_bps") else "unshaped"
        delay = f", delay {s['delay_ms']:g} ms" if s.get("delay_ms") else ""
        click.echo(f"{s['tag']}: {len(s.get('nodes', []))} node(s) on {s.get('subnet')}, {rate}{delay}; {owner}")
        for n in s.get("nodes", []):
            click.echo(f"  {n['hostname']}  {n['address']}  netns {n['netns']}  holder pid {n['pid']}")


@testbed.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default=DEFAULT_NAME, show_default=True, help="The testbed to run in (made by `up`).")
@click.option("-n", "--nodes", type=click.IntRange(1, 99), default=None,
              help="Make a testbed of this many nodes for this run only (torn down after), instead of --name.")
@_with_shaping
@click.option("--node", "node", type=int, default=None, help="Run COMMAND in this node only (default 0).")
@click.option("--torchrun", "torchrun_ppn", type=click.IntRange(1), default=None,
              help="Run `torchrun --nnodes N --node-rank i --nproc-per-node P --master-addr <node0> COMMAND` "
                   "in every node.")
@click.option("--mpiexec", "mpiexec_ppn", type=click.IntRange(1), default=None,
              help="Run `mpiexec -hosts node0,... -ppn P COMMAND` from node 0 (MPICH Hydra; its proxies start "
                   "in their nodes).")
@click.option("--port", type=int, default=29500, show_default=True,
              help="torchrun's rendezvous port on node 0 (a fixed one: every node's torchrun dials it).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(name: str, nodes: int | None, rate: str | None, delay_ms: float | None, subnet: str | None,
        node: int | None, torchrun_ppn: int | None, mpiexec_ppn: int | None, port: int,
        command: tuple[str, ...]) -> None:
    """Run COMMAND in the testbed's nodes; exits with its status (the worst node's under --torchrun)."""
    if sum(x is not None for x in (node, torchrun_ppn, mpiexec_ppn)) > 1:
        raise click.UsageError("give one of --node, --torchrun, --mpiexec")
    if nodes is None and (rate is not None or delay_ms is not None or subnet is not None):
        raise click.UsageError("--rate/--delay-ms/--subnet shape a testbed made for this run (-n); "
                               "`moecomm testbed up` shapes a lasting one")
    if port == 0:  # node 0's torchrun would listen on a port no other node knows: they wait for ever
        raise click.BadParameter("0 (any free port) cannot work: every node's torchrun must be told the same port; "
                                 "give one free on node 0, e.g. 29500", param_hint="--port")
    if not 1 <= port <= 65535:
        raise click.BadParameter(f"{port} is not a TCP port (1..65535)", param_hint="--port")
    _check_node(node, nodes)
    _check_name(name)
    made = _checked(nodes, rate=rate, delay_ms=delay_ms, subnet=subnet) if nodes else None  # not up yet
    _need_namespaces()
    if made is not None:
        tb = _bring_up(made)
    else:
        _need_up(name)
        try:
            tb = Testbed.attach(name)
        except LookupError as e:  # gone since, or broken
            raise click.ClickException(str(e)) from None
        _check_node(node, tb.size)
    env = node_env()
    try:
        if nodes:
            click.echo(tb.describe(), err=True)
        if torchrun_ppn:
            procs = [tb.popen(i, cmd, env=env)
                     for i, cmd in enumerate(tb.torchrun_commands(torchrun_ppn, list(command), port=port))]
        elif mpiexec_ppn:
            procs = [tb.mpiexec(mpiexec_ppn, list(command), env=env)]
        else:
            procs = [tb.popen(node or 0, list(command), env=env)]
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        codes = [130]
    finally:
        if nodes:
            tb.down()
    sys.exit(max(codes, key=abs) if codes else 0)
