"""Test-side helpers for the multi-node testbed (implementation: benchmarks/testbed.py).

``make_testbed`` (a pytest fixture) builds testbeds that are torn down after the test and then checked
to have left nothing: no namespace, veth, bridge or state directory with their tag, and no process in
any of their nodes' namespaces (so each node's private /dev/shm, and every segment in it, is gone).
Where namespaces cannot be made (not root, no ``ip``/``unshare``) the test is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO, Any, Callable, Iterator, Sequence

import pytest

from benchmarks.testbed import STATE_ROOT, Testbed, link_names, netns_names, unavailable


def start_job(tb: Testbed, launcher: str, ppn: int, argv: Sequence[str], env: dict[str, str],
              logs: Sequence[IO[str]], *, mpi_extra: Sequence[str] = ()) -> list[subprocess.Popen]:
    """Start the Python script ``argv`` (its path, then its arguments) with ``ppn`` ranks on every node
    of ``tb``: "torchrun", one per node (node i writes to ``logs[i]``, or to the one log given), or
    "mpiexec", one across the nodes (to ``logs[0]``; ``mpi_extra``: more mpiexec options)."""
    if launcher == "torchrun":
        return [tb.popen(i, cmd, env=env, stdout=logs[i % len(logs)], stderr=subprocess.STDOUT)
                for i, cmd in enumerate(tb.torchrun_commands(ppn, list(argv)))]
    return [tb.mpiexec(ppn, [sys.executable, *argv], extra=mpi_extra, env=env, stdout=logs[0],
                       stderr=subprocess.STDOUT)]


KINDS = ("net", "mnt", "uts", "ipc")  # the node's own namespaces (the PID namespace is the host's)


def skip_without_namespaces() -> None:
    """Skip the calling test, saying why, where this machine cannot make the testbed."""
    why = unavailable()
    if why:
        pytest.skip(f"multi-node testbed unavailable: {why}")


def namespace_inodes(tb: Testbed) -> set[tuple[str, int]]:
    """The (kind, inode) of every node's network, mount, UTS and IPC namespace (read from its holder)."""
    out = set()
    for n in tb.nodes:
        for kind in KINDS:
            out.add((kind, os.stat(f"/proc/{n.pid}/ns/{kind}").st_ino))
    return out


def processes_in(inodes: set[tuple[str, int]]) -> list[int]:
    """Pids of every process of this machine that is in one of these namespaces."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for kind in KINDS:
            try:
                if (kind, os.stat(f"/proc/{pid}/ns/{kind}").st_ino) in inodes:
                    found.append(int(pid))
                    break
            except OSError:  # gone meanwhile, or a kernel thread
                break
    return found


def leftovers(tag: str, inodes: set[tuple[str, int]]) -> list[str]:
    """What testbed ``tag`` left behind: names with its tag, its state directory, processes in its namespaces."""
    left = [f"netns {n}" for n in netns_names() if n.startswith(tag)]
    left += [f"link {n}" for n in link_names() if n.startswith(tag)]
    if (STATE_ROOT / tag).exists():
        left.append(f"state directory {STATE_ROOT / tag}")
    left += [f"process {pid} ({_describe(pid)}) in a node's namespaces" for pid in processes_in(inodes)]
    return left


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[:2]
        return f"{cmd or '?'}, state {state[0]}, parent {state[1]}"
    except (OSError, IndexError):
        return "gone"


@pytest.fixture
def make_testbed() -> Iterator[Callable[..., Testbed]]:
    """``make_testbed(nodes, **kwargs)``: an up :class:`Testbed` (kwargs as for Testbed), torn down after the
    test, which then fails if anything of it is left."""
    skip_without_namespaces()
    made: list[tuple[Testbed, set]] = []

    def make(nodes: int, **kwargs: Any) -> Testbed:
        tb = Testbed(nodes, **kwargs).up()
        made.append((tb, namespace_inodes(tb)))
        return tb

    yield make
    for tb, _ in made:
        tb.down()
    for tb, inodes in made:
        left = leftovers(tb.tag, inodes)
        assert not left, f"testbed {tb.tag} left {left}"
