"""``ipc``: collectives by our own Triton kernels over every rank's peer-mapped buffer (one node).

Symmetric memory: each rank owns a *region* ::

    [signal area: layout.SIGNAL_WORDS int64 words][data buffer: ipc_buffer_bytes]
    [Lamport slots][symmetric heap: ipc_symmetric_bytes]

and every rank maps every region. Kernels get tables of all ranks' buffer and signal-area
addresses, stage their input in their own buffer, meet the peers in an in-kernel epoch barrier
(release/acquire at system scope) and read the peers' buffers directly
(:mod:`transports.kernels`). Messages larger than a buffer go in chunks, one launch each.

Two providers map the regions (:mod:`transports._ipc_regions`):

- ``cuda``: one ``cudaMalloc`` region per rank, shared with ``cudaIpcGetMemHandle`` /
  ``cudaIpcOpenMemHandle`` (cupy) over the group's rendezvous, closed on close. Ranks of one GPU
  work too (CUDA IPC between processes of one device). Run on an H100 with two ranks on one GPU
  (every collective x dtype x op, CUDA graphs, the timeout path: benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-notes.md); between GPUs it is
  untried. CI proves the kernels through the emulated provider below.
- ``host`` (emulation, ``MOECOMM_IPC_EMULATE=1``): one POSIX shared-memory segment for the
  group (mode 0600, random name, unlinked once mapped; :mod:`transports._segment`), and the same
  kernels run by Triton's interpreter (``TRITON_INTERPRET=1``), where pointers are host
  addresses. The transport then serves CPU tensors.

Agreement without a host round trip: every kernel writes the call's signature digest (and full
signature) into its signal area before the first barrier and compares the peers' digests after
it; on a difference it moves no data, passes its remaining barrier and sets MISMATCH, and the
host raises :func:`check_agreement`'s ``ValueError`` from the peers' signatures. A rank that
rejects its own input meets its peers' call where that call meets (:meth:`IPCTransport.reject_call`),
so they raise at once too. Read only at a later call (a GPU's asynchronous errors), a difference
ends the transport on every rank: raised there, the ranks would leave at different calls.

Never hang: waits in the kernels are bounded and stop when this rank's ABORT word is set. A
watchdog thread per transport sets it while our kernels are in flight (launched, by the host's
count, and not yet DONE, by the status block) when a peer's process dies, a peer closes or aborts,
or DONE has not moved for the communicator's timeout. ``close()`` gives calls still in flight a
short grace to finish, then abandons them: it sets STATE and ABORT, waits (bounded) for our kernels to end, and only then unmaps, leaking the
regions rather than unmapping them under a kernel that has not ended (:meth:`IPCTransport.close`).

Errors are asynchronous, as NCCL's are: the kernels write ERROR, MISMATCH and DONE into this rank's
*status block*, pinned host-mapped memory (:mod:`transports._ipc_regions`), and the host reads it
with plain loads before each launch and at :meth:`IPCTransport.synchronize`, never waiting for the
stream per call. A failure raises ``PeerFailedError`` / ``CollectiveTimeoutError`` naming the rank
at the next call or at ``synchronize()``; the host then marks its STATE aborted (so the peers raise
too) and refuses later calls (``CommunicatorBrokenError``). In emulation the launch returns when
the kernel has ended, so the host reads the status right after it (``eager_check``).

Launches are pre-bound (:mod:`transports._ipc_launch`): the JIT compiles a kernel once per
argument types, then its launcher is called directly; a repeated all_reduce has a by-address
``latency_call``. Small float all_reduces take a Lamport one-shot (:mod:`transports.kernels.lamport`):
one kernel, no barrier, each rank's data pushed into its peers' slots, where the data words carry
their own arrival. ``symmetric_empty`` tensors live in a symmetric heap at the end of every region
and are all-reduced where they are, without a copy into the staging buffer.

Known limits: between GPUs it is untried, and nothing of the lazy error path, the pre-bound launch,
the Lamport kernel or the symmetric heap has run on a GPU yet: CI proves them in emulation. CUDA-graph
replays run kernels the host does not count; the watchdog then only bounds what it sees (the
in-kernel waits stay bounded). A signature's device copy is made on its first call, so warm a call
up before capturing it. Copy collectives move bytes (uint8 tiles); all_to_all reads the counts on
the host because its output is allocated there (and compares ``recv_counts=`` with them there, in
the same read).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from typing import Any, Callable

import numpy as np
import torch

from ._host import group_settings
from ._ipc_all_to_all import IPCAllToAll
from ._ipc_failures import IPCFailures, input_error, pairing_error
from ._ipc_launch import BoundKernel, Pointer, _variant, launch, pointer_variant
from ._ipc_memory import _REGION_ALIGN, IPCMemory, _align, _SymmetricHeap
from ._ipc_teardown import IPCTeardown
from ._ipc_regions import _CudaRegions, _HostRegions, cuda_bytes
from ._schedule import windows
from .base import (
    F_OPCODE,
    META_LEN,
    CollectiveTimeoutError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
    rendezvous_metas,
)
from .kernels import layout as L

__all__ = ["IPCTransport", "input_error", "ipc_available", "load_kernels", "pairing_error"]

log = logging.getLogger(__name__)

assert L.META_WORDS == META_LEN and (L.META_OPCODE, L.LOCAL_ERROR) == (F_OPCODE, OpCode.LOCAL_ERROR)

# all_reduce: one-shot (every rank reduces the whole message from all buffers) up to this many
# bytes, two-shot (reduce-scatter + all-gather through the buffers) above; world size 2 always
# one-shot. From vLLM's custom all-reduce (csrc/custom_all_reduce.cuh, see shared ANCHORS.md):
# 512 KiB for up to 4 GPUs, 256 KiB for up to 8. Not measured by us: no GPU run has tuned them yet.
ONE_SHOT_MAX_BYTES: dict[int, float] = {1: math.inf, 2: math.inf, 3: 512 << 10, 4: 512 << 10,
                                        5: 256 << 10, 6: 256 << 10, 7: 256 << 10, 8: 256 << 10}
ONE_SHOT_MAX_BYTES_DEFAULT = 256 << 10

# Launch shape: one program under the interpreter (it runs programs one after another; fewer,
# larger tiles mean fewer Python steps); on a GPU enough programs to keep several SMs copying.
EMULATED_PROGRAMS, EMULATED_BLOCK = 1, 4096
CUDA_PROGRAMS, CUDA_BLOCK = 16, 1024
# Lamport one-shot all_reduce (float32/16, bfloat16): elements per source a slot holds (its
# largest call). 32768: a 64 KiB bfloat16 message, the small-message range of TP decoding.
CUDA_LAMPORT_ELEMS, EMULATED_LAMPORT_ELEMS = 32768, 4096
# and the largest message it takes, by world size (bytes of one rank's input; min with the slot).
# TensorRT-LLM's Lamport one-shot serves TP decoding messages up to this size (shared ANCHORS.md);
# not measured by us: no GPU run has timed it yet.
LAMPORT_MAX_BYTES: dict[int, int] = {2: 64 << 10, 3: 64 << 10, 4: 64 << 10}
LAMPORT_MAX_BYTES_DEFAULT = 32 << 10
_LAMPORT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the fused all_reduce + RMSNorm holds a row in one tile of a program (TP hidden sizes reach 8192-16384)
RMSNORM_MAX_HIDDEN = 16384
TWO_SHOT_ALIGN = 16  # elements; parts of a two-shot all_reduce start at multiples of it
_SPINS_PER_SECOND = 1_000_000  # bound of an in-kernel wait: >= 1 us a turn on every device

_kernels_lock = threading.Lock()


def load_kernels(emulate: bool) -> Any:
    """The kernel module, compiled for the GPU or run by Triton's interpreter (``emulate``).

    ``triton.jit`` decides between the two when the kernels are defined, from
    ``TRITON_INTERPRET``: emulation sets it before the first import. Raises RuntimeError when
    this process already loaded them the other way.
    """
    with _kernels_lock:
        if emulate:
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            from .kernels import collectives as kernels
        except ImportError as e:
            raise RuntimeError(f"the ipc transport needs triton ({e}); pip install triton") from None
        from triton.runtime.interpreter import InterpretedFunction

        try:
            from .kernels import lamport, moe_ll
        except ImportError:  # pragma: no cover - the modules ship with the package
            lamport = moe_ll = None
        kernels.lamport = lamport
        kernels.moe_ll = moe_ll
        interpreted = isinstance(kernels.all_reduce_one_shot, InterpretedFunction)
        if interpreted != emulate:
            raise RuntimeError(
                "the ipc kernels were already loaded " + ("by Triton's interpreter" if interpreted else "for the GPU")
                + " in this process; " + ("GPU" if not emulate else "emulated")
                + " ipc needs a fresh process (TRITON_INTERPRET is read when the kernels are defined)")
        return kernels


def ipc_available(settings: dict) -> bool:
    """Whether this process could create an ipc transport (cheap; no CUDA context, no triton import).

    settings: resolved transports.settings values. Emulation needs triton; the GPU path needs
    triton, cupy and a CUDA device. The communicator creates ipc only where every rank says yes.
    """
    return ipc_why_not(settings) is None


def ipc_why_not(settings: dict) -> str | None:
    """Why :func:`ipc_available` says no, in one line, or None when it says yes."""
    from importlib.util import find_spec

    if find_spec("triton") is None:
        return "no triton (pip install triton)"
    if settings.get("ipc_emulate"):
        return None
    if find_spec("cupy") is None:
        return "no cupy (pip install \"moecomm[cuda13]\" or [cuda12])"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    return None


def _at(addr: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [numel] tensor of ``dtype`` at ``addr``: a CPU view of host memory (emulation); on a GPU
    the memory of a tensor the caller holds, found through torch's allocator-independent DLPack."""
    nbytes = numel * dtype.itemsize
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=dtype, count=numel)
    return cuda_bytes(addr, nbytes, device).view(dtype)


# ---- the transport ----------------------------------------------------------------------------
_ACC = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float32", torch.bfloat16: "float32",
        torch.int64: "int64", torch.int32: "int32", torch.uint8: "int32", torch.bool: "int32"}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class IPCTransport(IPCFailures, IPCMemory, IPCAllToAll, IPCTeardown, Transport):
    """Collectives by Triton kernels over peer-mapped buffers (see the module docstring). Failure
    detection, memory beyond the staging buffer, all_to_all and teardown are in mixins of their
    own modules (``transports/_ipc_*.py``); the launch path and the reductions are here."""

    name = "ipc"
    devices: tuple[str, ...] = ("cuda",)

    def __init__(self, group: GroupInfo, *, buffer_bytes: int | None = None, emulate: bool | None = None,
                 programs: int | None = None, block: int | None = None,
                 one_shot_max_bytes: int | None = None, lamport_elems: int | None = None,
                 lamport_max_bytes: int | None = None, symmetric_bytes: int | None = None,
                 eager_check: bool | None = None):
        """Map every rank's region (collective over ``group``).

        Args:
            group: the group; every rank on one node, at most ``layout.MAX_RANKS`` ranks.
            buffer_bytes: data buffer per rank (default: setting ``ipc_buffer_bytes``), rounded up to 4 KiB.
            emulate: host provider + Triton interpreter for CPU tensors (default: setting ``ipc_emulate``).
            programs, block: launch shape (programs per kernel, elements per tile); for tests.
            one_shot_max_bytes: largest one-shot all_reduce (default: :data:`ONE_SHOT_MAX_BYTES`).
            lamport_elems: elements per source of a Lamport slot (0: no Lamport all_reduce).
            lamport_max_bytes: largest Lamport all_reduce (default: :data:`LAMPORT_MAX_BYTES`).
            symmetric_bytes: symmetric heap per rank (default: setting ``ipc_symmetric_bytes``).
            eager_check: read the status block after every launch (default: in emulation, where the
                launch returns when the kernel ended); False: only at the next call and at
                :meth:`synchronize`, as on a GPU.
        """
        super().__init__(group)
        settings = group_settings(group)
        n = self.size
        if not group.single_node:
            raise RuntimeError("the ipc transport needs every rank of the group on one node")
        if group.pids and len(set(group.pids)) < n:
            # CUDA cannot open a process's own IPC handle, and Triton's interpreter keeps the program
            # index of a launch in global state, so ranks that are threads of one process cannot share it
            raise RuntimeError("the ipc transport needs one process per rank (these ranks share a process)")
        if n > L.MAX_RANKS:
            raise RuntimeError(f"the ipc transport serves at most {L.MAX_RANKS} ranks, not {n}")
        self.emulate = bool(settings["ipc_emulate"]) if emulate is None else bool(emulate)
        if self.emulate:
            self.devices = ("cpu",)
        elif not torch.cuda.is_available():
            raise RuntimeError("the ipc transport serves CUDA tensors and CUDA is not available "
                               "(MOECOMM_IPC_EMULATE=1 emulates it on the CPU)")
        self._k = load_kernels(self.emulate)
        self.buffer_bytes = _align(int(buffer_bytes or settings["ipc_buffer_bytes"]), _REGION_ALIGN)
        self.programs = int(programs or (EMULATED_PROGRAMS if self.emulate else CUDA_PROGRAMS))
        if not 1 <= self.programs <= L.MAX_PROGRAMS:
            raise ValueError(f"programs must be in 1..{L.MAX_PROGRAMS}, got {self.programs}")
        self.block = int(block or (EMULATED_BLOCK if self.emulate else CUDA_BLOCK))
        self.one_shot_max = one_shot_max_bytes if one_shot_max_bytes is not None else ONE_SHOT_MAX_BYTES.get(
            n, ONE_SHOT_MAX_BYTES_DEFAULT)
        self.timeout = group.timeout
        self._ranks = list(group.global_ranks)
        self._pids = list(group.pids)
        self._max_spins = min(int(self.timeout * _SPINS_PER_SECOND) + 1, 1 << 62)
        self.lamport_elems = int(lamport_elems if lamport_elems is not None else
                                 EMULATED_LAMPORT_ELEMS if self.emulate else CUDA_LAMPORT_ELEMS)
        if self._k.lamport is None:
            self.lamport_elems = 0
        self.lamport_max = min(self.lamport_elems * 2, lamport_max_bytes if lamport_max_bytes is not None else
                               LAMPORT_MAX_BYTES.get(n, LAMPORT_MAX_BYTES_DEFAULT))
        self.symmetric_bytes = _align(int(settings["ipc_symmetric_bytes"] if symmetric_bytes is None
                                          else symmetric_bytes), _REGION_ALIGN)
        # region: [signal words][staging buffer][Lamport slots][symmetric heap]
        self._lam_off = L.SIGNAL_WORDS * 8 + self.buffer_bytes
        lam_bytes = _align(L.LAMPORT_SLOTS * L.lamport_slot_bytes(self.lamport_elems), _REGION_ALIGN) \
            if self.lamport_elems else 0
        self._heap_off = self._lam_off + lam_bytes
        provider = _HostRegions if self.emulate else _CudaRegions
        self._regions = provider(group, self._heap_off + self.symmetric_bytes,
                                 (self._lam_off, L.lamport_image(self.lamport_elems)) if lam_bytes else None)
        self._device = self._regions.device
        self._status = self._regions.status  # host view of our status block (kernels write it)
        self._status_arg = self._regions.status_arg
        self._lam_ptrs = self._regions.sig_ptrs + self._lam_off
        self._heap_lo = self._regions.own_addr + self._heap_off
        self._heap_hi = self._heap_lo + self.symmetric_bytes
        self._heap = _SymmetricHeap(self.symmetric_bytes)
        self._heap_tables: dict[int, torch.Tensor] = {}
        self._more_regions: list = []  # peer_region()s
        self.eager_check = self.emulate if eager_check is None else bool(eager_check)
        self._bound: dict[tuple, BoundKernel] = {}
        self._meta_cache: dict[bytes, torch.Tensor] = {}
        self._broken: str | None = None
        self._pending: tuple[type, str, list[int]] | None = None  # a peer failed after our calls completed
        # kernels launched eagerly (the host's count) against the status block's DONE (the kernels'):
        # work is in flight while launched + _extra > DONE; _extra (watchdog only) absorbs kernels
        # that CUDA-graph replays ran without the host
        self._launched = 0
        self._extra = 0
        self._progress: tuple[float, int] | None = None  # (when DONE last moved, its value) while in flight
        self._reason: tuple[type, str, list[int]] | None = None
        self._watch_lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"moecomm-ipc-watchdog-{self._ranks[self.rank]}",
                                          daemon=True)
        self._watchdog.start()
        # CUDA: auto-selection routes calls to ipc or nccl by size, so ranks whose sizes wrongly differ
        # can sit in different transports; both compare signatures over the rendezvous on the first
        # call of each signature (as nccl does), so they meet there and raise the ValueError.
        self._agree_on_host = not self.emulate
        self._host_agreed: set[int] = set()
        try:
            self._probe_peers()
        except BaseException:
            self.close()
            raise
        log.debug("ipc transport up: %s provider, %d ranks, buffer %d B, %d programs x %d",
                  "host" if self.emulate else "cuda", n, self.buffer_bytes, self.programs, self.block)

    def _probe_peers(self) -> None:
        """Read every peer's buffer through the kernels once, at creation.

        A reported P2P capability can be wrong (vLLM probes for real for that reason): every rank
        all-gathers a random token through its kernels and compares it with the tokens exchanged
        over the rendezvous. A rank that reads anything else fails the transport's creation, and
        the communicator then drops ipc on every rank.
        """
        token = int.from_bytes(os.urandom(8), "little") >> 2
        tokens = [int.from_bytes(b, "little") for b in self.group.rendezvous.allgather_bytes(token.to_bytes(8, "little"))]
        send = torch.tensor([token], dtype=torch.int64, device=self._device)
        out = torch.empty(self.size, dtype=torch.int64, device=self._device)
        self.all_gather(send, out, Signature.of(OpCode.ALL_GATHER, dtype=torch.int64, shape=(1,)))
        self.synchronize()
        got = out.tolist()
        if got != tokens:
            bad = [self._ranks[r] for r in range(self.size) if got[r] != tokens[r]]
            raise RuntimeError(f"ipc P2P probe failed on rank {self._ranks[self.rank]}: the data read from "
                               f"rank(s) {bad}'s buffers was wrong (peer access reported but not working)")

    # ---- launching -----------------------------------------------------------------------------
    def _meta(self, sig: Signature) -> torch.Tensor:
        key = sig.meta.tobytes()
        t = self._meta_cache.get(key)
        if t is None:
            if len(self._meta_cache) > 256:
                self._meta_cache.clear()
            t = self._meta_cache[key] = torch.from_numpy(sig.meta.copy()).to(self._device)
        return t

    def _bind(self, kernel: Any, constants: dict) -> BoundKernel:
        key = (kernel, *sorted(constants.items()))
        b = self._bound.get(key)
        if b is None:
            if len(self._bound) > 256:
                self._bound.clear()
            b = self._bound[key] = BoundKernel(kernel, self.programs, constants, self.emulate)
        return b

    def _launch(self, kernel: Any, *args: Any, **constants: Any) -> None:
        """Launch one kernel on our programs (pre-bound, :mod:`transports._ipc_launch`).

        Before it, raise what earlier kernels left in the status block; after it, only when
        ``eager_check`` (emulation: the kernel has ended when the launch returns). On a GPU the
        host never waits for the stream here.
        """
        self._start()
        self._queue(self._bind(kernel, constants), *args)
        if self.eager_check:
            self._check(completed=True)

    def _start(self) -> None:
        """Before a launch: refuse when broken, raise earlier failures, count the launch."""
        if self._broken:
            self._raise_broken()
        self._check()
        if not self._regions.capturing():  # a captured kernel runs at replays, which the host does not see
            self._launched += 1

    def _queue(self, bound: Callable[..., None], *args: Any) -> None:
        """``bound(*args)``, a launch that :meth:`_start` counted: uncounted if it raises. (The
        latency path inlines the same.)"""
        try:
            bound(*args)
        except BaseException:
            self._not_launched()
            raise

    def _not_launched(self) -> None:
        """A launch that :meth:`_start` counted raised instead (a compile error, an interrupt): uncount
        it, or the watchdog would take it for a kernel stuck in flight and close() would wait for it."""
        if not self._regions.capturing():
            self._launched -= 1

    def _peer_metas(self) -> np.ndarray:
        return self._regions.read(self.rank, L.PEER_META, self.size * META_LEN).reshape(self.size, META_LEN)

    def _common(self, sig: Signature, host_check: bool = False) -> tuple:
        """The kernels' common arguments; on the first call of a signature (GPU, or ``host_check``)
        compare it with the peers' over the rendezvous first."""
        if (self._agree_on_host or host_check) and sig.value not in self._host_agreed:
            try:
                metas = rendezvous_metas(self.group.rendezvous, sig)[0]
            except CollectiveTimeoutError as e:
                missing = list(e.missing_ranks or [])
                raise CollectiveTimeoutError(
                    f"ipc collective timed out on rank {self._ranks[self.rank]} after the timeout of "
                    f"{self.timeout:.1f}s: {', '.join(f'rank {r}' for r in missing) or 'a rank'} never arrived "
                    "(the first call of a signature compares it on the host)", missing) from e
            check_agreement(metas, self._ranks)
            self._host_agreed.add(sig.value)
        r = self._regions
        return (r.data_ptrs, r.sig_ptrs, self._status_arg, self.rank, self.size, sig.value, self._meta(sig),
                self._max_spins)

    def _chunks(self, count: int, itemsize: int, parts: int = 1) -> list[tuple[int, int]]:
        return windows(count, max(1, self.buffer_bytes // itemsize // parts))

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1)
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    def _reduce_constants(self, dtype: torch.dtype, op: ReduceOp) -> dict:
        import triton.language as tl

        if dtype not in _ACC:
            raise TypeError(f"ipc cannot reduce {dtype}")
        if dtype == torch.bool and op in (ReduceOp.SUM, ReduceOp.AVG):
            op = ReduceOp.MAX  # any
        return dict(ACC=getattr(tl, _ACC[dtype]), OP=int(op), IS_FLOAT=dtype in _FLOATS,
                    OUT_BF16=dtype == torch.bfloat16, BLOCK=self.block)

    # ---- capabilities --------------------------------------------------------------------------
    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        if opcode == OpCode.ALL_REDUCE:
            if self._lamport_takes(nbytes, dtype):
                return "lamport"
            return "one_shot" if nbytes <= self.one_shot_max else "two_shot"
        return {OpCode.ALL_GATHER: "pull", OpCode.REDUCE_SCATTER: "pull_reduce", OpCode.ALL_TO_ALL: "pull",
                OpCode.BROADCAST: "pull", OpCode.BARRIER: "flags"}.get(opcode, "flags")

    # ---- collectives ---------------------------------------------------------------------------
    def exchange_meta(self, sig: Signature) -> np.ndarray:
        self._start()
        self._queue(self._bind(self._k.barrier_kernel, {"COPY_META": True}), *self._common(sig)[1:])
        self._regions.sync()  # an error path: the host reads the peers' signatures now
        self._status[L.S_MISMATCH] = 0  # differences are the point here
        self._check()
        return self._peer_metas()

    def barrier(self, sig: Signature) -> None:
        self._launch(self._k.barrier_kernel, *self._common(sig)[1:], COPY_META=False)

    def _lamport_takes(self, nbytes: int, dtype: torch.dtype) -> bool:
        return dtype in _LAMPORT_DTYPES and 0 < nbytes <= self.lamport_max and \
            nbytes // dtype.itemsize <= self.lamport_elems

    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        x, y = self._flat(send), self._flat(out)
        const = self._reduce_constants(send.dtype, op)
        common = self._common(sig, host_check=True)  # sizes that wrongly differ may pick Lamport on some ranks only
        nbytes = send.numel() * send.element_size()
        if self._lamport_takes(nbytes, send.dtype):
            self._lamport_all_reduce(x, y, const, sig)
            return
        sym = self._symmetric_offset(x)
        if sym is not None:  # no copy into the staging buffer: the kernels read the peers' tensors
            table = self._heap_table(sym)
            if x.data_ptr() == y.data_ptr():
                kernel, const["ALIGN"] = self._k.all_reduce_two_shot, TWO_SHOT_ALIGN
            else:
                kernel = self._k.all_reduce_one_shot
            self._launch(kernel, x, y, x.numel(), table, *common[1:], **const, STAGE=False)
            return
        if nbytes <= self.one_shot_max:
            kernel = self._k.all_reduce_one_shot
        else:
            kernel, const["ALIGN"] = self._k.all_reduce_two_shot, TWO_SHOT_ALIGN
        for lo, hi in self._chunks(x.numel(), x.element_size()):
            self._launch(kernel, x[lo:hi], y[lo:hi], hi - lo, *common, **const, STAGE=True)

    def latency_call(self, opcode: OpCode, numel: int, dtype: torch.dtype, op: ReduceOp | None, sig: Signature
                     ) -> Callable[[int, int], None] | None:
        """See :meth:`Transport.latency_call`: a repeated all_reduce that fits one launch, by
        address, with everything but the two pointers prepared: the status check, the launch
        count and the compiled kernel's launcher (after the first call) are all that run.
        Symmetric tensors take :meth:`all_reduce`."""
        nbytes = numel * dtype.itemsize
        if opcode != OpCode.ALL_REDUCE or numel == 0 or nbytes > self.buffer_bytes:
            return None
        flat = torch.uint8 if dtype == torch.bool else dtype
        const = self._reduce_constants(dtype, op)
        rest = self._common(sig, host_check=True)
        if self._lamport_takes(nbytes, dtype):
            kernel, rest = self._k.lamport.all_reduce_lamport, self._lamport_args(sig)
            const = self._lamport_constants(const)
        else:
            kernel = self._k.all_reduce_one_shot
            if nbytes > self.one_shot_max:
                kernel, const["ALIGN"] = self._k.all_reduce_two_shot, TWO_SHOT_ALIGN
            const["STAGE"] = True
        bound = self._bind(kernel, const)
        start, emulate, heap_lo, heap_hi = self._start, self.emulate, self._heap_lo, self._heap_hi
        # the variant key, as BoundKernel computes it from the arguments: X's and OUT's dtype and
        # alignment, then the fixed rest (a float32 variant must never run float16 data)
        ptr, tail = pointer_variant(flat), _variant((numel, *rest))
        compiled = bound._compiled
        programs = self.programs
        device = self._device.index
        # every parameter's value in order, constexprs in place: the launcher's argument list, of
        # which a call rewrites the two pointers (slots 0 and 1: X and OUT lead every kernel)
        full = bound.full_args((0, 0, numel, *rest))
        assert bound.names[:2] in (["X", "OUT"],), bound.names

        def call(x_addr: int, out_addr: int) -> None:
            if heap_lo <= x_addr < heap_hi:
                self.all_reduce(_at(x_addr, numel, flat, self._device), _at(out_addr, numel, flat, self._device),
                                op, sig)
                return
            start()
            key = (ptr(x_addr), ptr(out_addr), *tail)
            c = compiled.get(key)
            try:
                if c is not None:  # the compiled kernel's launcher, nothing else
                    full[0], full[1] = x_addr, out_addr
                    launch(c, programs, full, device)
                elif emulate:
                    bound(_at(x_addr, numel, flat, self._device), _at(out_addr, numel, flat, self._device), numel,
                          *rest, key=key)
                else:  # the JIT compiles this variant (it types pointers from data_ptr() and dtype)
                    bound(Pointer(x_addr, flat), Pointer(out_addr, flat), numel, *rest, key=key)
            except BaseException:
                self._not_launched()
                raise
            if self.eager_check:
                self._check(completed=True)

        return call

    def fuses_all_reduce_rmsnorm(self, numel: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype
                                 ) -> str | None:
        """"lamport_rmsnorm" where the Lamport all_reduce takes the message (float32/16, bfloat16,
        within the slots) and a row fits one tile; else None (the communicator composes)."""
        if self._k.lamport is None or numel == 0 or dtype not in _LAMPORT_DTYPES:
            return None
        if weight_dtype not in (dtype, torch.float32) or not 0 < hidden <= RMSNORM_MAX_HIDDEN:
            return None
        return "lamport_rmsnorm" if self._lamport_takes(numel * dtype.itemsize, dtype) else None

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out: torch.Tensor, residual_out: torch.Tensor, sig: Signature) -> None:
        """See :meth:`Transport.all_reduce_rmsnorm`: one Lamport kernel reduces each row over the ranks,
        adds the residual and normalizes it (:func:`transports.kernels.lamport.all_reduce_rmsnorm_lamport`).
        x, residual, out, residual_out: [rows, H] contiguous; weight: [H]."""
        import triton

        rows, hidden = x.shape
        self._common(sig, host_check=True)
        const = {"OUT_BF16": x.dtype == torch.bfloat16, "BLOCK_H": triton.next_power_of_2(hidden)}
        self._launch(self._k.lamport.all_reduce_rmsnorm_lamport, x, residual, weight, out, residual_out, rows,
                     hidden, float(eps), *self._lamport_args(sig), **const)

    def _lamport_args(self, sig: Signature) -> tuple:
        """The Lamport kernels' arguments after the tensors and sizes (lam_ptrs .. max_spins)."""
        return (self._lam_ptrs, self._regions.sig_ptrs, self._status_arg, self.rank, self.size, sig.value,
                self._meta(sig), self.lamport_elems, self._max_spins)

    def _lamport_all_reduce(self, x: torch.Tensor, y: torch.Tensor, const: dict, sig: Signature) -> None:
        """One kernel, no barrier: data carry their arrival (:mod:`transports.kernels.lamport`)."""
        self._launch(self._k.lamport.all_reduce_lamport, x, y, x.numel(), *self._lamport_args(sig),
                     **self._lamport_constants(const))

    def _lamport_constants(self, const: dict) -> dict:
        """The Lamport kernel's constexprs from :meth:`_reduce_constants`' (it accumulates in float32)."""
        return {"OP": const["OP"], "OUT_BF16": const["OUT_BF16"], "BLOCK": self.block}

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        x, y = self._flat(send), self._flat(out)
        const = self._reduce_constants(send.dtype, op)
        common = self._common(sig)
        m = y.numel()
        for lo, hi in self._chunks(m, x.element_size(), self.size):
            self._launch(self._k.reduce_scatter, x, y, m, lo, hi - lo, *common, **const)

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        x, y = send.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        common = self._common(sig)
        m = x.numel()
        for lo, hi in self._chunks(m, 1):
            self._launch(self._k.all_gather, x, y, m, lo, hi - lo, *common, BLOCK=self.block)

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        x, y = send.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        common = self._common(sig)
        for lo, hi in self._chunks(x.numel(), 1):
            self._launch(self._k.broadcast, x[lo:hi], y[lo:hi], hi - lo, src, *common, BLOCK=self.block)
