"""One rank of the node-aware MoE dispatch check (tests/test_moe_internode.py), across the testbed's nodes.

``compare_paths(comm)`` runs, with the same seed and tokens, the flat ExpertDispatcher
(``node_aware=False``) and the one that chose the node-aware path by itself, and checks on every
rank: each local expert receives the same (source token, row) set (compared sorted by source token
id); combine's output and the x / weight gradients agree within float rounding (the sums run in
another order); the traffic counters equal the counts computed here from the global routing; a
MoELayer over each path gives the same output, aux loss and gradients. The test also imports it
with a fake topology (several "nodes" on one host, see ``FakeNodes``), and ``one_rank_bad``: a bad
argument on one rank makes every rank raise.

    python moe_internode_job.py --out DIR     # under mpiexec or torchrun, on the testbed
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repository: moe, collectives
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: spmd

import collectives  # noqa: E402
from moe import ExpertDispatcher, MoELayer  # noqa: E402
from spmd import node_job_args, write_rank_report  # noqa: E402

SEED = 2615
E, K, H = 12, 4, 6         # 3 experts per rank on 4 ranks (4 on 3): a node of 2 ranks holds 6, so tokens pick several


class FakeNodes:
    """A communicator that reports ``nodes`` as its topology's nodes and forwards everything else."""

    def __init__(self, comm: Any, nodes: tuple[tuple[int, ...], ...]):
        self._comm, self.topology = comm, SimpleNamespace(nodes=nodes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def _batch(case: int, P: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rank token counts (one rank empty) and the global x [T, H] float64 (column 0: the token's id),
    experts [T, K] (some -1 in odd cases) and weights [T, K]."""
    g = torch.Generator().manual_seed(SEED + case)
    counts = [5 + 3 * r + case for r in range(P)]
    counts[case % P] = 0
    T = sum(counts)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    x[:, 0] = torch.arange(T, dtype=torch.float64)
    experts = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    if case % 2:
        experts = torch.where(torch.rand(T, K, generator=g) < 0.25, torch.full_like(experts, -1), experts)
    weights = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    return counts, x, experts, weights


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol), \
        f"{what}: max difference {(a - b).abs().max() if a.shape == b.shape else (a.shape, b.shape)}"


def _expected_traffic(comm: Any, nodes: tuple[tuple[int, ...], ...], experts: torch.Tensor, keep: torch.Tensor,
                      counts: list[int]) -> tuple[int, int, int]:
    """(node-aware inter-node rows, node-aware intra-node rows, flat inter-node rows) this rank sends,
    counted in plain Python from the global routing (``keep``: the kept slots)."""
    P, L = comm.size, E // comm.size
    node_of = {r: g for g, ranks in enumerate(nodes) for r in ranks}
    local_of = {r: i for ranks in nodes for i, r in enumerate(ranks)}
    me = comm.rank
    starts = [sum(counts[:r]) for r in range(P)]
    owners = [{int(e) // L for e, kp in zip(experts[t].tolist(), keep[t].tolist()) if kp and e >= 0}
              for t in range(experts.shape[0])]
    mine = range(starts[me], starts[me] + counts[me])
    inter = sum(len({node_of[o] for o in owners[t]} - {node_of[me]}) for t in mine)
    flat_inter = sum(len({o for o in owners[t] if node_of[o] != node_of[me]}) for t in mine)
    # forwarded by me: tokens of the rank with my local index on each node that hit my node
    intra = 0
    for src in (ranks[local_of[me]] for ranks in nodes):
        for t in range(starts[src], starts[src] + counts[src]):
            here = {o for o in owners[t] if node_of[o] == node_of[me]}
            intra += len(here - {me})
    return inter, intra, flat_inter


def _by_source(recv: torch.Tensor, tpe: torch.Tensor) -> list[torch.Tensor]:
    """recv's rows per local expert, sorted by the source token id in column 0."""
    out = []
    for chunk in torch.split(recv, tpe.tolist()):
        out.append(chunk[torch.argsort(chunk[:, 0])])
    return out


def compare_paths(comm: Any, nodes: tuple[tuple[int, ...], ...] | None = None) -> dict:
    """The checks of the module docstring on this rank; ``nodes``: a fake topology (None: the real one).

    Returns:
        {"checks": how many results were compared, "traffic": [[node-aware inter, intra, flat inter] bytes per case]}.
    """
    c = comm if nodes is None else FakeNodes(comm, nodes)
    nodes = c.topology.nodes
    flat = ExpertDispatcher(c, E, node_aware=False)
    aware = ExpertDispatcher(c, E)
    assert aware.node_aware and not flat.node_aware, (aware, flat)
    capped = ExpertDispatcher(c, E, capacity_factor=0.6)
    capped_flat = ExpertDispatcher(c, E, capacity_factor=0.6, node_aware=False)
    r, checks, traffic = comm.rank, 0, []
    try:
        for case, (na, fl, pass_w) in enumerate([(aware, flat, True), (aware, flat, False), (capped, capped_flat, True),
                                                 (aware, flat, True)]):
            counts, X, experts, W = _batch(case, comm.size)
            sl = slice(sum(counts[:r]), sum(counts[:r + 1]))
            e = experts[sl]
            got = {}
            for name, d in (("flat", fl), ("aware", na)):
                x = X[sl].clone().requires_grad_()
                w = W[sl].clone().requires_grad_()
                lay = d.get_dispatch_layout(x, e, weights=w.detach() if pass_w else None)
                recv, tpe, handle = d.dispatch(x, e, layout=lay)
                out = torch.sin(recv) * (1.5 + recv[:, :1].detach() % 3)  # row-wise, so the row order is free
                y = d.combine(out, handle, w)
                G = torch.cos(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape) + sl.start
                (y * G).sum().backward()
                got[name] = (_by_source(recv.detach(), tpe), tpe, y.detach(), x.grad, w.grad, lay)
            f, a = got["flat"], got["aware"]
            assert torch.equal(f[1], a[1]), (f[1], a[1])
            for j, (rf, ra) in enumerate(zip(f[0], a[0])):
                assert torch.equal(rf, ra), f"case {case}: local expert {j} got other rows"
            _close(a[2], f[2], f"case {case} combine")
            _close(a[3], f[3], f"case {case} grad x")
            _close(a[4], f[4], f"case {case} grad weights")
            assert torch.equal(a[5].dropped, f[5].dropped)
            if case == 2:
                assert int(comm.all_reduce(f[5].dropped.sum().reshape(1))[0]) > 0, "the capacity case drops nothing"
            row = H * X.element_size()
            dropped_all = _gather_dropped(comm, f[5].dropped, counts)
            inter, intra, flat_inter = _expected_traffic(comm, nodes, experts, (experts >= 0) & ~dropped_all, counts)
            ta, tf = a[5].traffic, f[5].traffic
            assert (ta.internode_bytes, ta.intranode_bytes, ta.flat_internode_bytes) == \
                (inter * row, intra * row, flat_inter * row), (case, ta, inter, intra, flat_inter)
            assert tf.internode_bytes == tf.flat_internode_bytes == flat_inter * row, (case, tf)
            assert ta.internode_bytes <= tf.internode_bytes
            traffic.append([ta.internode_bytes, ta.intranode_bytes, tf.internode_bytes])
            checks += 8
        checks += _compare_layers(c)
    finally:
        for d in (flat, aware, capped, capped_flat):
            d.close()
    return {"checks": checks, "traffic": traffic}


def one_rank_bad(comm: Any, nodes: tuple[tuple[int, ...], ...] | None = None) -> dict[str, tuple[str, str]]:
    """The last rank passes a bad argument to dispatch (with a layout) and to combine: every rank must raise
    ValueError (a hang would raise the communicator's timeout instead). Returns case -> (type, message)."""
    from spmd import outcome

    c = comm if nodes is None else FakeNodes(comm, nodes)
    d = ExpertDispatcher(c, E)
    bad = comm.rank == comm.size - 1
    try:
        counts, X, experts, W = _batch(0, comm.size)
        sl = slice(sum(counts[:comm.rank]), sum(counts[:comm.rank + 1]))
        x, e, w = X[sl], experts[sl], W[sl]
        lay = d.get_dispatch_layout(x, e, weights=w)
        out = {"dispatch": outcome(lambda: d.dispatch(x.float() if bad else x, e, layout=lay))}
        d2 = ExpertDispatcher(c, E)
        try:
            recv, _, handle = d2.dispatch(x, e, weights=w)
            out["combine"] = outcome(lambda: d2.combine(recv, handle, w[:, :2] if bad else w))
        finally:
            d2.close()
        return out
    finally:
        d.close()


def _gather_dropped(comm: Any, dropped: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's dropped mask [T_r, K], concatenated in rank order: [T, K] bool."""
    width = max(counts) * K
    pad = torch.zeros(width, dtype=torch.uint8)
    pad[: dropped.numel()] = dropped.reshape(-1).to(torch.uint8)
    g = comm.all_gather(pad.reshape(1, -1)) if comm.size > 1 else pad.reshape(1, -1)
    return torch.cat([g[s, : counts[s] * K].reshape(counts[s], K) for s in range(comm.size)]).bool()


def _compare_layers(c: Any) -> int:
    """MoELayer over the flat and node-aware paths: same output, aux loss, x and parameter gradients."""
    r = c.rank
    g = torch.Generator().manual_seed(SEED + 99)
    x_all = torch.randn(c.size, 5 + r % 2, 16, generator=g)[:, :5]     # [P, 5, 16] float32
    res = {}
    for name, node_aware in (("flat", False), ("aware", None)):
        layer = MoELayer(c, 16, 12, E, K, seed=7, capacity_factor=1.0, aux_loss_coef=0.01, node_aware=node_aware)
        try:
            assert layer.dispatcher.node_aware == (node_aware is None)
            x = x_all[r].clone().requires_grad_()
            y, aux = layer(x)
            (y.square().sum() + aux).backward()
            res[name] = (y.detach(), aux.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()})
        finally:
            layer.close()
    f, a = res["flat"], res["aware"]
    _close(a[0], f[0], "MoELayer forward", 1e-5)
    _close(a[1], f[1], "MoELayer aux loss", 1e-6)
    _close(a[2], f[2], "MoELayer grad x", 1e-5)
    for n in f[3]:
        _close(a[3][n], f[3][n], f"MoELayer grad {n}", 1e-5)
    return 3 + len(f[3])


def main() -> None:
    a = node_job_args(layout=False)
    torch.set_num_threads(1)
    comm = collectives.init(timeout=60.0)
    report = {"rank": comm.rank, "size": comm.size, "hostname": socket.gethostname(),
              "nodes": [list(n) for n in comm.topology.nodes]}
    write_rank_report(Path(a.out) / f"{comm.rank}.json", report, lambda rep: rep.update(compare_paths(comm)))
    comm.close()


if __name__ == "__main__":
    main()
