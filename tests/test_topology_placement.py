"""The rank/node topology (collectives.topology.placement): oversubscription, the one definition the
transports get as GroupInfo.oversubscribed, built from the facts ranks exchange; cpulists; sub-communicators."""

from __future__ import annotations

import itertools
import json
import os
import random

from collectives.topology import Topology, cpulist_count, format_cpulist, local_facts, parse_cpulist
from collectives.topology.placement import _each_gets_a_cpu


def _facts(ranks: list[tuple[str, str]]) -> list[bytes]:
    """local_facts() as ranks on node ``node`` with affinity ``cpulist`` would send them."""
    return [json.dumps({"host": node, "node": f"{node}/boot", "pid": 1000 + r, "cpus": cpulist_count(cpulist),
                        "cpulist": cpulist}).encode() for r, (node, cpulist) in enumerate(ranks)]


# (case, (node, cpulist) per rank, expected oversubscribed per rank)
CASES = [
    ("2 ranks share 2 CPUs", [("a", "0-1")] * 2, [False] * 2),
    ("3 ranks share 2 CPUs", [("a", "0-1")] * 3, [True] * 3),
    ("4 ranks pinned to 4 distinct cores", [("a", "0"), ("a", "1"), ("a", "2"), ("a", "3")], [False] * 4),
    ("2 ranks pinned to one core, a third with 7 cores", [("a", "5"), ("a", "5"), ("a", "0-4,6-7")], [True] * 3),
    ("overlapping pins that still fit", [("a", "2-3"), ("a", "2"), ("a", "3-4")], [False] * 3),
    ("only the crowded node", [("a", "0-1")] * 3 + [("b", "0-1")], [True] * 3 + [False]),
    ("one rank", [("a", "7")], [False]),
]


def test_oversubscribed_from_facts():
    failures = []
    for case, ranks, want in CASES:
        facts = _facts(ranks)
        got = [Topology.from_facts(r, facts, "test").oversubscribed for r in range(len(ranks))]
        if got != want:
            failures.append(f"{case}: got {got}, want {want}")
    assert not failures, "\n".join(failures)


def test_sub_communicator_counts_the_whole_node():
    """Ranks outside a sub-communicator still run on the node: 4 ranks on 2 CPUs stay oversubscribed
    in a sub-communicator of 2 of them."""
    facts = _facts([("a", "0-1")] * 4)
    world = Topology.from_facts(2, facts, "test")
    sub = world.subset([3, 2], 1)
    subsub = sub.subset([1], 0)
    assert (sub.size, sub.local_size, sub.pids, sub.cpu_lists) == (2, 2, (1003, 1002), ("0-1", "0-1"))
    assert sub.job is world and subsub.job is world and subsub.pids == (1002,)
    assert world.oversubscribed and sub.oversubscribed and subsub.oversubscribed
    fits = Topology.from_facts(0, _facts([("a", "0-3")] * 4), "test").subset([0, 1], 0)
    assert not fits.oversubscribed


def test_oversubscribed_without_cpu_lists_uses_counts():
    """A Topology built without affinities assumes each rank may use CPUs 0..cpus-1."""
    hosts, nodes, pids = ("h",) * 3, ("n",) * 3, (1, 2, 3)
    assert Topology(0, 3, hosts, nodes, pids, (2, 2, 2), "test").oversubscribed
    assert not Topology(0, 3, hosts, nodes, pids, (3, 3, 3), "test").oversubscribed


def test_local_facts_carry_this_process_affinity():
    topo = Topology.from_facts(0, [local_facts()], "test")
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    assert topo.cpu_set(0) == cpus and topo.cpus_per_rank == (len(cpus),)
    assert not topo.oversubscribed  # one rank always has a CPU


def test_each_gets_a_cpu_matches_brute_force():
    """The matching agrees with trying every assignment of distinct CPUs, on random small affinities."""
    rng = random.Random(20240611)
    failures = []
    for _ in range(400):
        ranks, ncpu = rng.randint(1, 5), rng.randint(1, 5)
        sets = [frozenset(c for c in range(ncpu) if rng.random() < 0.45) or frozenset({rng.randrange(ncpu)})
                for _ in range(ranks)]
        brute = any(len(set(pick)) == ranks for pick in itertools.product(*[sorted(s) for s in sets]))
        if _each_gets_a_cpu(sets) != brute:
            failures.append(f"{[sorted(s) for s in sets]}: matching says {not brute}, brute force {brute}")
    assert not failures, "\n".join(failures[:10])


def test_cpulist_round_trip():
    rng = random.Random(7)
    for _ in range(200):
        cpus = {c for c in range(rng.randint(1, 300)) if rng.random() < 0.6}
        text = format_cpulist(cpus)
        assert parse_cpulist(text) == cpus and cpulist_count(text) == len(cpus), text
    assert format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and format_cpulist([]) == "" == format_cpulist(set())
    assert parse_cpulist("0-55,112-167\n") == set(range(56)) | set(range(112, 168))
