"""collectives/_all_to_all.py uses its communicator through the ``AllToAllHost`` protocol only.

The protocol names every member the all-to-all code reads or calls; the Communicator must provide
each (a rename on either side fails here, not at a user's first all_to_all), and the module must
not import communicator.py (tests/test_import_graph.py checks the circles; this, the direction).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import collectives._all_to_all as a2a

import spmd


def _members(proto: type) -> list[str]:
    """The attributes and methods a Protocol class declares (not its typing machinery)."""
    return sorted({*proto.__annotations__,
                   *(n for n, v in vars(proto).items()
                     if (callable(v) or isinstance(v, property)) and not n.startswith("__"))})


def test_all_to_all_does_not_import_the_communicator():
    tree = ast.parse(Path(a2a.__file__).read_text())
    named = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    named += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    assert not [m for m in named if "communicator" in m], named


def test_protocol_names_the_members_used():
    """Every ``comm.<member>`` the module reads is declared by AllToAllHost."""
    source = Path(a2a.__file__).read_text()
    used = {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "comm"}
    assert used and used <= set(_members(a2a.AllToAllHost)), used - set(_members(a2a.AllToAllHost))


def _body(comm):
    missing = [m for m in _members(a2a.AllToAllHost) if not hasattr(comm, m)]
    x = torch.arange(comm.size * 3 * 2, dtype=torch.float32).view(-1, 2) + 100 * comm.rank
    first = comm.all_to_all(x)  # the checked path makes the entry
    ent = comm._a2a_entry(x, x.shape[1:], 0)
    entry_missing = [m for m in _members(a2a.CallEntry) if not hasattr(ent, m)] if ent is not None else ["<none>"]
    second = comm.all_to_all(x)  # the latency path: a plan of that entry
    plan = comm._a2a_plans.get((x.shape, x.dtype, 0))
    in_place = x.clone()
    comm.all_to_all(in_place, out=in_place)
    view = comm.using("auto")
    fresh_view = view._a2a_entry(x, x.shape[1:], 0) is None and not view._a2a_plans and view._inplace_scratch is None
    comm._forget_calls()
    forgotten = comm._a2a_entry(x, x.shape[1:], 0) is None and not comm._a2a_plans and comm._inplace_scratch is None
    return (missing, entry_missing, plan is not None and plan.ent is ent, torch.equal(first, second),
            torch.equal(in_place, first), fresh_view, forgotten)


def test_communicator_provides_the_protocol():
    for rank, res in enumerate(spmd.run(_body, 2)):
        missing, entry_missing, plan_of_entry, same, in_place_same, fresh_view, forgotten = res
        assert missing == [] and entry_missing == [], (rank, missing, entry_missing)
        assert plan_of_entry and same and in_place_same, rank
        assert fresh_view and forgotten, rank
