"""Point-to-point send/recv of the moecomm process group, through the group's rendezvous store.

The Communicator has collectives only, so ``dist.send``/``dist.recv`` carry each message as one
store value (a small JSON header with dtype and shape, then the raw bytes). That is correct,
bounded by the timeout and fine for control messages and small tensors; bulk pipeline traffic
belongs in collectives (or a transport with point-to-point calls). Messages between two ranks
with one tag are matched in the order they were sent, as MPI and gloo do.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import defaultdict
from typing import Any, Sequence

import torch

from transports.base import CollectiveTimeoutError


class StoreMailbox:
    """Messages between the ranks of one group, as keys of the group's store.

    Args:
        store: the group's ``torch.distributed.Store`` (keys go under ``prefix``).
        prefix: key prefix no other group uses.
        rank: this rank in the group.
        global_ranks: [size] world rank of each group rank, for messages.
        timeout: seconds a receive waits for its message.
    """

    def __init__(self, store: Any, prefix: str, rank: int, global_ranks: Sequence[int], timeout: float):
        self.store, self.prefix, self.rank, self.timeout = store, prefix, rank, timeout
        self.global_ranks = list(global_ranks)
        self._sent: dict[tuple[int, int], int] = defaultdict(int)  # (dst, tag) -> messages sent
        self._received: dict[tuple[int, int], int] = defaultdict(int)  # (src, tag) -> messages received

    def _key(self, src: int, dst: int, tag: int, seq: int) -> str:
        return f"{self.prefix}/{src}>{dst}/t{tag}/{seq}"

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Leave ``t`` for rank ``dst`` (returns once the store holds it).

        Args:
            t: [*] any dense tensor (copied to host memory).
            dst: the receiving group rank.
            tag: matches the receiver's tag.
        """
        seq = self._sent[(dst, tag)]
        self._sent[(dst, tag)] = seq + 1
        flat = t.detach().reshape(-1).contiguous().cpu()
        header = json.dumps({"dtype": str(flat.dtype), "shape": list(t.shape)}).encode()
        self.store.set(self._key(self.rank, dst, tag, seq), header + b"\n" + flat.view(torch.uint8).numpy().tobytes())

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        """Write the next message from rank ``src`` with ``tag`` into ``t``.

        Raises CollectiveTimeoutError naming ``src`` if nothing arrives within the timeout, and
        ValueError naming both ranks if the message's dtype or shape differs from ``t``'s.
        """
        key = self._key(src, self.rank, tag, self._received[(src, tag)])
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # torch raises DistStoreError / RuntimeError on a timeout
            raise CollectiveTimeoutError(
                f"recv on rank {self.global_ranks[self.rank]}: rank {self.global_ranks[src]} sent nothing with tag "
                f"{tag} within {self.timeout:.1f}s", [self.global_ranks[src]]) from e
        self._deliver(t, src, tag, key)

    def recv_any(self, t: torch.Tensor, tag: int) -> int:
        """Write the next message with ``tag`` from whichever rank sent one first into ``t``.

        Returns:
            The sender's group rank. Raises CollectiveTimeoutError if no rank sent one in time.
        """
        deadline = time.monotonic() + self.timeout
        sleep = 1e-4
        peers = [r for r in range(len(self.global_ranks)) if r != self.rank]
        while True:
            for src in peers:
                key = self._key(src, self.rank, tag, self._received[(src, tag)])
                if self.store.check([key]):
                    self._deliver(t, src, tag, key)
                    return src
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"recv (any source) on rank {self.global_ranks[self.rank]}: no rank sent a message with tag "
                    f"{tag} within {self.timeout:.1f}s", [self.global_ranks[r] for r in peers])
            time.sleep(sleep)
            sleep = min(2 * sleep, 1e-2)

    def _deliver(self, t: torch.Tensor, src: int, tag: int, key: str) -> None:
        self._received[(src, tag)] += 1
        value = bytes(self.store.get(key))
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 - best-effort cleanup (older FileStores cannot delete)
            pass
        header, _, data = value.partition(b"\n")
        meta = json.loads(header)
        if meta["dtype"] != str(t.dtype) or tuple(meta["shape"]) != tuple(t.shape):
            raise ValueError(f"recv on rank {self.global_ranks[self.rank]}: rank {self.global_ranks[src]} sent a "
                             f"{meta['dtype'].replace('torch.', '')} tensor of shape {tuple(meta['shape'])} with tag "
                             f"{tag}, but the receive tensor is {str(t.dtype).replace('torch.', '')} "
                             f"{tuple(t.shape)}")
        received = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        with torch.no_grad():
            t.copy_(received.view(t.dtype).reshape(t.shape))
