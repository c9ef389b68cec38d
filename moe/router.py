"""Top-k router with Switch/GShard load balancing and ST-MoE z-loss."""

from __future__ import annotations

import math
from typing import NamedTuple

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
                           z_loss_coef: float) -> None:
    """Raise ``ValueError`` on the first invalid :class:`TopKRouter` argument (message without a prefix).

    Args: as :class:`TopKRouter`. Returns: None. Local (no communication).
    """
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

    logits = x @ W^T (in float32, W: [E, H] drawn from ``seed`` alone, N(0, 1/H)).
    score="softmax": s = softmax(logits); score="sigmoid": s = sigmoid(logits). The k largest
    scores give ``experts``; their scores are the ``weights``, divided by their sum when
    ``normalize`` (a no-op for softmax with k = E).

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
    Local: no communication (``ValueError`` on a bad argument).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 normalize: bool = True, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, seed: int = 0):
        super().__init__()
        try:
            check_router_arguments(hidden_size, num_experts, top_k, score=score, aux_loss_coef=aux_loss_coef,
                                   z_loss_coef=z_loss_coef)
        except ValueError as e:
            raise ValueError(f"TopKRouter: {e}") from None
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.score, self.normalize = score, bool(normalize)
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.seed = seed
        w = torch.randn(num_experts, hidden_size, generator=seeded_generator(seed, ROUTER_STREAM))
        self.weight = nn.Parameter(w / math.sqrt(hidden_size))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, normalize={self.normalize}, aux_loss_coef={self.aux_loss_coef}, "
                f"z_loss_coef={self.z_loss_coef}, seed={self.seed}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterScores]:
        """Routing without the losses.

        Args:
            x: [T, H] float (any float dtype; the gate runs in float32).

        Returns:
            ``(weights, experts, scores)``: weights [T, k] float32, experts [T, k] int64 global
            expert ids (each row distinct, by descending score), scores a :class:`RouterScores`.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"TopKRouter: x must be [num_tokens, {self.hidden_size}], got "
                             + shape_or_type(x))
        logits = x.float() @ self.weight.float().t()
        if self.score == "softmax":
            s = torch.softmax(logits, dim=-1)
            probs = s
        else:
            s = torch.sigmoid(logits)
            probs = s / s.sum(-1, keepdim=True)
        weights, experts = torch.topk(s, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, RouterScores(probs, logits)

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
