"""The ipc transport's uneven all_to_all (:class:`IPCAllToAll`, mixed into
``transports.ipc.IPCTransport``): stage, publish counts, pull each block from its sender's buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from ._schedule import all_to_all_pulls, staged_segments
from .base import Allocator, CollectiveTimeoutError, CommunicatorBrokenError, Signature, check_recv_counts
from .kernels import layout as L


class IPCAllToAll:
    """all_to_all of :class:`transports.ipc.IPCTransport`."""

    takes_recv_counts = True

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature, recv_counts: list[int] | None = None) -> torch.Tensor:
        """Uneven all-to-all: stage, publish counts, pull each block from its sender's buffer.

        See :meth:`Transport.all_to_all`. ``recv_counts`` ([size] ints) travel with the send
        counts through the signal areas in the first (stage) kernel; after its barrier every rank
        reads every rank's [size, size] send and declared matrices and compares them before it
        reads any peer's data, so a wrong value raises the ``ValueError`` of
        :func:`check_recv_counts` on every rank, with no barrier more than a plain call.
        """
        n, me, S = self.size, self.rank, self.buffer_bytes
        x = send.reshape(-1).view(torch.uint8)
        row_bytes = row_numel * send.element_size()
        own_start, own_len = sum(send_counts[:me]) * row_bytes, send_counts[me] * row_bytes
        declared_mine = [-1] * n if recv_counts is None else [int(c) for c in recv_counts]
        counts_t = torch.tensor([*send_counts, *declared_mine], dtype=torch.int64, device=self._device)
        common = self._common(sig)

        def stage(j: int) -> None:
            pieces = staged_segments(own_start, own_len, x.numel(), j * S, (j + 1) * S)
            table = torch.tensor(pieces or [[0, 0, 0]], dtype=torch.int64, device=self._device)
            self._launch(self._k.all_to_all_stage, x, table, len(pieces), counts_t, *common, BLOCK=self.block)

        def pull(out: torch.Tensor, copies: list) -> None:
            table = torch.tensor(copies or [[0, 0, 0, 0]], dtype=torch.int64, device=self._device)
            self._launch(self._k.all_to_all_pull, out, table, len(copies), *common[:5], self._max_spins,
                         BLOCK=self.block)

        stage(0)
        self.synchronize()  # the host reads the counts the stage kernel published
        wrong = None
        try:
            # one read per rank: its COUNTS .. RECV_COUNTS words, published before the barrier we passed
            span = L.RECV_COUNTS + n - L.COUNTS
            words = np.stack([self._regions.read(r, L.COUNTS, span) for r in range(n)])
            sent = words[:, :n]  # sent[src][dst] rows
            declared = words[:, L.RECV_COUNTS - L.COUNTS :]  # declared[dst][src] rows
            # recv_counts on one rank means on every rank: the signatures (compared in stage) say so
            if recv_counts is not None and not (declared == sent.T).all():
                # every rank sees these matrices and comes here; the pull kernel's last barrier, with
                # nothing to copy, ends the round so no rank rewrites its counts before all have read them
                wrong = (sent.tolist(), declared.tolist())
                pull(x, [])
            else:
                counts = sent.tolist()
                recv = [row[me] for row in counts]
                out = alloc(recv)
                y = out.reshape(-1).view(torch.uint8)
                at = sum(recv[:me]) * row_bytes
                y[at : at + own_len].copy_(x[own_start : own_start + own_len])  # our block to ourselves
                for j, copies in enumerate(all_to_all_pulls(counts, me, row_bytes, S)):
                    if j > 0:
                        stage(j)
                    pull(y, copies)
        except BaseException as e:
            if not isinstance(e, (CollectiveTimeoutError, CommunicatorBrokenError)) and not self._broken:
                # the peers are inside this round's pull kernel: make them raise instead of waiting
                self._broken = f"{type(e).__name__} during all_to_all: {e}"
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
            raise
        if wrong is not None:
            check_recv_counts(*wrong, self._ranks)
        return out
