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
import time
from typing import Any, Callable

import numpy as np
import torch

from ._host import group_settings, pid_alive
from ._ipc_launch import BoundKernel, Pointer, _variant, launch, pointer_variant
from ._ipc_regions import _CudaRegions, _HostRegions, cuda_bytes
from ._schedule import all_to_all_pulls, staged_segments, windows
from .base import (
    F_OPCODE,
    F_REDOP,
    META_LEN,
    Allocator,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
    check_recv_counts,
    dtype_code,
    error_meta,
    rendezvous_metas,
)
from .kernels import layout as L

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
_REGION_ALIGN = 4096
_WATCH_PERIOD = 0.02  # seconds between the watchdog's looks at the peers during a call
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
    from importlib.util import find_spec

    if find_spec("triton") is None:
        return False
    if settings.get("ipc_emulate"):
        return True
    return find_spec("cupy") is not None and torch.cuda.is_available()


def input_error(word: int, ranks: list[int], me: int, max_tokens: int | None = None, op: str = "dispatch") -> str:
    """The message of a status block's INPUT word (``err * MAX_RANKS + source``; see
    :mod:`transports.kernels.layout`) of a low-latency ``op``, as rank ``me`` reports it."""
    src, err = ranks[word % L.MAX_RANKS], word // L.MAX_RANKS
    code, detail = err & 255, err >> 8
    limit = "" if max_tokens is None else f" {max_tokens}"
    what = {L.INPUT_TOO_MANY_TOKENS: f"{detail} tokens, more than max_tokens_per_rank{limit}",
            L.INPUT_BAD_ID: f"expert id {detail}, outside [-1, num_experts)",
            L.INPUT_DUPLICATE_ID: f"expert {detail} twice in one token's top-k",
            L.INPUT_STALE_HANDLE: "topk_idx that differ from those its handle's dispatch sent (a stale handle?)",
            }.get(code, "inputs of the wrong shape or dtype")
    return f"low-latency {op}: rank {src} passed {what} (seen by rank {me})"


def pairing_error(op: str, source: int, theirs: int, mine: int, ranks: list[int], me: int) -> str:
    """The message of a low-latency call whose source ``source`` (group rank) sent call word
    ``theirs`` where rank ``me`` (group rank) ran ``mine`` (a word is the dispatch's call number
    * 2 + FP8; a combine carries its handle's dispatch word)."""
    def call(w: int) -> str:
        return f"dispatch #{w >> 1} ({'FP8' if w & 1 else 'no FP8'})"

    src, r = ranks[source], ranks[me]
    if op == "combine":
        why = "every rank must combine the handle of the same dispatch"
        return (f"low-latency combine: rank {src} combined the handle of its {call(theirs)}, rank {r} that of "
                f"its {call(mine)}; {why} (seen by rank {r})")
    why = ("the ranks passed different use_fp8" if theirs >> 1 == mine >> 1 else
           "a rank skipped a call its peers made, or made one they did not")
    return (f"low-latency dispatch: the ranks' calls do not pair: rank {src} sent its {call(theirs)}, rank {r} "
            f"is at its {call(mine)}; {why}; no rows of this call were kept (seen by rank {r})")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _at(addr: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [numel] tensor of ``dtype`` at ``addr``: a CPU view of host memory (emulation); on a GPU
    the memory of a tensor the caller holds, found through torch's allocator-independent DLPack."""
    nbytes = numel * dtype.itemsize
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=dtype, count=numel)
    return cuda_bytes(addr, nbytes, device).view(dtype)


class _SymmetricHeap:
    """First-fit allocation of the symmetric heap's bytes (offsets, 256-byte aligned).

    Every rank runs the same allocations in the same order, so a tensor gets the same offset on
    every rank; :meth:`IPCTransport.symmetric_empty` checks that across ranks.
    """

    ALIGN = 256

    def __init__(self, size: int):
        self.size = size
        self.used: dict[int, int] = {}  # offset -> bytes

    def alloc(self, nbytes: int) -> int | None:
        nbytes = max(self.ALIGN, _align(nbytes, self.ALIGN))
        at = 0
        for off in sorted(self.used):
            if off - at >= nbytes:
                break
            at = off + self.used[off]
        if at + nbytes > self.size:
            return None
        self.used[at] = nbytes
        return at

    def free(self, offset: int) -> None:
        self.used.pop(offset, None)


# ---- the transport ----------------------------------------------------------------------------
_ACC = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float32", torch.bfloat16: "float32",
        torch.int64: "int64", torch.int32: "int32", torch.uint8: "int32", torch.bool: "int32"}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class IPCTransport(Transport):
    """Collectives by Triton kernels over peer-mapped buffers (see the module docstring)."""

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

    # ---- failure detection ----------------------------------------------------------------------
    def _done(self) -> int:
        """Kernels every program has finished (the status block's DONE words)."""
        return int(self._status[L.S_DONE : L.S_DONE + self.programs].min())

    def _busy(self) -> bool:
        """Whether a kernel we launched has not finished yet (read by the host, no copy)."""
        return self._launched + self._extra > self._done()

    def _watch(self) -> None:
        """While our kernels run: abort them when a peer dies, closes or aborts, or when DONE has
        not moved for the timeout; the host raises at its next look (:meth:`_check`)."""
        me = self.rank
        self._regions.bind_thread()
        gone: dict[int, int] = {}  # peer -> DONE when we first saw it gone while in flight
        while not self._stop.wait(_WATCH_PERIOD):
            with self._watch_lock:
                if self._reason is not None:
                    continue
                done = self._done()
                if done > self._launched + self._extra:  # graph replays ran kernels the host did not count
                    self._extra = done - self._launched
                if self._launched + self._extra <= done:
                    self._progress = None
                    gone.clear()
                    continue
                now = time.monotonic()
                if self._progress is None or self._progress[1] != done:
                    self._progress = (now, done)
                reason = aborted = died = None
                try:
                    for r in range(self.size):
                        if r == me:
                            continue
                        dead = r < len(self._pids) and not pid_alive(self._pids[r])
                        if dead and died is None:
                            died = r
                        try:  # a dead exporter's GPU memory may be gone with it
                            state = int(self._regions.read(r, L.STATE, 1)[0])
                        except Exception:  # noqa: BLE001 - then the pid says enough
                            state = L.STATE_RUNNING
                        if state == L.STATE_ABORTED:
                            aborted = aborted if aborted is not None else r
                            continue
                        if (dead or state == L.STATE_CLOSED) and not self._finished_this_call(r):
                            # our kernel may be past its last barrier, ending: a gone peer counts
                            # when DONE has not moved between two looks at it
                            if gone.get(r) != done:
                                gone[r] = done
                                continue
                            why = "closed its communicator" if state == L.STATE_CLOSED else \
                                f"(pid {self._pids[r]}) died"
                            reason = (PeerFailedError, f"rank {self._ranks[r]} {why}", [self._ranks[r]])
                            break
                    if reason is None and aborted is not None:
                        # a peer aborted, usually after another one died: name the dead one, the cause
                        r = aborted if died is None else died
                        why = "aborted after a failure" if died is None else f"(pid {self._pids[r]}) died"
                        reason = (PeerFailedError, f"rank {self._ranks[r]} {why}", [self._ranks[r]])
                    if reason is None and now - self._progress[0] >= self.timeout:
                        reason = (CollectiveTimeoutError, f"timed out after the timeout of {self.timeout:.1f}s", [])
                    if reason is not None:
                        self._reason = reason
                        self._regions.write(me, L.ABORT, 1)
                except Exception:  # noqa: BLE001 - the provider is closing; nothing to watch
                    log.debug("ipc watchdog stopped", exc_info=True)
                    return

    def _finished_this_call(self, r: int) -> bool:
        """Whether peer ``r``, closed or exited, passed a barrier of the running launch that we have
        not, or finished a Lamport all_reduce we have not: it then left after the launch's last
        barrier, or after pushing its data to us, having read all it needs from us; a peer we still
        wait for is another rank (that rank's arrival, death or the timeout decide).

        A peer that closed before it joined the launch is behind or level with us on every program.
        """
        try:
            p = self.programs
            words = (L.EPOCH, L.LAMPORT_CALLS, L.LL_CALLS)
            theirs = np.concatenate([self._regions.read(r, w, p) for w in words])
            ours = np.concatenate([self._regions.read(self.rank, w, p) for w in words])
        except Exception:  # noqa: BLE001 - its memory is gone: treat it as not there
            return False
        return bool((theirs > ours).any())

    def _fail(self, cls: type, message: str, missing: list[int]) -> None:
        self._broken = message
        try:
            self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        raise cls(message, missing)

    def _raise_broken(self) -> None:
        if self._broken == "closed":
            raise CommunicatorBrokenError("the ipc transport of this communicator is closed; create a new communicator")
        raise CommunicatorBrokenError(
            f"ipc communicator is unusable after an earlier failure ({self._broken}); create a new one")

    def _check(self, completed: bool = False) -> None:
        """Raise what our earlier kernels left in the status block, if anything (plain host loads:
        no copy, no stream synchronization). Errors are asynchronous, as NCCL's are: on a GPU a
        failure shows at the next call or at :meth:`synchronize`.

        completed: right after a launch whose kernel has ended (emulation): a peer that failed
        while this call still completed raises at the next call, and this one returns.
        """
        st = self._status
        if st[L.S_ERROR] or st[L.S_MISMATCH] or st[L.S_INPUT] or st[L.S_PAIRING] or self._reason is not None \
                or self._pending is not None:
            self._failed(completed)

    def _failed(self, completed: bool = False) -> None:
        st = self._status
        me = self._ranks[self.rank]
        if self._reason is not None and not st[L.S_ERROR]:
            # the watchdog set ABORT: our kernels end at their next turn; wait for them (bounded)
            deadline = time.monotonic() + max(self.timeout, 1.0)
            while self._busy() and not st[L.S_ERROR] and time.monotonic() < deadline:
                time.sleep(0.001)
        with self._watch_lock:
            reason = self._reason
            error = int(st[L.S_ERROR])
            if error == 0 and reason is not None:  # every call completed all the same
                self._reason = None
                self._progress = None
                self._regions.write(self.rank, L.ABORT, 0)
        if error:
            if error == self.size + 2:  # a Lamport all_reduce met another signature: its slots hold stray data
                self._broken = "signatures differed in a Lamport all_reduce"
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
                st[L.S_MISMATCH] = 0
                check_agreement(self._peer_metas(), self._ranks)
                raise ValueError(f"ipc: call signatures differ across ranks (seen by rank {me} in a Lamport "
                                 "all_reduce); this communicator's ipc transport is closed")
            if error > self.size:  # stopped before it waited for anyone (ABORT was already set)
                cls, msg, missing = reason or (CollectiveTimeoutError, "its abort flag was set", [])
                self._fail(cls, f"{msg}; rank {me} abandoned its ipc collective", missing)
            peer = self._ranks[error - 1]
            if reason is None or reason[0] is CollectiveTimeoutError:
                why = (f"timed out after the timeout of {self.timeout:.1f}s" if reason
                       else "gave up after its bounded wait")
                self._fail(CollectiveTimeoutError,
                           f"ipc collective {why} on rank {me}: rank {peer} never arrived "
                           f"(stuck, deadlocked, or calling a different collective){self._last_calls()}", [peer])
            cls, msg, missing = reason
            self._fail(cls, f"{msg} while rank {me} waited for rank {peer} in an ipc collective", missing)
        if reason is not None and reason[0] is not CollectiveTimeoutError:  # a peer is gone all the same
            self._pending = reason
        if self._pending is not None and not completed:
            cls, msg, missing = self._pending
            self._fail(cls, f"{msg} (seen by rank {me} after its ipc collectives completed)", missing)
        if st[L.S_MISMATCH]:
            st[L.S_MISMATCH] = 0
            if not completed:
                # read at a later call's start (GPU: asynchronous errors): the peers may read theirs at
                # another call, and a rank that skips a call its peers make leaves them waiting, so
                # the transport ends here for every rank (the peers' watchdogs see STATE aborted)
                try:
                    check_agreement(self._peer_metas(), self._ranks)
                    what = "ipc: call signatures differ across ranks"
                except ValueError as e:
                    what = str(e)
                self._broken = what
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
                raise ValueError(f"{what} (seen by rank {me} after that call returned, as asynchronous errors "
                                 "are on a GPU; the ranks could no longer raise at one call): this "
                                 "communicator's ipc transport is closed")
            check_agreement(self._peer_metas(), self._ranks)
            raise ValueError("ipc: call signatures differ across ranks")  # digests differ, words equal
        if st[L.S_INPUT] or st[L.S_PAIRING]:
            # recorded by low-latency MoE kernels that no eager call waited for (CUDA-graph replays):
            # raised lazily, the ranks would leave the exchange at different calls, so it ends here
            if st[L.S_INPUT]:
                what = input_error(int(st[L.S_INPUT]), self._ranks, me)
            else:
                what = (f"low-latency exchange: rank {self._ranks[int(st[L.S_PAIRING]) - 1]} sent a call that does "
                        f"not pair with rank {me}'s")
            st[L.S_INPUT] = st[L.S_PAIRING] = 0
            self._broken = f"{what}, in a CUDA-graph replay"
            self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
            raise ValueError(f"{what}; recorded in a CUDA-graph replay, where the ranks cannot all raise at one "
                             "call: this communicator's ipc transport is closed")

    def _last_calls(self) -> str:
        """After a timeout: the signatures of the calls every rank last started, where they differ
        (each kernel publishes its call's signature in its META words as it starts)."""
        try:
            metas = np.stack([self._regions.read(r, L.META, META_LEN) for r in range(self.size)])
            check_agreement(metas, self._ranks)
        except ValueError as e:
            return f"; the calls the ranks last started differ: {e}"
        except Exception:  # noqa: BLE001 - a peer's memory may be gone: the timeout says enough
            pass
        return ""

    def synchronize(self) -> None:
        """Wait for our kernels on the current stream, then raise what they left (see :meth:`_check`)."""
        if self._broken:
            self._raise_broken()
        self._regions.sync()
        self._check(completed=True)  # a peer that left after our calls ended raises at our next call

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
        try:
            self._bind(kernel, constants)(*args)
        except BaseException:
            self._not_launched()
            raise
        if self.eager_check:
            self._check(completed=True)

    def _start(self) -> None:
        """Before a launch: refuse when broken, raise earlier failures, count the launch."""
        if self._broken:
            self._raise_broken()
        self._check()
        if not self._regions.capturing():  # a captured kernel runs at replays, which the host does not see
            self._launched += 1

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
        self._bind(self._k.barrier_kernel, {"COPY_META": True})(*self._common(sig)[1:])
        self._regions.sync()  # an error path: the host reads the peers' signatures now
        self._status[L.S_MISMATCH] = 0  # differences are the point here
        self._check()
        return self._peer_metas()

    def reject_call(self, sig: Signature, x: torch.Tensor, fused: tuple[int, int] | None = None) -> None:
        """See :meth:`Transport.reject_call`. The peers' call meets us, by its kind:

        - its first call of ``sig`` compares signatures on the host (every all_reduce; every call
          on a GPU): there, with the error signature (every rank makes the same calls, so the
          peers' first call is ours);
        - a Lamport all_reduce (or the fused RMSNorm), which has no barrier: the same kernel on
          ``x`` under a rejecting header (:mod:`transports.kernels.lamport`), so that the slots
          stay in step and the peers record a rejection, not a fatal difference;
        - a barrier kernel: :meth:`exchange_meta`'s, at its first barrier.
        """
        err_sig = Signature(error_meta())
        host_checked = self._agree_on_host or int(sig.meta[F_OPCODE]) == OpCode.ALL_REDUCE
        if host_checked and sig.value not in self._host_agreed:
            rendezvous_metas(self.group.rendezvous, err_sig)
            return
        nbytes = x.numel() * x.element_size()
        if fused is not None and not self.fuses_all_reduce_rmsnorm(x.numel(), fused[1], x.dtype, torch.float32):
            fused = None  # the peers compose it: their all_reduce is the call to meet
        lamport = fused is not None or (int(sig.meta[F_OPCODE]) == OpCode.ALL_REDUCE
                                        and self._lamport_takes(nbytes, x.dtype))
        if not lamport:
            self.exchange_meta(err_sig)
            return
        import triton

        args = (self._lam_ptrs, self._regions.sig_ptrs, self._status_arg, self.rank, self.size,
                (sig.value | 1) ^ 2, self._meta(err_sig), self.lamport_elems, self._max_spins)
        self._start()
        if fused is not None:
            rows, hidden = fused
            a = x.reshape(rows, hidden)
            kernel = self._bind(self._k.lamport.all_reduce_rmsnorm_lamport,
                                {"OUT_BF16": x.dtype == torch.bfloat16, "BLOCK_H": triton.next_power_of_2(hidden)})
            weight = torch.ones(hidden, dtype=torch.float32, device=x.device)
            run = (a, torch.zeros_like(a), weight, torch.empty_like(a), torch.empty_like(a), rows, hidden, 1.0, *args)
        else:
            flat = self._flat(x)
            const = self._lamport_constants(self._reduce_constants(x.dtype, ReduceOp(int(sig.meta[F_REDOP]))))
            kernel = self._bind(self._k.lamport.all_reduce_lamport, const)
            run = (flat, torch.empty_like(flat), flat.numel(), *args)
        try:
            kernel(*run)
        except BaseException:
            self._not_launched()
            raise
        self._regions.sync()  # an error path: our own view of the rejection is ours to drop
        self._status[L.S_MISMATCH] = 0
        self._check(completed=True)

    def barrier(self, sig: Signature) -> None:
        self._launch(self._k.barrier_kernel, *self._common(sig)[1:], COPY_META=False)

    def _lamport_takes(self, nbytes: int, dtype: torch.dtype) -> bool:
        return dtype in _LAMPORT_DTYPES and 0 < nbytes <= self.lamport_max and \
            nbytes // dtype.itemsize <= self.lamport_elems

    def _symmetric_offset(self, t: torch.Tensor) -> int | None:
        """Offset of ``t`` in our symmetric heap (every rank's tensor of a call sits at the same
        one), or None when ``t`` is not wholly inside it."""
        a = t.data_ptr()
        if self._heap_lo <= a and a + t.numel() * t.element_size() <= self._heap_hi and t.numel():
            return a - self._heap_lo
        return None

    def _heap_table(self, offset: int) -> torch.Tensor:
        """Every rank's address of the symmetric tensor at ``offset`` (a device table, cached)."""
        t = self._heap_tables.get(offset)
        if t is None:
            if len(self._heap_tables) > 64:
                self._heap_tables.clear()
            t = self._heap_tables[offset] = self._regions.sig_ptrs + (self._heap_off + offset)
        return t

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

    # ---- symmetric memory ----------------------------------------------------------------------
    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor inside our region's symmetric heap (collective: every rank calls
        it with the same shape and dtype, in the same order). The all_reduce of such a tensor
        reads it where it is, on every rank, without a copy into the staging buffer: in place
        when ``out`` is the tensor itself. It is freed when the tensor is garbage collected; keep
        frees in the same order on every rank, since the next allocation's offset must agree.

        Raises ValueError on every rank when the ranks' calls differ or the heap is full.
        """
        if self._broken:
            self._raise_broken()
        nbytes = math.prod(shape) * dtype.itemsize
        off = self._heap.alloc(nbytes)
        mine = np.array([-1 if off is None else off, nbytes, dtype_code(dtype)], dtype=np.int64)
        everyone = [np.frombuffer(b, dtype=np.int64) for b in self.group.rendezvous.allgather_bytes(mine.tobytes())]
        if any((e != mine).any() for e in everyone) or off is None:
            if off is not None:
                self._heap.free(off)
            desc = "; ".join(f"rank {self._ranks[r]}: " + (f"{e[1]} B of dtype code {e[2]} at offset {e[0]}"
                                                            if e[0] >= 0 else f"{e[1]} B, no room")
                             for r, e in enumerate(everyone))
            raise ValueError(f"symmetric_empty: the ranks' allocations differ or the symmetric heap "
                             f"({self.symmetric_bytes} B, setting ipc_symmetric_bytes) is full: {desc}")
        heap = self._heap
        raw = self._regions.tensor(self._heap_off + off, nbytes, lambda: heap.free(off))
        return raw.view(dtype).reshape(shape)

    # ---- exchanges with kernels of their own (transports/ipc_moe.py) ---------------------------
    def peer_region(self, nbytes: int) -> torch.Tensor:
        """Map one more zeroed region of ``nbytes`` per rank, which every rank's kernels read and
        write (collective: every rank calls it with the same size, in the same order). It stays
        mapped until the transport closes.

        Returns:
            int64 [size] on the transport's device: every rank's base address of the region.
        """
        if self._broken:
            self._raise_broken()
        provider = _HostRegions if self.emulate else _CudaRegions
        # at least a signal area: the providers map one at the start of every region they create
        regions = provider(self.group, _align(max(int(nbytes), L.SIGNAL_WORDS * 8), _REGION_ALIGN))
        self._more_regions.append(regions)
        return regions.sig_ptrs

    def launch_exchange(self, *launches: tuple[Any, tuple, dict]) -> tuple[int, int, int, int] | None:
        """Launch one call of an exchange: its kernels ``(kernel, args, constexprs)``, back to back,
        each as ``kernel(*args, sig_ptrs, status, max_spins, **constexprs)`` on our programs and
        counted for the watchdog, as :meth:`_launch` does. Earlier failures raise before the first
        kernel only: a call that stopped between its kernels would leave its peers waiting for the
        rest.

        Then, outside CUDA-graph capture, wait for the kernels (the stream), raise failures, and
        return what they recorded of this call's inputs, read and cleared: the status block's
        (S_INPUT, S_PAIRING, S_PAIR_WORD, S_PAIR_MAX), which the caller raises. One rank's refused
        input reaches its peers only through their kernels; raised lazily at a later call, as
        other asynchronous errors are, it would make the ranks leave the exchange at different
        calls, and the next call of one rank would pair with another call of its peers. Waiting
        makes every rank raise in this call. Under capture: None (replays record; the next check
        raises it and closes the transport, see :meth:`_failed`).
        """
        self._start()
        tail = (self._regions.sig_ptrs, self._status_arg, self._max_spins)
        for i, (kernel, args, constexprs) in enumerate(launches):
            if i and not self._regions.capturing():
                self._launched += 1  # counted as _start counts the first
            try:
                self._bind(kernel, constexprs)(*args, *tail)
            except BaseException:
                self._not_launched()
                raise
        if self._regions.capturing():
            return None
        self._regions.sync()
        st = self._status
        words = tuple(int(st[w]) for w in (L.S_INPUT, L.S_PAIRING, L.S_PAIR_WORD, L.S_PAIR_MAX))
        st[L.S_INPUT] = st[L.S_PAIRING] = 0
        self._check(completed=True)
        return words

    # ---- teardown ------------------------------------------------------------------------------
    def abort(self, why: str) -> None:
        """Mark our STATE aborted (peers waiting for us raise at once), then :meth:`close`."""
        if not self._broken:
            self._broken = why
            try:
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)  # peers' watchdogs raise
            except Exception:  # noqa: BLE001 - closing anyway
                log.debug("ipc: could not mark the abort", exc_info=True)
        self.close()

    # close(): after our ABORT, how long to wait for our kernels to end before unmapping. Aborted waits
    # end at their next turn (microseconds); only kernels queued behind other long work need more.
    _DRAIN_SECONDS = 5.0
    # close() of a healthy transport first lets calls in flight finish this long (peers that are there
    # finish them in microseconds), as ncclCommDestroy completes its operations; abort() does not
    _GRACE_SECONDS = 0.5
    # what close() could not unmap safely (a kernel may still touch it), kept while the process lives
    _leaked: list = []

    def close(self) -> None:
        """Close. Calls still in flight get :attr:`_GRACE_SECONDS` to finish (not after abort());
        then they are abandoned, as ncclCommAbort abandons them (synchronize() first to be sure to
        keep their results). Later calls raise CommunicatorBrokenError.

        In this order, after the grace: announce it in our STATE word (peers waiting for us raise at once), set our
        ABORT word (our kernels' waits give up at their next turn, queued kernels skip their work),
        wait a bounded time for our kernels to end (:meth:`_drain`), stop the watchdog, unmap every
        region. Unmapped first, a kernel still queued would touch unmapped memory: on a GPU a sticky
        error that ends the process's CUDA context (and the free's implicit synchronization would
        wait for kernels spinning on peers that left). Kernels that have not ended by the bound keep
        their memory: it is leaked for the process's life, with a warning, rather than unmapped.
        """
        if self._broken == "closed":
            return
        try:
            probe: Callable[[], bool] | None = self._regions.stream_probe()
        except Exception:  # noqa: BLE001 - e.g. a failed CUDA context: the host's count alone then
            log.debug("ipc: no stream probe at close", exc_info=True)
            probe = None
        try:
            in_flight = self._in_flight(probe)
        except Exception:  # noqa: BLE001 - an earlier asynchronous error: assume the worst
            in_flight = True
        if in_flight and not self._broken:
            in_flight = not self._drain(probe, self._GRACE_SECONDS)
        try:
            if not self._broken:
                # a close that abandons kernels is an abort to the peers: aborted kernels still advance
                # their epochs, which a peer's watchdog would take for a closed rank's finished call
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED if in_flight else L.STATE_CLOSED)
            self._regions.write(self.rank, L.ABORT, 1)
        except Exception:  # noqa: BLE001 - closing anyway
            log.debug("ipc: could not mark the close", exc_info=True)
        self._broken = "closed"
        drained = self._drain(probe)
        self._stop.set()
        self._watchdog.join(timeout=1.0)
        regions = [*getattr(self, "_more_regions", []), self._regions]
        self._more_regions = []
        if drained:
            for r in regions:
                r.close()
        else:
            # what a late kernel may still use: the mappings, the pinned status block and the pointer
            # tables (the providers), and the cached argument tensors
            IPCTransport._leaked.append((regions, self._lam_ptrs, list(self._meta_cache.values()),
                                         list(self._heap_tables.values())))
            log.warning("ipc rank %d: kernels were still running %.1fs after close() aborted them; their "
                        "memory stays mapped (leaked) until this process exits", self._ranks[self.rank],
                        self._DRAIN_SECONDS)
        self._meta_cache.clear()

    def _in_flight(self, probe: Callable[[], bool] | None) -> bool:
        """Whether a kernel of ours may still run (see :meth:`_drain`). In emulation only the probe
        counts: a launch returns when its kernel has ended, on the thread that launched it, and the
        communicator never runs close() beside a call, so a count ahead of DONE there is a launch that
        raised out of the interpreter (an interrupted call), not a kernel."""
        return (not self.emulate and self._busy()) or (probe is not None and not probe())

    def _drain(self, probe: Callable[[], bool] | None, seconds: float | None = None) -> bool:
        """Wait up to ``seconds`` (after our ABORT: :attr:`_DRAIN_SECONDS`) for our kernels to end;
        whether they did.

        It sees the kernels launched eagerly, on any stream (the host's count against the status
        block's DONE: host-mapped, no stream synchronization), and, through ``probe`` (on a GPU an
        event recorded at close), all work queued on the current stream before close began, CUDA-graph
        replays included. It cannot see graph replays on other streams; unrelated long work queued on
        the current stream delays it, and past the bound makes close() leak the regions.
        """
        deadline = time.monotonic() + (self._DRAIN_SECONDS if seconds is None else seconds)
        pause = 1e-4
        while True:
            try:
                if not self._in_flight(probe):
                    return True
            except Exception:  # noqa: BLE001 - the event reports an earlier asynchronous error
                log.warning("ipc: could not tell whether kernels still run at close()", exc_info=True)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
