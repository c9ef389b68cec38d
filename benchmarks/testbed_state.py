"""What multi-node testbeds (benchmarks/testbed.py) exist on this machine, and removing them.

A testbed's state is ``/run/moecomm-testbed/<tag>/state.json``, written before anything else is made, so
that a testbed whose owner crashed can be found and removed (:func:`remove_leftovers`); every name a testbed
makes starts with its tag, so what no state claims can be removed by the ``mtb`` prefix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger("moecomm.testbed")

STATE_ROOT = Path("/run/moecomm-testbed")
FAMILY = "mtb"  # every name a testbed makes starts with this


def _sh(*argv: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run a system tool; raise RuntimeError with its stderr when ``check`` and it fails."""
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"testbed: `{' '.join(argv)}` failed ({p.returncode}): {p.stderr.strip()}")
    if p.returncode != 0 and not quiet:
        log.debug("`%s` failed: %s", " ".join(argv), p.stderr.strip())
    return p


def _start_time(pid: int) -> str | None:
    """The kernel start time of process ``pid`` (tells a live owner from a reused pid), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _netns_pids(netns: str) -> list[int]:
    p = _sh("ip", "netns", "pids", netns, check=False, quiet=True)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def remove(tag: str) -> None:
    """Remove testbed ``tag`` (whoever made it): stop every process in its nodes, delete its namespaces,
    links and state. Nothing happens for a tag that is not up."""
    state = next((s for s in testbeds() if s["tag"] == tag), None)
    _teardown(tag, len(state.get("nodes", [])) if state else None)


def _teardown(tag: str, nodes: int | None = None) -> None:
    """Remove every trace of testbed ``tag``: its processes, namespaces, links and state directory."""
    d = STATE_ROOT / tag
    names = {ns for ns in netns_names() if ns.startswith(tag + "n")}
    if nodes is not None:
        names |= {f"{tag}n{i}" for i in range(nodes)}
    for ns in sorted(names):
        # only processes inside this testbed's namespaces: what its launches started
        killed: set[int] = set()
        for _ in range(50):
            pids = _netns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        _wait_gone(killed, 2.0)
        if os.path.exists(f"/run/netns/{ns}"):
            _sh("ip", "netns", "del", ns, check=False)
    for link in link_names():
        if link.startswith(tag):
            _sh("ip", "link", "del", link, check=False, quiet=True)
    shutil.rmtree(d, ignore_errors=True)


def _wait_gone(pids: set[int], limit: float) -> None:
    """Wait until these processes have exited (gone, or zombies: their namespaces are released by then)."""
    end = time.monotonic() + limit
    while pids and time.monotonic() < end:
        pids = {p for p in pids if (_state(p) or "Z") != "Z"}
        if pids:
            time.sleep(0.01)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def netns_names() -> list[str]:
    """The network namespaces `ip netns` knows (names in /run/netns)."""
    try:
        return sorted(os.listdir("/run/netns"))
    except OSError:
        return []


def link_names() -> list[str]:
    """The network interfaces of this (the host's) network namespace."""
    p = _sh("ip", "-j", "link", "show", check=False, quiet=True)
    try:
        return [row["ifname"] for row in json.loads(p.stdout or "[]")]
    except (json.JSONDecodeError, KeyError):
        return []


def testbeds() -> list[dict]:
    """Every testbed whose state is on this machine (``moecomm testbed status``).

    Returns:
        Their states (tag, owner, subnet, nodes, shaping), each with ``alive``: whether its owner still runs
        (always True for a persistent one).
    """
    out = []
    if not STATE_ROOT.is_dir():
        return out
    for d in sorted(STATE_ROOT.iterdir()):
        try:
            state = json.loads((d / "state.json").read_text())
        except (OSError, json.JSONDecodeError):
            state = {"tag": d.name, "owner": -1, "owner_start": None, "nodes": []}
        owner = state.get("owner")
        state["alive"] = owner is None or (_start_time(owner) is not None
                                           and _start_time(owner) == state.get("owner_start"))
        out.append(state)
    return out


def remove_leftovers(*, keep_persistent: bool = True, also: str | None = None) -> list[str]:
    """Tear down what crashed runs left: testbeds whose owner is gone, and ``mtb*`` names no testbed claims.

    Args:
        keep_persistent: leave testbeds made by ``moecomm testbed up`` (no owner process) alone.
        also: a tag to remove in any case (the one about to be made).
    Returns:
        The tags (or orphan names) removed.
    """
    removed = []
    claimed = set()
    for state in testbeds():
        tag = state["tag"]
        stale = not state["alive"] or (not keep_persistent and state.get("owner") is None)
        if tag == also or stale:
            _teardown(tag, len(state.get("nodes", [])))
            removed.append(tag)
        else:
            claimed.add(tag)
    for name in netns_names() + link_names():
        if name.startswith(FAMILY) and not any(name.startswith(t) for t in claimed):
            if name in netns_names():
                for pid in _netns_pids(name):
                    os.kill(pid, signal.SIGKILL)
                _sh("ip", "netns", "del", name, check=False)
            else:
                _sh("ip", "link", "del", name, check=False, quiet=True)
            removed.append(name)
    if removed:
        log.info("testbed: removed leftovers %s", removed)
    return removed
