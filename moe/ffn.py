"""The feed-forward pieces the expert modules share: activations and the seeded weight draw.

:mod:`moe.layer` (``GroupedExperts``, ``SharedExpert``) and :mod:`moe.expert_tp` (``ShardedExperts``)
both import them from here, so an expert's weights and function are one definition whatever its layout.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .router import EXPERT_STREAM, seeded_generator

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": lambda h: F.silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:],
    "geglu": lambda h: F.gelu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:],
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
_GATED = ("swiglu", "geglu")  # fc1 is [H, 2F] = [gate | up]


def _ffn_weights(hidden: int, ffn: int, activation: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 [H, F or 2F] ~ N(0, 1/H), fc2 [F, H] ~ N(0, 1/F), drawn in that order from ``gen``."""
    width = 2 * ffn if activation in _GATED else ffn
    fc1 = torch.randn(hidden, width, generator=gen) / math.sqrt(hidden)
    fc2 = torch.randn(ffn, hidden, generator=gen) / math.sqrt(ffn)
    return fc1, fc2


def _expert_weights(where: str, num_local_experts: int, first_expert: int, expert_ids: Sequence[int] | None,
                    hidden: int, ffn: int, activation: str, seed: int
                    ) -> tuple[list[int], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``(ids, weights)`` of a rank's expert slots: ids the L logical ids (``expert_ids``, default
    ``first_expert + i``), weights each distinct id's full ``_ffn_weights`` drawn from
    ``seeded_generator(seed, EXPERT_STREAM, id)`` alone (so replicas are identical copies). ValueError
    (naming ``where``) when ``expert_ids`` does not hold L ids."""
    ids = list(range(first_expert, first_expert + num_local_experts)) if expert_ids is None else \
        [int(e) for e in expert_ids]
    if len(ids) != num_local_experts:
        raise ValueError(f"{where}: {len(ids)} expert_ids for {num_local_experts} local experts")
    return ids, {e: _ffn_weights(hidden, ffn, activation, seeded_generator(seed, EXPERT_STREAM, e))
                 for e in dict.fromkeys(ids)}
