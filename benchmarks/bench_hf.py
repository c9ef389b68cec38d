"""``moecomm bench-hf``: step time of a transformers MoE model made expert-parallel, moecomm against
transformers' own all-to-all (issue 40's speed point).

One small Qwen3-MoE (random weights, saved once to a temporary folder; every variant loads that
checkpoint) and one set of token ids (``--tokens`` per rank, as ``--batch`` sequences), measured in
one invocation for each rank count P of ``--nprocs``, every variant on P CPU ranks
(``collectives.launch``) unless said:

- ``moecomm-gloo``: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=P,
  ep_size=P, ep_implementation="moecomm"))`` (moe.hf.MoecommEP), torch.distributed over gloo. The
  experts' exchange goes over a moecomm communicator on the group's ranks, FSDP's all-gathers and
  reduce-scatters over gloo.
- ``a2a-gloo``: the same with transformers' ``ep_implementation="all_to_all"`` (AllToAllEP), every
  collective over gloo. The baseline: "x faster" = t(a2a-gloo) / t(variant).
- ``a2a-moecomm``: ``"all_to_all"`` over the moecomm torch.distributed backend
  (``init_process_group("moecomm")``), FSDP's collectives too.
- ``moecomm-moecomm`` (not run by default): ``"moecomm"`` over the moecomm backend.
- ``expert-parallel``: ``moe.hf.expert_parallel(model, comm)`` on the model loaded whole, no FSDP:
  the rest of the model is replicated and no gradient is reduced (the in-memory entry point).
- ``unsharded``: the model in one process on all P ranks' tokens at once (P x ``--tokens``).

The unsharded runs go first, in one process that also builds and saves the model; then, per P,
one launch of P ranks runs the other variants one after another (transformers is imported once per
rank), each with its own process group, initialised from a new ``file://`` in the temporary folder
and destroyed after it. Each rank runs ``--warmup`` untimed steps, then ``--iters`` timed ones; a step
is ``model(input_ids, labels=input_ids)`` (fwd: until the loss is there, autograd recording) then
``loss.backward()`` (fwd+bwd: the whole step), started together on every rank (a barrier before
each). Times: each rank's median over the timed steps, then the slowest rank. Each EP step does the
global batch (every rank its share, at the same time, on the same CPUs as ``unsharded``), so the
times compare as they are; tok/s = global tokens / fwd+bwd time.

Before timing, every variant's logits (one forward, no autograd) are compared with the unsharded
model's on the same tokens: max |logits - reference| / max |reference| over the rank's tokens, the
largest over ranks. Above 1e-4 (float32) the command exits 1.

A second section, "EP exchange per MoE layer" (``--no-exchange`` skips it, ``--exchange-only`` runs
only it), times what an EP implementation controls, without the rest of the model: per P, in the
same launch as the variants (after them), moe.hf.MoecommEP and transformers' AllToAllEP built
directly on ``init_device_mesh("cpu", (P, 1), mesh_dim_names=("ep", "tp"))`` over gloo, on one
Qwen3MoeExperts of this rank's E/P experts (the model's hidden and expert sizes, random weights),
called as transformers calls them: ``y = impl(x, top_k_index, top_k_weights)`` (fwd) then
``y.backward(dy)`` (bwd), with random ``x`` [tokens, hidden] and ``dy`` per rank and top-k of a
softmax over random router logits. Twice: "exchange", the experts' forward replaced by
``x * w`` (the exchange alone), and "with experts", the module's own forward
(``--experts-implementation``). Times as above (each rank's median, the slowest rank; fwd+bwd is
its own median); x faster = fwd+bwd t(all_to_all) / t. Before timing, both implementations run once
on the same inputs: their outputs and the gradients of x, of the routing weights and of the
experts' weights must agree within 1e-5 (max |moecomm - all_to_all| / max |all_to_all|, the
largest over ranks), else the command exits 1.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch

from .options import COUNT, NONNEGATIVE, SECONDS, comma_list, positive_ints
from .ranks import launch_logged
from .table import Column, Table

# name -> (ep_implementation, torch.distributed backend, what it is); None: no DistributedConfig
VARIANTS: dict[str, tuple[str | None, str | None, str]] = {
    "moecomm-gloo": ("moecomm", "gloo", 'ep_implementation="moecomm", DistributedConfig(fsdp=P, ep=P), gloo'),
    "a2a-gloo": ("all_to_all", "gloo", 'ep_implementation="all_to_all", DistributedConfig(fsdp=P, ep=P), gloo'),
    "a2a-moecomm": ("all_to_all", "moecomm",
                    'ep_implementation="all_to_all", DistributedConfig(fsdp=P, ep=P), moecomm backend'),
    "moecomm-moecomm": ("moecomm", "moecomm",
                        'ep_implementation="moecomm", DistributedConfig(fsdp=P, ep=P), moecomm backend'),
    "expert-parallel": (None, None, "moe.hf.expert_parallel(model, comm), no FSDP (replicated rest, no grad reduce)"),
    "unsharded": (None, None, "the model in one process, P x tokens (the same global batch)"),
}
DEFAULT_VARIANTS = ("moecomm-gloo", "a2a-gloo", "a2a-moecomm", "expert-parallel", "unsharded")
BASELINE = "a2a-gloo"
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
TOLERANCE = 1e-4  # max relative logits error, float32
EXCHANGE_TOLERANCE = 1e-5  # max relative difference, moecomm vs all_to_all (outputs and gradients), float32
EXCHANGE_IMPLS = ("moecomm", "all_to_all")  # the exchange section's rows; the last one is its baseline
EXCHANGE_MODES = ("exchange", "with_experts")  # experts forward x * w, the experts' own forward
# --quick: a tiny configuration (the test's)
QUICK = {"layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "tokens": 32, "batch": 1, "vocab": 128, "iters": 2,
         "warmup": 1}

TABLE = Table([Column("P", 3), Column("variant", 15, align="<"), Column("fwd", 9, ".2f", unit="ms"),
               Column("fwd+bwd", 9, ".2f", unit="ms"), Column("fwd_x", 6, ".2f", unit="faster"),
               Column("f+b_x", 6, ".2f", unit="faster"), Column("tok/s", 8, ".0f", unit="f+b"),
               Column("thr", 3, unit="/rank"), Column("max_rel_err", 11, ".2e"), Column("check", 5)])


def _exchange_columns() -> list[Column]:
    return [Column("fwd", 8, ".2f", unit="ms", gap=2), Column("bwd", 8, ".2f", unit="ms"),
            Column("fwd+bwd", 8, ".2f", unit="ms"), Column("x", 6, ".2f", unit="faster")]


EXCHANGE_TABLE = Table([Column("P", 3), Column("impl", 10, align="<"), *_exchange_columns(), *_exchange_columns(),
                        Column("thr", 3, unit="/rank", gap=2), Column("max_rel_err", 11, ".2e"), Column("check", 5)],
                       groups=[("exchange", 2, 5), ("with experts", 6, 9)])


def _dims(o: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3MoeConfig arguments of ``o``: every layer MoE, heads of min(64, hidden/2)."""
    H = o["hidden"]
    head_dim = min(64, max(H // 2, 1))
    heads = max(H // head_dim, 1)
    return {"vocab_size": o["vocab"], "hidden_size": H, "intermediate_size": 4 * H,
            "moe_intermediate_size": max(H // 2, 1), "num_experts": o["experts"], "num_experts_per_tok": o["top_k"],
            "num_hidden_layers": o["layers"], "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1),
            "head_dim": head_dim, "max_position_embeddings": max(o["tokens"] // o["batch"], 64),
            "norm_topk_prob": True, "tie_word_embeddings": False}


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load(o: dict[str, Any], path: str, distributed_config: Any = None):
    from transformers import AutoModelForCausalLM

    kw = {} if distributed_config is None else {"distributed_config": distributed_config}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                experts_implementation=o["experts_implementation"], **kw)


def _steps(comm, model, ids: torch.Tensor, o: dict[str, Any]) -> dict[str, Any]:
    """The model's logits on ``ids`` (no autograd), then ``o["warmup"]`` + ``o["iters"]`` training steps
    (collective: a barrier before each). Returns the logits and the timed steps' seconds."""
    model.train()  # no dropout in Qwen3-MoE: the same math as eval
    with torch.no_grad():
        logits = model(input_ids=ids).logits.detach().float().clone()
    fwd, step = [], []
    for it in range(o["warmup"] + o["iters"]):
        model.zero_grad(set_to_none=True)
        comm.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if it >= o["warmup"]:
            fwd.append(t1 - t0)
            step.append(t2 - t0)
    comm.barrier()
    return {"logits": logits, "fwd": fwd, "step": step, "threads": torch.get_num_threads()}


def _unsharded_rank(comm, o: dict[str, Any], path: str, inputs: dict[int, torch.Tensor]) -> dict[str, Any]:
    """One process: build the random model (seeded), save it to ``path``, load it back and run the
    unsharded variant on every P's global batch ``inputs[P]`` (its logits are the reference)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _quiet_transformers()
    torch.manual_seed(o["seed"])
    built = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_dims(o))).to(torch.float32)
    built.save_pretrained(path)
    params = sum(p.numel() for p in built.parameters())
    del built
    model = _load(o, path)
    out = {"params": params, "runs": {}}
    for P, ids in inputs.items():
        try:
            out["runs"][P] = dict(_steps(comm, model, ids, o), local_experts=o["experts"])
        except Exception as e:  # noqa: BLE001 - reported as the variant's row
            out["runs"][P] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _ep_rank(comm, o: dict[str, Any], variants: list[str], path: str, ids_all: torch.Tensor,
             tmp: str, exchange: bool = False) -> dict[str, Any]:
    """Every expert-parallel variant in turn on this rank (collective over ``comm``), each with its own
    process group (a new ``file://`` init) where it needs one; then, with ``exchange``, the exchange
    section (:func:`_exchange_rank`).

    Returns:
        ``{"variants": {variant: {"logits": [B, S, V] float32, "fwd": [s per step], "step": [s per step],
        "threads": n, "local_experts": experts per module on this rank}} (or ``{variant: {"error": text}}``),
        "exchange": _exchange_rank's result, or None}``.
    """
    from datetime import timedelta

    import torch.distributed as dist

    import collectives  # noqa: F401 - registers the "moecomm" torch.distributed backend
    import moe.hf

    _quiet_transformers()
    B = ids_all.shape[0] // comm.size
    ids = ids_all[comm.rank * B:(comm.rank + 1) * B]
    out: dict[str, dict[str, Any]] = {}
    for variant in variants:
        ep_implementation, backend, _ = VARIANTS[variant]
        model = None
        try:
            if backend is not None:
                from transformers.distributed import DistributedConfig

                dist.init_process_group(backend, init_method=f"file://{tmp}/init-{variant}-{comm.size}",
                                        rank=comm.rank, world_size=comm.size, timeout=timedelta(seconds=o["timeout"]))
                model = _load(o, path, DistributedConfig(fsdp_size=comm.size, ep_size=comm.size,
                                                         ep_implementation=ep_implementation))
            else:
                model = moe.hf.expert_parallel(_load(o, path), comm)
            local = sorted({m.num_experts for _, m in moe.hf.experts_modules(model)})
            out[variant] = dict(_steps(comm, model, ids, o), local_experts=local)
        except Exception as e:  # noqa: BLE001 - reported as the variant's row
            out[variant] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            del model
            if dist.is_initialized():
                dist.destroy_process_group()
    return {"variants": out, "exchange": _exchange_rank(comm, o, tmp) if exchange else None}


class _TimesWeights(torch.nn.Module):
    """The "exchange" rows' experts: ``x * w``, no weights (every EP implementation hands its experts
    unit weights, so the output is the rows that came in)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return x * top_k_weights


def _rel_diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / max |want| (0 for two missing gradients, inf for a shape mismatch or one missing)."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _exchange_rank(comm, o: dict[str, Any], tmp: str) -> dict[str, Any]:
    """The exchange section on this rank (collective over ``comm``): MoecommEP and AllToAllEP on a
    ``(P, 1)`` ("ep", "tp") DeviceMesh over gloo (its own process group), for the experts forward
    ``x * w`` ("exchange") and the experts' own ("with_experts"): once on the same inputs (the check),
    then ``o["warmup"]`` + ``o["iters"]`` timed calls each (a barrier before each).

    Returns:
        ``{"times": {mode: {impl: {"fwd": [s], "bwd": [s], "step": [s]}}}, "diffs": {mode: {quantity:
        max relative difference moecomm vs all_to_all}}, "threads": n, "local_experts": L}``, or ``{"error": text}``.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.distributed.expert_parallel import AllToAllEP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moe.hf

    P, rank = comm.size, comm.rank
    L, T, H, E, k = o["experts"] // P, o["tokens"], o["hidden"], o["experts"], o["top_k"]
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init-exchange-{P}", rank=rank, world_size=P,
                                timeout=timedelta(seconds=o["timeout"]))
        mesh = init_device_mesh("cpu", (P, 1), mesh_dim_names=("ep", "tp"))
        g = torch.Generator().manual_seed(o["seed"] + 7919 * P + rank)
        config = Qwen3MoeConfig(**dict(_dims(o), num_experts=L))  # this rank's experts only
        config._experts_implementation = o["experts_implementation"]
        experts = Qwen3MoeExperts(config)
        with torch.no_grad():
            for param in experts.parameters():
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
        experts._is_expert_parallel = True  # the forward skips the off-rank sentinel ids
        x = torch.randn(T, H, generator=g).requires_grad_()
        weights, index = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, -1)
        weights.requires_grad_()
        dy = torch.randn(T, H, generator=g)
        classes = {"moecomm": moe.hf.MoecommEP, "all_to_all": AllToAllEP}
        modules = {"exchange": _TimesWeights(L), "with_experts": experts}
        out: dict[str, Any] = {"times": {}, "diffs": {}, "threads": torch.get_num_threads(), "local_experts": L}

        def call(impl: Any, module: torch.nn.Module) -> tuple[torch.Tensor, float, float, float]:
            x.grad = weights.grad = None
            module.zero_grad(set_to_none=True)
            comm.barrier()
            t0 = time.perf_counter()
            y = impl(x, index, weights)
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            return y.detach(), t0, t1, t2

        for mode in EXCHANGE_MODES:
            module = modules[mode]
            impls = {name: classes[name](module, mesh["ep"], mesh["tp"]) for name in EXCHANGE_IMPLS}
            # the check: the same inputs and dy through both
            got = {}
            for name, impl in impls.items():
                y = call(impl, module)[0]
                got[name] = {"out": y, "x_grad": x.grad, "weights_grad": weights.grad,
                             **{f"{n}_grad": p.grad for n, p in module.named_parameters()}}
            ref = got[EXCHANGE_IMPLS[-1]]
            out["diffs"][mode] = {q: max(_rel_diff(got[name][q], ref[q]) for name in EXCHANGE_IMPLS[:-1])
                                  for q in ref}
            out["times"][mode] = {}
            for name, impl in impls.items():
                fwd, bwd, step = [], [], []
                for it in range(o["warmup"] + o["iters"]):
                    _, t0, t1, t2 = call(impl, module)
                    if it >= o["warmup"]:
                        fwd.append(t1 - t0)
                        bwd.append(t2 - t1)
                        step.append(t2 - t0)
                out["times"][mode][name] = {"fwd": fwd, "bwd": bwd, "step": step}
        comm.barrier()
        return out
    except Exception as e:  # noqa: BLE001 - reported as the section's rows
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _summary(variant: str, P: int, per_rank: list[dict[str, Any]], ref: torch.Tensor | None) -> dict[str, Any]:
    """The row of one variant: the slowest rank's median times, the largest logits error."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors or ref is None:
        return {"P": P, "variant": variant, "ranks": len(per_rank), "ok": False,
                "error": errors[0] if errors else "no reference (the unsharded run failed)"}
    B = ref.shape[0] // len(per_rank)
    errs = []
    for r, res in enumerate(per_rank):
        want, got = ref[r * B:(r + 1) * B], res["logits"]
        errs.append(float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    if got.shape == want.shape else float("inf"))
    fwd = [statistics.median(res["fwd"]) for res in per_rank]
    step = [statistics.median(res["step"]) for res in per_rank]
    return {"P": P, "variant": variant, "ranks": len(per_rank), "fwd_s": max(fwd), "step_s": max(step),
            "fwd_s_per_rank": fwd, "step_s_per_rank": step,
            "fwd_s_steps": [res["fwd"] for res in per_rank], "step_s_steps": [res["step"] for res in per_rank],
            "threads": per_rank[0]["threads"], "local_experts": per_rank[0]["local_experts"],
            "max_rel_err": max(errs), "ok": max(errs) <= TOLERANCE}


def _print_rows(rows: list[dict[str, Any]], o: dict[str, Any], P: int) -> None:
    base = next((r for r in rows if r["variant"] == BASELINE and "error" not in r), None)
    for r in rows:
        if "error" in r:
            click.echo(f"   {P:>1} {r['variant']:<15} FAILED: {r['error']}")
            continue
        fx = base["fwd_s"] / r["fwd_s"] if base else "-"
        sx = base["step_s"] / r["step_s"] if base else "-"
        click.echo(TABLE.line(P, r["variant"], r["fwd_s"] * 1e3, r["step_s"] * 1e3, fx, sx,
                              o["tokens"] * P / r["step_s"], r["threads"], r["max_rel_err"],
                              "ok" if r["ok"] else "WRONG"))


def _exchange_summary(P: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The exchange section's rows at P ranks, one per implementation (EXCHANGE_IMPLS' order): per mode
    the slowest rank's median fwd, bwd and fwd+bwd, and x faster (fwd+bwd against the last, the
    baseline); the check (the largest difference over ranks) on every row but the baseline's."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return [{"P": P, "impl": name, "ranks": len(per_rank), "ok": False, "error": errors[0]}
                for name in EXCHANGE_IMPLS]
    rows = []
    for name in EXCHANGE_IMPLS:
        row: dict[str, Any] = {"P": P, "impl": name, "ranks": len(per_rank), "threads": per_rank[0]["threads"],
                               "local_experts": per_rank[0]["local_experts"]}
        for mode in EXCHANGE_MODES:
            times = [res["times"][mode][name] for res in per_rank]
            base = [res["times"][mode][EXCHANGE_IMPLS[-1]] for res in per_rank]
            m: dict[str, Any] = {}
            for key in ("fwd", "bwd", "step"):
                m[f"{key}_s_per_rank"] = [statistics.median(t[key]) for t in times]
                m[f"{key}_s"] = max(m[f"{key}_s_per_rank"])
                m[f"{key}_s_steps"] = [t[key] for t in times]
            m["x_faster"] = max(statistics.median(t["step"]) for t in base) / m["step_s"]
            row[mode] = m
        if name == EXCHANGE_IMPLS[-1]:
            row.update(max_rel_err=None, rel_errs=None, ok=True)  # the reference of the check
        else:
            rel = {mode: {q: max(res["diffs"][mode][q] for res in per_rank) for q in per_rank[0]["diffs"][mode]}
                   for mode in EXCHANGE_MODES}
            worst = max(v for d in rel.values() for v in d.values())
            row.update(max_rel_err=worst, rel_errs=rel, ok=worst <= EXCHANGE_TOLERANCE)
        rows.append(row)
    return rows


def _print_exchange_rows(rows: list[dict[str, Any]], P: int) -> None:
    for r in rows:
        if "error" in r:
            click.echo(f"   {P:>1} {r['impl']:<10} FAILED: {r['error']}")
            continue
        cells = [v for mode in EXCHANGE_MODES for v in (r[mode]["fwd_s"] * 1e3, r[mode]["bwd_s"] * 1e3,
                                                         r[mode]["step_s"] * 1e3, r[mode]["x_faster"])]
        err, check = ("-", "ref") if r["max_rel_err"] is None else (r["max_rel_err"], "ok" if r["ok"] else "WRONG")
        click.echo(EXCHANGE_TABLE.line(P, r["impl"], *cells, r["threads"], err, check))


def _failures(rows: list[dict[str, Any]], exchange_rows: list[dict[str, Any]]) -> list[str]:
    """One line per failed row of either section."""
    out = [f"P={r['P']} {r['variant']}: " + (r["error"] if "error" in r else
                                             f"logits differ by {r['max_rel_err']:.2e} > {TOLERANCE:g}")
           for r in rows if not r["ok"]]
    out += [f"P={r['P']} exchange {r['impl']}: " + (
        r["error"] if "error" in r else
        f"differs from {EXCHANGE_IMPLS[-1]} by {r['max_rel_err']:.2e} > {EXCHANGE_TOLERANCE:g} (" + ", ".join(
            f"{mode} {q} {v:.2e}" for mode, d in r["rel_errs"].items() for q, v in d.items()
            if v > EXCHANGE_TOLERANCE) + ")")
        for r in exchange_rows if not r["ok"]]
    return out


def _parse_nprocs(text: str) -> list[int]:
    return list(dict.fromkeys(positive_ints(text, "--nprocs", "rank count")))


def _parse_variants(text: str | None) -> list[str]:
    names = comma_list(text) if text else list(DEFAULT_VARIANTS)
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or repr(text)}: choose from {', '.join(VARIANTS)}",
                                 param_hint="--variants")
    return [v for v in VARIANTS if v in names]  # the table's order


@click.command("bench-hf")
@click.option("--nprocs", default="2", show_default=True,
              help="Ranks per expert-parallel variant; a comma-separated list (2,4) measures each.")
@click.option("--layers", type=COUNT, default=4, show_default=True, help="Decoder layers (every one MoE).")
@click.option("--experts", type=COUNT, default=32, show_default=True, help="Experts per layer (divisible by P).")
@click.option("-k", "--top-k", "top_k", type=COUNT, default=4, show_default=True, help="Experts per token.")
@click.option("--hidden", type=COUNT, default=512, show_default=True,
              help="Hidden size (expert intermediate hidden/2, heads of min(64, hidden/2)).")
@click.option("--tokens", type=COUNT, default=512, show_default=True, help="Tokens per rank per step.")
@click.option("--batch", type=COUNT, default=1, show_default=True,
              help="Sequences per rank (of --tokens / --batch tokens each).")
@click.option("--vocab", type=COUNT, default=2048, show_default=True, help="Vocabulary size.")
@click.option("--experts-implementation", type=click.Choice(EXPERTS_IMPLEMENTATIONS), default="grouped_mm",
              show_default=True, help="transformers' experts_implementation (the same in every variant). grouped_mm "
                                      "runs on CPU float32 (torch 2.13); batched_mm gathers every (token, expert)'s "
                                      "weights (GBs at the default size).")
@click.option("-n", "--iters", type=COUNT, default=10, show_default=True, help="Timed steps per variant.")
@click.option("-w", "--warmup", type=NONNEGATIVE, default=3, show_default=True, help="Untimed steps first.")
@click.option("--variants", default=None,
              help=f"Comma-separated subset of {', '.join(VARIANTS)} [default: {','.join(DEFAULT_VARIANTS)}].")
@click.option("--quick", is_flag=True,
              help="A tiny configuration (2 layers, 8 experts top-2, hidden 64, 32 tokens, vocab 128, -n 2 -w 1); "
                   "overrides those options.")
@click.option("--no-exchange", is_flag=True, help="Skip the section \"EP exchange per MoE layer\".")
@click.option("--exchange-only", is_flag=True,
              help="Run only the section \"EP exchange per MoE layer\" (MoecommEP vs AllToAllEP on one experts "
                   "module, no model).")
@click.option("--seed", type=NONNEGATIVE, default=0, show_default=True, help="Seed of the weights and tokens.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("-J", "--json", "json_path", default=None, metavar="FILE", help="Write the rows and environment as JSON.")
def bench_hf(nprocs: str, layers: int, experts: int, top_k: int, hidden: int, tokens: int, batch: int, vocab: int,
             experts_implementation: str, iters: int, warmup: int, variants: str | None, quick: bool,
             no_exchange: bool, exchange_only: bool, seed: int, timeout: float, json_path: str | None) -> None:
    """Forward and forward+backward step time of a small transformers MoE model (Qwen3-MoE), expert-parallel
    over moecomm and over transformers' all_to_all, side by side, with a logits check against one process;
    then the exchange alone per MoE layer (MoecommEP vs AllToAllEP), with and without the experts' compute."""
    import importlib.metadata
    import importlib.util

    import collectives

    if importlib.util.find_spec("transformers") is None:
        raise click.UsageError("bench-hf needs transformers and accelerate (pip install 'moecomm[hf]')")
    if collectives.detect_launch() in ("mpi", "torchrun"):
        raise click.UsageError("bench-hf starts its own ranks for each variant; run it without mpirun/torchrun")
    if no_exchange and exchange_only:
        raise click.UsageError("--no-exchange and --exchange-only exclude each other")
    o = {"layers": layers, "experts": experts, "top_k": top_k, "hidden": hidden, "tokens": tokens, "batch": batch,
         "vocab": vocab, "iters": iters, "warmup": warmup}
    if quick:
        o.update(QUICK)
    o.update(experts_implementation=experts_implementation, seed=seed, timeout=timeout, quick=quick)
    sizes = _parse_nprocs(nprocs)
    names = _parse_variants(variants)
    if o["top_k"] > o["experts"]:
        raise click.BadParameter(f"top-k {o['top_k']} exceeds --experts {o['experts']}", param_hint="--top-k")
    for P in sizes:
        if o["experts"] % P:
            raise click.BadParameter(f"--experts {o['experts']} is not divisible by {P} ranks", param_hint="--nprocs")
    if o["tokens"] % o["batch"]:
        raise click.BadParameter(f"--tokens {o['tokens']} is not divisible by --batch {o['batch']}",
                                 param_hint="--batch")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    seq = o["tokens"] // o["batch"]
    dims = _dims(o)
    if exchange_only:
        names = []
    ep_names = [v for v in names if v != "unsharded"]
    # every P's global batch: P x batch sequences; rank r of P takes rows [r*batch, (r+1)*batch)
    inputs = {P: torch.randint(0, o["vocab"], (P * o["batch"], seq), generator=torch.Generator().manual_seed(
        o["seed"] + 1000 * P)) for P in sizes}
    rows: list[dict[str, Any]] = []
    exchange_rows: list[dict[str, Any]] = []
    params = None
    with tempfile.TemporaryDirectory(prefix="moecomm-bench-hf-") as tmp:
        path = str(Path(tmp) / "model")
        if names:
            # first: build and save the model, and the unsharded runs (the reference logits), in one process
            base = launch_logged(_unsharded_rank, 1, o, path, inputs, timeout=timeout)[0]
            params = base["params"]
            click.echo(f"# moecomm bench-hf: Qwen3-MoE {o['layers']} layers, {o['experts']} experts top-{o['top_k']}, "
                       f"hidden {o['hidden']} (expert {dims['moe_intermediate_size']}, {dims['num_attention_heads']} "
                       f"heads x {dims['head_dim']}, {dims['num_key_value_heads']} kv), vocab {o['vocab']}, "
                       f"{params / 1e6:.2f}M params, float32, experts_implementation="
                       f"{o['experts_implementation']!r}" + (" (--quick)" if quick else ""))
            click.echo(f"# {o['tokens']} tokens per rank ({o['batch']} x {seq}); step = forward with labels (fwd) + "
                       f"backward; iters {o['iters']}, warmup {o['warmup']}; {cpus} CPUs here, torch threads: "
                       "CPUs / ranks (thr)")
            click.echo("# time: each rank's median step, then the slowest rank; every variant runs the same global "
                       "batch (P x tokens) on the same CPUs, unsharded in one process with all the threads")
            click.echo(f"# x faster = t({BASELINE}) / t(variant); tok/s = P x tokens / fwd+bwd; max_rel_err = max "
                       f"|logits - unsharded| / max |unsharded| (fails above {TOLERANCE:g})")
            for v in names:
                click.echo(f"#   {v:<16} {VARIANTS[v][2]}")
            for line in TABLE.header():
                click.echo(line)
        exchange_per_p = {}
        for P in sizes:
            if P > cpus:
                click.echo(f"# P={P}: {P} ranks on {cpus} CPUs (oversubscribed): times include waiting for a CPU")
            results = {"unsharded": [base["runs"][P]]} if names else {}
            if ep_names or not no_exchange:
                # one launch per P: the variants, then the exchange section (transformers imported once per rank)
                per_rank = launch_logged(_ep_rank, P, o, ep_names, path, inputs[P], tmp, not no_exchange,
                                         timeout=timeout)
                results.update({v: [r["variants"][v] for r in per_rank] for v in ep_names})
                if not no_exchange:
                    exchange_per_p[P] = [r["exchange"] for r in per_rank]
            if names:
                ref = base["runs"][P].get("logits")
                p_rows = [_summary(v, P, results[v], ref) for v in names]
                _print_rows(p_rows, o, P)
                rows.extend(p_rows)
        if exchange_per_p:
            click.echo(f"# EP exchange per MoE layer: moe.hf.MoecommEP vs transformers' AllToAllEP (the baseline), "
                       f"torch.distributed over gloo, DeviceMesh (P, 1) (\"ep\", \"tp\"), called on one Qwen3MoeExperts "
                       f"of {o['experts']}/P experts (hidden {o['hidden']}, expert {dims['moe_intermediate_size']}), "
                       f"{o['tokens']} random tokens per rank, top-{o['top_k']} of a softmax over random logits, "
                       "float32" + (" (--quick)" if quick else ""))
            click.echo("# exchange: the experts' forward is x * w (the exchange alone); with experts: the experts' own "
                       f"(experts_implementation={o['experts_implementation']!r})")
            click.echo("# fwd = impl(x, top_k_index, top_k_weights), bwd = y.backward(dy); iters "
                       f"{o['iters']}, warmup {o['warmup']}; each rank's median, then the slowest rank; "
                       f"x faster = fwd+bwd t({EXCHANGE_IMPLS[-1]}) / t")
            click.echo("# check: output and gradients (x, routing weights, experts' weights) on the same inputs, max "
                       f"|moecomm - {EXCHANGE_IMPLS[-1]}| / max |{EXCHANGE_IMPLS[-1]}| over both (fails above "
                       f"{EXCHANGE_TOLERANCE:g})")
            for line in EXCHANGE_TABLE.header():
                click.echo(line)
            for P, per_rank in exchange_per_p.items():
                p_rows = _exchange_summary(P, per_rank)
                _print_exchange_rows(p_rows, P)
                exchange_rows.extend(p_rows)
    failures = _failures(rows, exchange_rows)
    if json_path:
        from .output import environment, save_json

        doc = {"schema": "moecomm-bench-hf/1", "env": environment({"cpus_affinity": cpus}),
               "options": dict(o, nprocs=sizes, variants=names, baseline=BASELINE, tolerance=TOLERANCE,
                               exchange=not no_exchange, exchange_only=exchange_only,
                               exchange_tolerance=EXCHANGE_TOLERANCE, params=params,
                               model=dict(dims, model_type="qwen3_moe"),
                               transformers=importlib.metadata.version("transformers")),
               "variants": {v: VARIANTS[v][2] for v in names}, "rows": rows, "exchange_rows": exchange_rows}
        click.echo(f"# wrote {save_json(json_path, doc).resolve()}")
    if failures:
        click.echo("# FAILED: " + "; ".join(failures), err=True)
        raise SystemExit(1)
