"""``Communicator.plan`` and the per-call transport choice behind every call (a mixin of the
Communicator): which transport and algorithm a call takes, and why.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from transports.base import OpCode, Transport

from ._arrays import Array, as_tensor
from ._rmsnorm import FLOATS
from .prediction import predict_plan
from .selection import Plan, choose_transport

log = logging.getLogger("collectives")

_OPCODE_BY_NAME = {"all_reduce": OpCode.ALL_REDUCE, "all_gather": OpCode.ALL_GATHER,
                   "reduce_scatter": OpCode.REDUCE_SCATTER, "all_to_all": OpCode.ALL_TO_ALL,
                   "broadcast": OpCode.BROADCAST, "barrier": OpCode.BARRIER,
                   "all_reduce_rmsnorm": OpCode.ALL_REDUCE}  # its all_reduce picks the transport


class Planning:
    """Transport choice (``_select``) and ``plan()`` of :class:`collectives.Communicator`."""

    # ---- selection ----------------------------------------------------------------------------
    def _select(self, opcode: OpCode, device: str, nbytes: int, dtype: torch.dtype, name: str
                ) -> tuple[Transport, Plan]:
        if self._state.closed is not None:
            self._state.raise_closed()
        tname, reason = choose_transport(opcode, device, self.topology.single_node, self.transports, self._forced,
                                         nbytes=None if opcode == OpCode.ALL_TO_ALL else nbytes)
        t = self.transports[tname]
        staged = device not in t.devices
        plan = Plan(name, tname, t.algorithm(opcode, nbytes, dtype), nbytes, reason, staged)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %s", self.global_ranks[self.rank], plan)
        if staged and not self._warned_staging:
            self._warned_staging = True
            log.warning("no transport for %s tensors is available; %s copies them through host memory "
                        "(slow). Install the GPU transports to avoid this.", device, tname)
        return t, plan

    def plan(self, collective: str, x: Array, *, op: str = "sum", send_counts: Sequence[int] | None = None,
             src: int = 0, weight_dtype: torch.dtype | None = None) -> Plan:
        """Which transport and algorithm ``getattr(comm, collective)(x, ...)`` would use on this rank.

        Local: no communication.

        Args:
            collective: "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                "barrier" or "all_reduce_rmsnorm" (its algorithm: the transport's fused one, or
                "all_reduce+rmsnorm" where the communicator composes all_reduce and torch ops).
            x: [*] the tensor or array that call would get (a supported dtype; all_reduce_rmsnorm:
                [*, H] of a float dtype).
            op, send_counts, src: as for that call (they do not change the choice today).
            weight_dtype: all_reduce_rmsnorm's weight dtype (None: x's dtype).
        Returns:
            A :class:`Plan`: transport, algorithm, bytes and the reason for the choice, with the
            performance model's predicted time of this plan and of the runner-up (the best other
            transport/algorithm of this communicator) where the model covers the call.
        """
        opcode = _OPCODE_BY_NAME.get(collective)
        if opcode is None:
            raise ValueError(f"unknown collective {collective!r}; one of {sorted(_OPCODE_BY_NAME)}")
        t, _, _ = as_tensor(x)
        if collective == "all_reduce_rmsnorm" and t.dtype not in FLOATS:
            raise TypeError(f"plan: all_reduce_rmsnorm takes x of a float dtype, got {t.dtype}")
        if collective == "all_reduce_rmsnorm" and t.dim() == 0:
            raise ValueError("plan: all_reduce_rmsnorm takes x of [*, H], got a 0-d x")
        tr, plan = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, collective)
        if collective == "all_reduce_rmsnorm":
            fused = None if plan.staged_through_host else tr.fuses_all_reduce_rmsnorm(
                t.numel(), t.shape[-1], t.dtype, weight_dtype if weight_dtype is not None else t.dtype)
            plan = dataclasses.replace(
                plan, algorithm=fused or "all_reduce+rmsnorm",
                reason=f"{plan.reason}; " + (f"fused in {tr.name}" if fused else
                                              f"composed: all_reduce ({plan.algorithm}), then add and RMSNorm in torch"))
        note = tr.plan_note(opcode, plan.nbytes)
        if note:
            plan = dataclasses.replace(plan, reason=f"{plan.reason}; {note}")
        predicted = predict_plan(self.settings, op=collective, transport=plan.transport, algorithm=plan.algorithm,
                                 nbytes=plan.nbytes, ranks=self.size, nodes=len(self.topology.nodes), device=t.device,
                                 available=set(self.transports))
        return dataclasses.replace(plan, predicted_us=predicted.chosen_us, runner_up=predicted.runner_up,
                                   runner_up_us=predicted.runner_up_us)
