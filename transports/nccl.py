"""``nccl``: CUDA tensors through the real NCCL library, via ``cupy.cuda.nccl``.

cupy's binding loads the libnccl of ``nvidia-nccl-cu12`` (or the host's). Every call is
enqueued on the caller's current torch CUDA stream with no device-wide synchronisation and
no host round trip, so it can be captured in a CUDA graph; the one exception is uneven
all-to-all, whose receive counts must reach the host to size the output (one count exchange,
then grouped send/recv).

Agreement of call signatures across ranks is checked over the host rendezvous the first
time each signature is used (``MOECOMM_NCCL_CHECK=always``: every call, which costs a host
round trip and cannot be graph-captured). NCCL itself never validates arguments.

Device: the transport opens NCCL on ``GroupInfo.cuda_device`` (the communicator binds each rank to
``cuda:local_rank`` unless told otherwise), else on the current device.

STATUS: run on one H100 by ``moecomm validate-gpu`` (cupy-cuda13x 14.2.0; NCCL 2.28.9 at one rank,
2.30.7 at two ranks sharing the GPU): benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-notes.md.
The GPU tests in tests/test_nccl.py skip without a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ._host import group_settings
from .base import (
    Allocator,
    CollectiveTimeoutError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
    check_recv_counts,
    rendezvous_metas,
)

log = logging.getLogger(__name__)

# ncclDataType_t / ncclRedOp_t values (nccl.h); bool travels as uint8 (max/min = or/and on 0/1).
NCCL_DTYPES = {torch.uint8: 1, torch.bool: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}


def nccl_module():
    """cupy.cuda.nccl, or None with the reason logged (no GPU, no cupy, no libnccl)."""
    if not torch.cuda.is_available():
        return None
    try:
        from cupy.cuda import nccl

        nccl.get_version()
        return nccl
    except Exception as e:  # noqa: BLE001 - ImportError, missing libnccl, driver errors
        log.info("NCCL unavailable: %s (pip install 'moecomm[cuda12]')", e)
        return None


def nccl_version() -> tuple[int, int, int] | None:
    nccl = nccl_module()
    if nccl is None:
        return None
    v = nccl.get_version()
    return (v // 10000, (v // 100) % 100, v % 100) if v >= 10000 else (v // 1000, (v // 100) % 10, v % 100)


def encode_unique_id(uid: bytes | tuple) -> bytes:
    """The NCCL unique id as it travels over the rendezvous, its type kept: cupy < 14 returns a tuple
    of 128 small ints, cupy 14 ``bytes`` (seen with cupy-cuda13x 14.2.0), and
    ``NcclCommunicator`` takes back what ``get_unique_id`` gave."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + np.asarray(uid, dtype=np.int64).tobytes()


def encode_unique_id_failure(error: BaseException) -> bytes:
    """What a root that could not make the id sends instead, so every rank raises its error
    (:func:`decode_unique_id`) in the same exchange instead of waiting out of step."""
    return b"E" + f"{type(error).__name__}: {error}".encode()


def decode_unique_id(blob: bytes, root: int) -> bytes | tuple:
    """Inverse of :func:`encode_unique_id` and :func:`encode_unique_id_failure`; raises RuntimeError
    with the root's error if it sent one."""
    kind, body = blob[:1], blob[1:]
    if kind == b"B":
        return body
    if kind == b"T":
        return tuple(int(v) for v in np.frombuffer(body, dtype=np.int64))
    why = body.decode(errors="replace") if kind == b"E" else f"an unreadable id ({blob[:8]!r}...)"
    raise RuntimeError(f"rank {root} could not make the NCCL unique id: {why}")


class NCCLTransport(Transport):
    name = "nccl"
    devices = ("cuda",)

    def __init__(self, group: GroupInfo):
        super().__init__(group)
        nccl = nccl_module()
        if nccl is None:
            raise RuntimeError("NCCL is not available (needs a GPU, cupy and libnccl)")
        self.nccl = nccl
        self.device = group.cuda_device if group.cuda_device is not None else torch.cuda.current_device()
        payload = b""
        if self.rank == 0:  # a failure here still takes part in the exchange, so no peer waits out of step
            try:
                payload = encode_unique_id(nccl.get_unique_id())
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
                payload = encode_unique_id_failure(e)
        unique_id = decode_unique_id(group.rendezvous.allgather_bytes(payload)[0], group.global_ranks[0])
        with torch.cuda.device(self.device):
            self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self._checked: set[int] = set()
        self._check_always = group_settings(group)["nccl_check"] == "always"
        self._ranks = list(group.global_ranks)
        log.debug("nccl transport up on cuda:%d, rank %d/%d", self.device, self.rank, self.size)

    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        return {OpCode.ALL_TO_ALL: "grouped_send_recv"}.get(opcode, "nccl")

    # ---- agreement over the host rendezvous -----------------------------------------------
    def exchange_meta(self, sig: Signature) -> np.ndarray:
        # a peer in all_to_all with recv_counts sends its counts after its signature: only the signatures
        return rendezvous_metas(self.group.rendezvous, sig)[0]

    def _agree(self, sig: Signature) -> None:
        if sig.value in self._checked and not self._check_always:
            return
        check_agreement(self.exchange_meta(sig), self._ranks)
        self._checked.add(sig.value)

    def _agree_with_counts(self, sig: Signature, send_counts: list[int], recv_counts: list[int]) -> None:
        """:meth:`_agree` for all_to_all with recv_counts: the same host exchange also carries every
        rank's send and declared receive counts, checked whenever the signature is (first use of
        the signature, or every call with MOECOMM_NCCL_CHECK=always)."""
        if sig.value in self._checked and not self._check_always:
            return
        counts = np.asarray([send_counts, recv_counts], dtype=np.int64)
        metas, raw = rendezvous_metas(self.group.rendezvous, sig, counts.tobytes())
        # a peer without recv_counts sent its signature alone: check_agreement names that difference
        check_agreement(metas, self._ranks)
        every = np.stack([np.frombuffer(b, dtype=np.int64, offset=sig.meta.nbytes).reshape(2, -1) for b in raw])
        sent, declared = every[:, 0], every[:, 1]
        if not (declared == sent.T).all():
            check_recv_counts(sent.tolist(), declared.tolist(), self._ranks)
        self._checked.add(sig.value)

    def barrier(self, sig: Signature) -> None:
        # A device barrier: a 1-element all-reduce, waited for on the host with the timeout.
        check_agreement(self.exchange_meta(sig), self._ranks)
        x = torch.zeros(1, device=self.device)
        self.comm.allReduce(x.data_ptr(), x.data_ptr(), 1, NCCL_DTYPES[torch.float32], 0, self._stream())
        self._host_wait("barrier")

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _host_wait(self, what: str) -> None:
        """Wait on the host for the work queued so far, bounded by the timeout; abort NCCL on expiry."""
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + self.group.timeout
        sleep = 1e-5
        while not ev.query():
            if time.monotonic() >= deadline:
                self.comm.abort()
                raise CollectiveTimeoutError(
                    f"nccl {what} did not complete within {self.group.timeout:.1f}s on rank "
                    f"{self._ranks[self.rank]}; the NCCL communicator was aborted")
            time.sleep(sleep)
            sleep = min(2 * sleep, 1e-3)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self.comm.allReduce(send.data_ptr(), out.data_ptr(), send.numel(), NCCL_DTYPES[send.dtype], NCCL_OPS[op],
                            self._stream())

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        self._agree(sig)
        self.comm.allGather(send.data_ptr(), out.data_ptr(), send.numel(), NCCL_DTYPES[send.dtype], self._stream())

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self.comm.reduceScatter(send.data_ptr(), out.data_ptr(), out.numel(), NCCL_DTYPES[send.dtype],
                                NCCL_OPS[op], self._stream())

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        self._agree(sig)
        self.comm.broadcast(send.data_ptr(), out.data_ptr(), send.numel(), NCCL_DTYPES[send.dtype], src,
                            self._stream())

    takes_recv_counts = True

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature, recv_counts: list[int] | None = None) -> torch.Tensor:
        """See :meth:`Transport.all_to_all`.

        Without ``recv_counts``: one count exchange on the device, then a host synchronisation
        to size the output, then the grouped send/recv of the rows.

        With ``recv_counts``: no count exchange and no host synchronisation after the first call
        of a signature (not yet run on a GPU, nor tried under CUDA-graph capture). What is
        checked: the first call of each call signature (dtype, trailing dims, recv_counts given),
        like every signature of this transport, swaps every rank's send and receive counts over
        the host rendezvous with the signature, and a wrong value raises ValueError on every
        rank; with MOECOMM_NCCL_CHECK=always every call is checked so. The check is keyed by the
        call signature, which is the same on every rank, not by each rank's own (send, recv)
        counts: those differ across ranks, so a per-rank "counts seen before" cache would send
        some ranks into the host exchange while others skip it, and hang them. What is NOT
        checked: later calls of an already checked signature. Their counts change from call to
        call, and checking them would cost the host round trip that recv_counts exists to avoid,
        so a wrong count there pairs an NCCL send with a receive of another size (undefined: a
        hang or wrong rows). Set MOECOMM_NCCL_CHECK=always while debugging counts.
        """
        if recv_counts is not None:
            self._agree_with_counts(sig, send_counts, recv_counts)
            out = alloc(list(recv_counts))
            self._send_recv(send, list(send_counts), out, list(recv_counts), send.dtype, row_numel, self._stream())
            return out
        self._agree(sig)
        n = self.size
        stream = self._stream()
        sc = torch.from_numpy(np.ascontiguousarray(send_counts, dtype=np.int64)).to(self.device, non_blocking=True)
        rc = torch.empty(n, dtype=torch.int64, device=self.device)
        self._send_recv(sc, [1] * n, rc, [1] * n, torch.int64, 1, stream)
        recv_counts = rc.cpu().numpy()  # the one host synchronisation: it sizes the output
        out = alloc(recv_counts.tolist())
        self._send_recv(send, list(send_counts), out, recv_counts.tolist(), send.dtype, row_numel, stream)
        return out

    def _send_recv(self, send, send_counts, recv, recv_counts, dtype, row_numel, stream) -> None:
        nccl, dt = self.nccl, NCCL_DTYPES[dtype]
        item = send.element_size()
        s_off = r_off = 0
        nccl.groupStart()
        try:
            for peer in range(self.size):
                sc, rcnt = send_counts[peer] * row_numel, recv_counts[peer] * row_numel
                if sc:
                    self.comm.send(send.data_ptr() + s_off * item, sc, dt, peer, stream)
                if rcnt:
                    self.comm.recv(recv.data_ptr() + r_off * item, rcnt, dt, peer, stream)
                s_off += sc
                r_off += rcnt
        finally:
            nccl.groupEnd()

    def abort(self, why: str) -> None:
        # ncclCommAbort: stops kernels still waiting for peers; destroy would wait for them
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - closing anyway
                log.debug("nccl abort failed", exc_info=True)

    def close(self) -> None:
        if getattr(self, "comm", None) is not None:
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001
                pass
            self.comm = None
