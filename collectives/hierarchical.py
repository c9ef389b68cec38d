"""Hierarchical (node-aware) host collectives: shm inside each node, the flat transport on rails between nodes.

For a group that spans M > 1 nodes with the same L > 1 ranks on each, host-tensor all_reduce,
all_gather and reduce_scatter are composed from two sub-communicators of the group:

* the node group (``split(color=node)``): the L ranks of one node, over shm;
* the rail group (``split(color=local_rank)``): local rank l of every node, over MPI (or gloo),
  so that local rank l of a node only ever talks to local rank l of the others (rail-aligned,
  as NCCL's and DeepEP's inter-node paths are).

all_reduce = node reduce_scatter > rail all_reduce of each rank's 1/L shard > node all_gather:
each rank sends 1/L of the data across nodes instead of all of it. all_gather = rail all_gather >
node all_gather; reduce_scatter = node reduce_scatter > rail reduce_scatter (inputs and outputs
reordered so that results are in rank order for any placement of ranks on nodes).

Why ranks can never disagree on whether this path runs: every call first exchanges its call
signature over the group's flat transport, the same first step as that transport's own collective
(``_agree``: mpi and gloo), so a rank whose size wrongly differs, and was therefore routed to the
flat transport, meets the others there and every rank raises the ValueError that names the
difference. After that check sizes agree, so every rank takes the same path; the sub-groups are
made at the first such call, which every rank makes. Whether shm came up on every node is then
agreed over the group's rendezvous; if not, this transport runs the flat algorithm (``plan()``
says so). A failure in any stage closes both sub-groups, so that their peers on the other nodes
raise at once (PeerFailedError) instead of waiting out their timeout (the sub-groups have the
parent's timeout, so every stage is bounded by it anyway). A stage's error often names a bystander
(a rank of this node that waits on the rail for a rank that stopped or died on another node), so every
rank that fails tells the others, over the flat transport, whom its error named, and raises naming the
ranks that were named and told nothing (``_blame``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from transports.base import (
    F_ROWS,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
)

from .topology import Topology

log = logging.getLogger("collectives")

_HALF = (torch.float16, torch.bfloat16)
# After a failed stage, how long a rank waits for the other ranks' blames (capped by the timeout): they
# post within the flat transport's "who is here?" grace (at most 1 s) of their own failure
_BLAME_WAIT_S = 2.0


def hierarchical_shape(topology: Topology) -> tuple[int, int] | None:
    """(nodes, ranks per node) when the hierarchical path can serve this group, else None.

    Args:
        topology: the group's placement.
    Returns:
        (M, L) with M > 1 nodes of L > 1 ranks each; None for one node, one rank per node, or
        unequal ranks per node (then the flat transport serves every call).
    """
    counts = {len(ranks) for ranks in topology.nodes}
    if len(topology.nodes) < 2 or len(counts) != 1 or counts == {1}:
        return None
    return len(topology.nodes), counts.pop()


def why_flat(topology: Topology) -> str:
    """Why :func:`hierarchical_shape` is None for this group (for plans and logs)."""
    sizes = [len(r) for r in topology.nodes]
    if len(sizes) < 2:
        return "one node"
    if len(set(sizes)) != 1:
        return f"unequal ranks per node {sizes}"
    return "one rank per node"


class _MpiProgress:
    """While the intra-node stages wait in shm, a helper thread keeps this process's MPI progressing.

    MPICH (over OFI at least) pushes a small message out only inside an MPI call. A rank that leaves an
    MPI stage (the signature exchange, the rail collective) with its last message still queued and
    then waits in shm for a node mate, who waits in MPI for a message queued on another node the same
    way, closes a cycle that only the timeout ends (seen on the testbed: ranks 0 and 2 in shm, 1 and 3
    in the signature exchange). MPI_Iprobe drives MPICH's progress engine; mpi4py initialises MPI with
    MPI_THREAD_MULTIPLE, so the thread may call it beside the main thread.

    Args:
        comm: the mpi4py communicator to probe (the flat mpi transport's).
    """

    _POLL_S = 1e-3  # between probes while active: a stranded message leaves within about this (the cycle
    # is rare; faster polling takes the one CPU per node of the testbed from the shm stages)

    def __init__(self, comm: Any):
        self._comm = comm
        self._active = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "_MpiProgress":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moecomm-mpi-progress", daemon=True)
            self._thread.start()
        self._active.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active.clear()

    def _loop(self) -> None:
        while not self._stop:
            if not self._active.wait(0.5):
                continue
            try:
                self._comm.Iprobe()
            except Exception as e:  # noqa: BLE001 - a closed communicator: the main thread reports errors
                log.debug("mpi progress helper stops: %s", e)
                return
            time.sleep(self._POLL_S)

    def close(self) -> None:
        self._stop = True
        self._active.set()
        if self._thread is not None:
            self._thread.join(1.0)


class _NoProgress:
    """Nothing to drive (gloo runs its own I/O threads)."""

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def close(self) -> None:
        pass


class HierarchicalTransport(Transport):
    """all_reduce / all_gather / reduce_scatter of host tensors over a node group and a rail group.

    Numerics: integer results (and max/min of any dtype, NaN propagating) equal the flat
    transport's bit for bit. Floating sums are added in a different order than the flat
    algorithm's (within each node first, then across nodes), so they agree with it only to
    rounding; every rank still gets the same bits (each shard is reduced once, by the rail
    all_reduce, which gives all its ranks the same bits, then copied). 16-bit floats are reduced in
    float32 and rounded once at the end, and ``avg`` is a sum divided by the group size at the end,
    as the flat transports do. Scratch buffers (about 1 + 1/L times the largest input) are kept
    between calls; :meth:`close` frees them.

    Args:
        group: this rank's place in the parent group (rank, size, timeout, ranks for messages).
        topology: the parent group's placement (see :func:`hierarchical_shape`).
        flat: the parent's transport between nodes ("mpi" or "gloo"): signatures, and the fallback.
        split: the parent communicator's collective split ``(color, key, options) -> Communicator``.
    """

    name = "hierarchical"
    devices = ("cpu",)

    def __init__(self, group: GroupInfo, topology: Topology, flat: Transport,
                 split: Callable[[int, int, Any], Any]):
        super().__init__(group)
        shape = hierarchical_shape(topology)
        if shape is None:
            raise ValueError(f"hierarchical collectives need several nodes with equal ranks (>1) each: "
                             f"{why_flat(topology)}")
        self.num_nodes, self.local_size = shape
        self.flat = flat
        self._split = split
        self._node_of = {r: m for m, ranks in enumerate(topology.nodes) for r in ranks}
        self._node = self._node_of[group.rank]
        self._local = topology.nodes[self._node].index(group.rank)
        # row l * M + m of a [L, M, n] buffer holds rank nodes[m][l]'s block: the order in which the
        # node group (by local rank) over the rail group (by node) lays out blocks
        self._order = torch.tensor([topology.nodes[m][l] for l in range(self.local_size)
                                    for m in range(self.num_nodes)], dtype=torch.long)
        self._groups: tuple[Any, Any] | None = None  # (node group, rail group), made at the first call
        self._flat_because: str | None = None  # set when shm is not up on every node
        self._broken: str | None = None
        # scratch memory kept between calls (shards, reordered blocks): fresh pages for every call cost
        # more than the intra-node stages themselves on the testbed (page faults on a loaded CPU)
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # what serves the node and rail stages: expected until the groups are made, then what they picked
        self._stage_names = ("shm", flat.name)
        mpi_comm = getattr(flat, "comm", None) if flat.name == "mpi" else None
        self._progress: _MpiProgress | _NoProgress = _NoProgress()
        if mpi_comm is not None:
            MPI = flat.MPI
            if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                self._progress = _MpiProgress(mpi_comm)
            else:  # a second thread may not call MPI: the MPI -> shm cycle can then only end by the timeout
                log.warning("MPI was initialised below MPI_THREAD_MULTIPLE: hierarchical collectives run without "
                            "their MPI progress helper and may wait out the timeout (mpi4py.rc.thread_level)")

    # ---- plan -------------------------------------------------------------------------------
    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        if self._flat_because is not None:
            return f"flat {self.flat.name}/{self.flat.algorithm(opcode, nbytes, dtype)} ({self._flat_because})"
        intra, inter = self._stage_names
        rails = f"{self.num_nodes} nodes x {self.local_size} rails"
        return {OpCode.ALL_REDUCE: f"{intra} reduce_scatter > {inter} all_reduce ({rails}) > {intra} all_gather",
                OpCode.ALL_GATHER: f"{inter} all_gather ({rails}) > {intra} all_gather",
                OpCode.REDUCE_SCATTER: f"{intra} reduce_scatter > {inter} reduce_scatter ({rails})"
                }.get(opcode, self.flat.algorithm(opcode, nbytes, dtype))

    def _buffer(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] of ``dtype``: scratch ``slot``, grown as needed and reused by later calls."""
        buf = self._scratch.get((slot, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._scratch[(slot, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    # ---- set-up -----------------------------------------------------------------------------
    def _agree(self, sig: Signature) -> None:
        """The flat transport's signature check: the first step of its own collectives too."""
        if self._broken is not None:
            raise CommunicatorBrokenError(f"hierarchical collectives of this communicator failed earlier "
                                          f"({self._broken}); create a new communicator")
        try:
            metas = self.flat.exchange_meta(sig)
        except CollectiveTimeoutError as e:
            # a rank still in the last call's stages (waiting for one that stopped or died there) does not
            # answer here either: the blames tell it from the rank that failed
            named = self._post_blame(e)
            blamed = e if named is None else self._blame(e, named)
            if blamed is e:
                raise
            raise blamed from e
        if not (metas[:, :F_ROWS] == sig.meta[:F_ROWS]).all():
            check_agreement(metas, self.group.global_ranks)

    def _ensure_groups(self) -> bool:
        """Make the node and rail groups (collective; every rank gets here in the same call).

        Returns:
            Whether the hierarchical path runs: shm came up in every node's group.
        """
        if self._groups is None and self._flat_because is None:
            node = self._split(self._node, self._local, None)
            rail = self._split(self._local, self._node, None)
            self._groups = (node, rail)
            self._stage_names = (node.plan("reduce_scatter", torch.zeros(self.local_size)).transport,
                                 rail.plan("all_reduce", torch.zeros(1)).transport)
            up = [json.loads(b) for b in self.group.rendezvous.allgather_bytes(
                json.dumps("shm" in node.transports).encode())]
            if not all(up):
                missing = [self.group.global_ranks[r] for r, ok in enumerate(up) if not ok]
                self._flat_because = f"shm is not up on the node(s) of rank(s) {missing}"
                log.warning("hierarchical collectives use the flat %s transport: %s", self.flat.name,
                            self._flat_because)
                self._close_groups()
        return self._flat_because is None

    def _close_groups(self) -> None:
        groups, self._groups = self._groups, None
        for g in groups or ():
            try:
                g.close()
            except Exception as e:  # noqa: BLE001 - best effort; the failure that brought us here matters
                log.debug("closing a hierarchical sub-group: %s", e)

    def _staged(self, body: Callable[[Any, Any], None]) -> None:
        """Run ``body(node, rail)``; on any failure close both groups so that their peers raise at once, and
        raise naming the rank that failed (:meth:`_blame`)."""
        node, rail = self._groups
        try:
            body(node, rail)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            named = self._post_blame(e)
            self._close_groups()
            blamed = e if named is None else self._blame(e, named)
            if blamed is e:
                raise
            raise blamed from e

    def _post_blame(self, error: BaseException) -> list[int] | None:
        """Tell the other ranks, over the flat transport, whom this rank's failed stage names: the ranks the
        error names (a timeout, a peer that died or aborted), or this rank itself for any other error (its
        own failure). None where the flat transport cannot carry it (then ``error`` is raised as it is)."""
        post = getattr(self.flat, "post_blame", None)
        if post is None or not isinstance(error, Exception):
            return None
        me = self.group.global_ranks[self.rank]
        named = list(getattr(error, "missing_ranks", [])) if isinstance(error, CollectiveTimeoutError) else [me]
        try:
            post(named)
        except Exception as e:  # noqa: BLE001 - e.g. the store's host is gone: the error goes as it is
            log.debug("hierarchical: could not post the blame: %s", e)
            return None
        return named

    def _blame(self, error: BaseException, named: list[int]) -> BaseException:
        """``error``, or one of its class naming the rank(s) that failed, from every rank's blame.

        A stage's error often names a bystander: a rank of this node that waits, in the rail stage, for the
        rank that stopped or died on another node (or closed its groups when it gave up). Every rank that
        failed posts whom its error named (:meth:`_post_blame`); a rank that posts is alive, so the rank(s)
        that failed are those named that posted nothing, and those that named themselves. Waits until every
        rank posted, at most ``_BLAME_WAIT_S`` (the ranks that failed never post; the others post within
        the flat transport's "who is here?" grace of their own failure, which comes about when this one's).
        """
        me = self.group.global_ranks[self.rank]
        everyone = set(self.group.global_ranks)
        deadline = time.monotonic() + min(self.group.timeout, _BLAME_WAIT_S)
        blames: dict[int, list[int]] = {me: named}
        while True:
            try:
                blames.update(self.flat.blames())
            except Exception as e:  # noqa: BLE001 - the store's host is gone: judge by what came
                log.debug("hierarchical: could not read the blames: %s", e)
                break
            if set(blames) == everyone or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        failed = sorted({r for ranks in blames.values() for r in ranks if r not in blames}
                        | {r for r, ranks in blames.items() if r in ranks})
        if not failed or set(failed) == set(named):
            return error
        seen = sorted(r for r, ranks in blames.items() if set(ranks) & set(failed))
        cls = type(error) if isinstance(error, CollectiveTimeoutError) else PeerFailedError
        try:
            return cls(f"hierarchical collective failed on rank {me}: rank(s) {failed} failed, as rank(s) {seen} "
                       f"found (here: {type(error).__name__}: {error})", failed)
        except Exception:  # noqa: BLE001 - an error class with another signature
            return PeerFailedError(f"hierarchical collective failed on rank {me}: rank(s) {failed} failed, as "
                                   f"rank(s) {seen} found (here: {type(error).__name__}: {error})", failed)

    # ---- collectives ------------------------------------------------------------------------
    def exchange_meta(self, sig: Signature) -> np.ndarray:
        return self.flat.exchange_meta(sig)

    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        if send.numel() == 0:
            return
        if not self._ensure_groups():
            return self.flat.all_reduce(send, out, op, sig)
        L, n = self.local_size, send.numel()
        shard_len = -(-n // L)
        work_dtype = torch.float32 if send.dtype in _HALF else send.dtype
        stage_op = "sum" if op == ReduceOp.AVG else op.name.lower()
        direct = work_dtype == send.dtype and shard_len * L == n
        if direct:  # no padding, no conversion: reduce from send, gather into out
            work, result = send.reshape(-1), out.reshape(-1)
        else:  # padded to L shards (the padding is reduced and dropped), 16-bit floats in float32
            work = self._buffer(0, shard_len * L, work_dtype)
            work[:n].copy_(send.reshape(-1))
            work[n:].zero_()
            result = work  # send is read before the gather overwrites it
        shard = self._buffer(1, shard_len, work_dtype)

        def body(node: Any, rail: Any) -> None:
            with self._progress:
                node.reduce_scatter(work, op=stage_op, out=shard)
            rail.all_reduce(shard, op=stage_op, out=shard)
            with self._progress:
                node.all_gather(shard, out=result)

        self._staged(body)
        if op == ReduceOp.AVG:
            result.div_(self.size)
        if not direct:
            out.reshape(-1).copy_(result[:n])

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        self._agree(sig)
        n = send.numel()
        if n == 0:
            return
        if not self._ensure_groups():
            return self.flat.all_gather(send, out, sig)
        by_node = self._buffer(0, self.num_nodes * n, send.dtype)
        every = self._buffer(1, self.size * n, send.dtype)  # [L, M, n]: local rank, node

        def body(node: Any, rail: Any) -> None:
            rail.all_gather(send.reshape(-1), out=by_node)
            with self._progress:
                node.all_gather(by_node, out=every)

        self._staged(body)
        out.reshape(self.size, n).index_copy_(0, self._order, every.view(self.size, n))

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        n = out.numel()
        if n == 0:
            return
        if not self._ensure_groups():
            return self.flat.reduce_scatter(send, out, op, sig)
        work_dtype = torch.float32 if send.dtype in _HALF else send.dtype
        stage_op = "sum" if op == ReduceOp.AVG else op.name.lower()
        # blocks in [L, M, n] order: the node group hands local rank l the blocks of rail l
        work = self._buffer(0, self.size * n, work_dtype)
        blocks = send.reshape(self.size, n)
        if work_dtype == send.dtype:
            torch.index_select(blocks, 0, self._order, out=work.view(self.size, n))
        else:  # 16-bit floats reduced in float32
            work.view(self.size, n).copy_(blocks[self._order])
        part = self._buffer(1, self.num_nodes * n, work_dtype)
        mine = out.reshape(-1) if work_dtype == out.dtype else self._buffer(2, n, work_dtype)

        def body(node: Any, rail: Any) -> None:
            with self._progress:
                node.reduce_scatter(work, op=stage_op, out=part)
            rail.reduce_scatter(part, op=stage_op, out=mine)

        self._staged(body)
        if op == ReduceOp.AVG:
            mine.div_(self.size)
        if mine.data_ptr() != out.data_ptr():
            out.reshape(-1).copy_(mine)

    # ---- not served here (selection never routes these calls to this transport) -------------
    def all_to_all(self, send, send_counts, row_numel, alloc, sig, recv_counts=None):  # noqa: ANN001
        return self.flat.all_to_all(send, send_counts, row_numel, alloc, sig, recv_counts=recv_counts) \
            if self.flat.takes_recv_counts else self.flat.all_to_all(send, send_counts, row_numel, alloc, sig)

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        self.flat.broadcast(send, out, src, sig)

    def barrier(self, sig: Signature) -> None:
        self.flat.barrier(sig)

    def close(self) -> None:
        self._scratch.clear()
        self._progress.close()
        self._close_groups()
