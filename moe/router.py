"""Top-k router with Switch/GShard load balancing and ST-MoE z-loss, and DeepSeek-V3's group-limited
routing with the auxiliary-loss-free score-correction bias."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

# Tags that keep the router, expert and shared-expert random streams apart for one seed.
ROUTER_STREAM, EXPERT_STREAM, SHARED_STREAM = 0, 1, 2
SCORES = ("softmax", "sigmoid")


def seeded_generator(seed: int, *stream: int) -> torch.Generator:
    """A CPU generator determined by ``seed`` and the stream tags only.

    Args:
        seed: an int >= 0 (ValueError otherwise).
        stream: ints that keep streams of one seed apart (e.g. EXPERT_STREAM and a global expert index).

    Returns:
        A seeded ``torch.Generator`` on the CPU; the global random generator is not touched.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    state = np.random.SeedSequence([seed, *stream]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def shape_or_type(x: object) -> str:
    """``"shape (3, 4)"`` for a tensor, else the type's name: how error messages show a bad argument."""
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def is_positive_int(v: object) -> bool:
    """Whether ``v`` is an int > 0 (bool excluded: True is not a size)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_router_arguments(hidden_size: int, num_experts: int, top_k: int, *, score: str, aux_loss_coef: float,
                           z_loss_coef: float, num_groups: int = 1, topk_groups: int | None = None,
                           routed_scaling_factor: float = 1.0) -> None:
    """Raise ``ValueError`` on the first invalid :class:`TopKRouter` argument (message without a prefix).

    Args: as :class:`TopKRouter`. Returns: None. Local (no communication).
    """
    if not is_positive_int(num_groups):
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if is_positive_int(num_experts) and num_experts % num_groups:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_groups={num_groups}")
    if topk_groups is not None and not (is_positive_int(topk_groups) and topk_groups <= num_groups):
        raise ValueError(f"topk_groups must be a positive int <= num_groups={num_groups}, got {topk_groups!r}")
    if is_positive_int(num_experts) and is_positive_int(top_k) and num_groups > 1:
        kept = (topk_groups or num_groups) * (num_experts // num_groups)
        if top_k > kept:
            raise ValueError(f"top_k={top_k} exceeds the {kept} experts of the topk_groups={topk_groups} groups kept")
    v = routed_scaling_factor
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {v!r}")
    for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
        if not is_positive_int(v):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    for name, v in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


class RouterOutput(NamedTuple):
    """weights: [T, k] float32; experts: [T, k] int64 global expert ids; aux_loss: scalar float32."""

    weights: torch.Tensor
    experts: torch.Tensor
    aux_loss: torch.Tensor


class RouterScores(NamedTuple):
    """What the auxiliary losses need besides the routing: ``probs`` [T, E] float32 (rows sum to 1)
    and ``logits`` [T, E] float32."""

    probs: torch.Tensor
    logits: torch.Tensor


class TopKRouter(nn.Module):
    """Picks ``top_k`` experts per token from a linear gate.

    logits = x @ W^T (W: [E, H] drawn from ``seed`` alone, N(0, 1/H); the product in float32, or in
    float64 for a float64 W, then rounded to float32, as transformers' Mixtral and Qwen3-MoE gates do).
    score="softmax": s = softmax(logits); score="sigmoid": s = sigmoid(logits), in float32. The k largest
    scores give ``experts``; their scores are the ``weights``, divided by their sum when
    ``normalize`` (a no-op for softmax with k = E).

    DeepSeek-V3 routing (``score="sigmoid"``, ``num_groups`` G, ``topk_groups`` g, ``bias=True``):
    the choice uses ``s + e_score_correction_bias``: experts are split into G equal groups, a group's
    score is the sum of its two best biased scores, only the g best groups stay, and the k best
    biased scores among their experts are picked. The weights are the unbiased scores of the picked
    experts (the bias changes the choice, never the weights), divided by their sum (+1e-20) when
    ``normalize``, then times ``routed_scaling_factor``. The bias is a buffer, not a parameter:
    :meth:`update_bias` moves it (the auxiliary-loss-free balancing of DeepSeek-V3, arXiv 2412.19437).

    Losses (T tokens, k slots, E experts; over the whole batch of every rank in :class:`MoELayer`):
      load balancing (Switch Transformer eq. 4, GShard; k-normalised so perfect balance gives the coef):
        aux = aux_loss_coef * E * sum_e f_e * P_e,
        f_e = (number of (token, slot) pairs routed to e) / (T * k)   (before capacity dropping),
        P_e = (1 / T) * sum_t p_{t,e},   p = softmax(logits) for softmax, s / sum_e s for sigmoid;
      router z-loss (ST-MoE eq. 5):
        z = z_loss_coef * (1 / T) * sum_t (logsumexp_e logits_{t,e})^2.
    ``aux_loss`` = aux + z (a 0-d float32 tensor; zeros with no graph when both coefs are 0).

    Args:
        hidden_size: H. num_experts: E. top_k: k <= E (all positive ints).
        score: "softmax" or "sigmoid". normalize: divide the k weights by their sum.
        aux_loss_coef, z_loss_coef: finite numbers >= 0 (0 disables that loss).
        seed: an int >= 0; the gate weight depends on it alone.
        num_groups: G, dividing E (1: no groups). topk_groups: g <= G groups kept (None: all).
        bias: keep an ``e_score_correction_bias`` [E] float32 buffer (zeros) that steers the choice
            (added to the float32 scores in the buffer's dtype, if wider).
        routed_scaling_factor: > 0, multiplies the weights (DeepSeek-V3: 2.5).
        norm_topk_prob: transformers' name of ``normalize``; when given, it wins.
    Local: no communication (``ValueError`` on a bad argument).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 normalize: bool = True, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, seed: int = 0,
                 num_groups: int = 1, topk_groups: int | None = None, bias: bool = False,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool | None = None):
        super().__init__()
        try:
            check_router_arguments(hidden_size, num_experts, top_k, score=score, aux_loss_coef=aux_loss_coef,
                                   z_loss_coef=z_loss_coef, num_groups=num_groups, topk_groups=topk_groups,
                                   routed_scaling_factor=routed_scaling_factor)
        except ValueError as e:
            raise ValueError(f"TopKRouter: {e}") from None
        if norm_topk_prob is not None:
            normalize = norm_topk_prob
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.score, self.normalize = score, bool(normalize)
        self.num_groups, self.topk_groups = num_groups, topk_groups or num_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.e_score_correction_bias: torch.Tensor | None
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts) if bias else None)
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.seed = seed
        w = torch.randn(num_experts, hidden_size, generator=seeded_generator(seed, ROUTER_STREAM))
        self.weight = nn.Parameter(w / math.sqrt(hidden_size))

    def extra_repr(self) -> str:
        extra = ""
        if self.num_groups > 1 or self.e_score_correction_bias is not None or self.routed_scaling_factor != 1.0:
            extra = (f", num_groups={self.num_groups}, topk_groups={self.topk_groups}, "
                     f"bias={self.e_score_correction_bias is not None}, "
                     f"routed_scaling_factor={self.routed_scaling_factor}")
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, normalize={self.normalize}, aux_loss_coef={self.aux_loss_coef}, "
                f"z_loss_coef={self.z_loss_coef}, seed={self.seed}{extra}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterScores]:
        """Routing without the losses.

        Args:
            x: [T, H] float (any float dtype; the gate product runs in float32, float64 for a float64 weight).

        Returns:
            ``(weights, experts, scores)``: weights [T, k] float32, experts [T, k] int64 global
            expert ids (each row distinct, by descending score), scores a :class:`RouterScores`.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"TopKRouter: x must be [num_tokens, {self.hidden_size}], got "
                             + shape_or_type(x))
        gemm = torch.promote_types(self.weight.dtype, torch.float32)  # float32, float64 for a float64 weight
        logits = (x.to(gemm) @ self.weight.to(gemm).t()).float()
        if self.score == "softmax":
            s = torch.softmax(logits, dim=-1)
            probs = s
        else:
            s = torch.sigmoid(logits)
            probs = s / s.sum(-1, keepdim=True)
        if self.num_groups == 1 and self.e_score_correction_bias is None:
            weights, experts = torch.topk(s, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(-1, keepdim=True)
        else:
            experts = self._choose(s)
            weights = s.gather(1, experts)
            if self.normalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, experts, RouterScores(probs, logits)

    def _choose(self, s: torch.Tensor) -> torch.Tensor:
        """[T, k] experts by group-limited top-k over the bias-corrected scores (class docstring)."""
        biased = s.detach()
        if self.e_score_correction_bias is not None:
            # float32 + a float32 bias; a float64 bias makes the sum float64 (as in transformers)
            biased = biased + self.e_score_correction_bias.to(biased.device)
        T, E, G = biased.shape[0], self.num_experts, self.num_groups
        if G > 1 and self.topk_groups < G:
            per_group = biased.view(T, G, E // G)
            group_score = per_group.topk(min(2, E // G), dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            biased = biased.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        return biased.topk(self.top_k, dim=-1).indices

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float, comm: Any = None) -> torch.Tensor:
        """DeepSeek-V3's auxiliary-loss-free balancing: ``bias += rate * sign(mean load - load_e)``
        (an underloaded expert becomes likelier to be picked, an overloaded one less).

        Args:
            tokens_per_expert: [E] int or float, this rank's (token, slot) pairs per expert, or the
                whole batch's when ``comm`` is None.
            rate: the update speed, a finite number >= 0 (DeepSeek-V3: 0.001).
            comm: a Communicator: the counts are summed over its ranks first, so every rank applies
                the same update (collective), as it must for the routing to stay the same everywhere.
        Returns:
            The new bias [E] float32 (the buffer itself).
        """
        if self.e_score_correction_bias is None:
            raise ValueError("TopKRouter.update_bias: this router has no bias (construct it with bias=True)")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"TopKRouter.update_bias: rate must be a finite number >= 0, got {rate!r}")
        if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (self.num_experts,):
            raise ValueError(f"TopKRouter.update_bias: tokens_per_expert must be [{self.num_experts}], got "
                             + shape_or_type(tokens_per_expert))
        load = tokens_per_expert.detach().to(torch.float64)
        if comm is not None:
            load = comm.all_reduce(load.cpu()).to(load.device)
        bias = self.e_score_correction_bias
        bias += (rate * torch.sign(load.mean() - load)).to(bias.device, bias.dtype)
        return bias

    def aux_loss(self, scores: RouterScores, tokens_per_expert: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This batch's share of the load-balancing + z-loss (formulas in the class docstring).

        Args:
            scores: from :meth:`route` for this rank's tokens.
            tokens_per_expert: [E] int, pairs routed to each expert over the whole batch (all ranks).
            num_tokens: T of the whole batch.

        Returns:
            A 0-d float32 tensor. The shares of all ranks sum to the loss of the whole batch, and
            so do their gradients.
        """
        dev = scores.logits.device
        if self.aux_loss_coef == 0 and self.z_loss_coef == 0:
            return torch.zeros((), dtype=torch.float32, device=dev)
        T = max(int(num_tokens), 1)  # an empty batch has loss 0, not NaN
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        if self.aux_loss_coef:
            f = tokens_per_expert.to(device=dev, dtype=torch.float32) / (T * self.top_k)
            p_sum = scores.probs.sum(0)
            loss = loss + self.aux_loss_coef * self.num_experts * (f * p_sum).sum() / T
        if self.z_loss_coef:
            z = torch.logsumexp(scores.logits, dim=-1)
            loss = loss + self.z_loss_coef * z.square().sum() / T
        return loss

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` and compute the losses over this call's tokens (:class:`MoELayer` uses the whole batch).

        Args:
            x: [T, H] float.

        Returns:
            ``RouterOutput(weights [T, k] float32, experts [T, k] int64, aux_loss 0-d float32)``.
        """
        weights, experts, scores = self.route(x)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        return RouterOutput(weights, experts, self.aux_loss(scores, counts, x.shape[0]))
