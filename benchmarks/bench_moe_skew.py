"""``moecomm bench-moe --skew S``: skewed routing with and without redundant experts (EPLB), in one run.

Routing: each of a rank's T tokens picks k distinct experts of E, expert ``i`` with probability
proportional to ``1 / (i + 1) ** S`` (Zipf, exponent S; S = 0 is uniform), from a seeded generator.
Experts: a GEMM pair per local expert slot (``[H, F]`` then ``[F, H]``, F = 2H, float32 on CPU), so a rank's
expert time grows with the tokens it receives, as in a real layer.

Two variants over the same tokens and routing, interleaved step by step:

* ``no-eplb``: expert ``i`` on rank ``i // (E / P)`` (the layer's default);
* ``eplb``: ``moe.eplb.balance`` of the routing's per-expert loads (summed over ranks) with R redundant
  slots; token choices go to their expert's replicas round-robin (``moe.eplb.route``).

Per variant: the most loaded rank's received (token, expert) pairs over the mean, and the time per step of
dispatch, experts and combine (each after a barrier, so a phase's time is its slowest rank's), mean over
the timed steps, step = their sum. R defaults to E/4 rounded down to a multiple of P (at least P).
"""

from __future__ import annotations

import time
from typing import Any

import click
import torch

from .table import Column, Table

VARIANTS = ("no-eplb", "eplb")
TABLE = Table([Column("variant", 8, align="<", gap=2), Column("max/mean", 9, ".3f"), Column("dispatch", 10, ".2f", "(ms)"),
               Column("experts", 10, ".2f", "(ms)"), Column("combine", 10, ".2f", "(ms)"),
               Column("step", 10, ".2f", "(ms)"), Column("check", 6)])


def zipf_routing(tokens: int, experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    """[tokens, top_k] int64 distinct expert ids per token, expert i drawn with weight 1 / (i + 1) ** skew."""
    weights = (torch.arange(experts, dtype=torch.float64) + 1) ** -skew
    gen = torch.Generator().manual_seed(seed)
    if tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int64)
    return torch.multinomial(weights.expand(tokens, experts), top_k, replacement=False, generator=gen)


def default_redundant(experts: int, ranks: int) -> int:
    """R when not given: a quarter of E, rounded down to a multiple of the ranks (at least one slot each)."""
    return max(ranks, experts // 4 // ranks * ranks)


def skew_rank(comm, o: dict[str, Any]) -> dict[str, Any]:
    """Body of ``bench-moe --skew`` on one rank (collective). Returns per variant the pair counts per rank and
    the mean phase times, the same on every rank."""
    from moe import ExpertDispatcher
    from moe.eplb import Placement, balance, logical_loads, route

    torch.set_num_threads(1)
    P, T, H, k, E = comm.size, o["tokens"], o["hidden"], o["top_k"], o["experts"]
    R = o["redundant"] if o["redundant"] is not None else default_redundant(E, P)
    F = 2 * H
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    x = torch.randn(T, H, generator=gen)
    logical = zipf_routing(T, E, k, o["skew"], seed=7 + comm.rank)
    weights = torch.rand(T, k, generator=gen)
    weights /= weights.sum(-1, keepdim=True)
    loads = comm.all_reduce(logical_loads(logical, E).to(torch.float64))  # what a Balancer would have seen
    placements = {"no-eplb": Placement.default(E, P, 0), "eplb": balance(loads, P, R)}
    setups = {}
    for name, placement in placements.items():
        slots = placement.num_physical
        disp = ExpertDispatcher(comm, slots)
        L = disp.num_local_experts
        w1 = torch.randn(L, H, F, generator=torch.Generator().manual_seed(1)) / H ** 0.5
        w2 = torch.randn(L, F, H, generator=torch.Generator().manual_seed(2)) / F ** 0.5
        experts_phys = route(logical, placement) if slots != E else logical
        setups[name] = (disp, w1, w2, experts_phys, placement)
    # the experts' weights only set the compute time; the check runs identity experts through the same
    # dispatch and combine: both variants must return x * sum(weights)
    times = {name: {"dispatch": 0.0, "experts": 0.0, "combine": 0.0} for name in VARIANTS}
    ok = {name: True for name in VARIANTS}
    pairs = {}
    for it in range(o["warmup"] + o["iters"]):
        for name in VARIANTS:
            disp, w1, w2, experts_phys, _ = setups[name]
            comm.barrier()
            t0 = time.perf_counter()
            recv_x, tokens_per_expert, handle = disp.dispatch(x, experts_phys)
            comm.barrier()
            t1 = time.perf_counter()
            chunks = torch.split(recv_x, tokens_per_expert.tolist())
            out = torch.cat([torch.relu(c @ w1[i]) @ w2[i] for i, c in enumerate(chunks)]) if chunks else recv_x
            comm.barrier()
            t2 = time.perf_counter()
            y = disp.combine(out, handle, weights)
            comm.barrier()
            t3 = time.perf_counter()
            if it == 0:  # identity experts through the same path: the routing itself is checked
                back = disp.combine(recv_x, handle, weights)
                ok[name] = bool(torch.allclose(back, x * weights.sum(-1, keepdim=True), atol=1e-5))
                pairs[name] = int(tokens_per_expert.sum())
            if it >= o["warmup"]:
                for phase, dt in (("dispatch", t1 - t0), ("experts", t2 - t1), ("combine", t3 - t2)):
                    times[name][phase] += dt
            del y
    out_doc: dict[str, Any] = {"redundant": R}
    for name in VARIANTS:
        counts = comm.all_gather(torch.tensor([pairs[name]], dtype=torch.int64)).tolist()
        good = bool(comm.all_reduce(torch.tensor([int(ok[name])]), op="min")[0])
        phase = {p: float(comm.all_reduce(torch.tensor([t / o["iters"]], dtype=torch.float64), op="max")[0])
                 for p, t in times[name].items()}
        out_doc[name] = {"pairs_per_rank": counts, "ok": good, **{f"{p}_s": v for p, v in phase.items()},
                         "placement": placements[name].physical_to_logical.tolist()}
        setups[name][0].close()
    return out_doc


def skew_report(res: dict[str, Any], o: dict[str, Any]) -> list[dict[str, Any]]:
    """Print the table and the speedup; return one row per variant."""
    click.echo(f"# moecomm bench-moe --skew {o['skew']}: {o['ranks']} ranks, {o['tokens']} tokens per rank, hidden "
               f"{o['hidden']}, top-{o['top_k']} of {o['experts']} experts (Zipf {o['skew']}); eplb: "
               f"{o['redundant']} redundant slots placed by moe.eplb.balance of the routing's loads; experts: "
               f"[H, 2H] and [2H, H] GEMMs per local slot; {o['warmup']} + {o['iters']} steps, phases after a barrier")
    for line in TABLE.header():
        click.echo(line)
    rows = []
    for name in VARIANTS:
        r = res[name]
        counts = r["pairs_per_rank"]
        mean = sum(counts) / len(counts)
        step = r["dispatch_s"] + r["experts_s"] + r["combine_s"]
        row = {"variant": name, "max_over_mean": max(counts) / mean if mean else 1.0, "pairs_per_rank": counts,
               "dispatch_ms": r["dispatch_s"] * 1e3, "experts_ms": r["experts_s"] * 1e3,
               "combine_ms": r["combine_s"] * 1e3, "step_ms": step * 1e3, "ok": r["ok"], "placement": r["placement"]}
        rows.append(row)
        click.echo(TABLE.line(name, row["max_over_mean"], row["dispatch_ms"], row["experts_ms"], row["combine_ms"],
                              row["step_ms"], "ok" if r["ok"] else "WRONG"))
    base, bal = rows
    click.echo(f"# eplb: step {base['step_ms'] / bal['step_ms']:.2f}x faster than no-eplb; most loaded rank "
               f"{base['max_over_mean']:.2f}x -> {bal['max_over_mean']:.2f}x the mean")
    return rows
