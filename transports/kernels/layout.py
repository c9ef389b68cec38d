"""Layout of a rank's signal area: int64 words at the start of its region, before its data buffer.

Plain Python numbers for the host; :mod:`transports.kernels.sync` wraps them as ``tl.constexpr``.

Words written by the host (own area only):
    STATE    0 running, 1 aborted after a failure, 2 closed (peers' watchdogs read it)
    ABORT    nonzero: every wait of this rank's kernels gives up at its next turn
Words written by the kernels:
    ERROR    (peer group rank + 1) of the first wait that gave up, world + 1 for a kernel that did not
             start (an earlier failure or ABORT), world + 2 for a Lamport call that met another
             signature; 0 when none did (sticky; mirrored into the status block)
    COUNTS   all_to_all: rows this rank sends to each rank (MAX_RANKS words)
    META     this call's full signature (META_LEN words), for the host's error message
    RECV_COUNTS all_to_all: rows this rank said (recv_counts=) it receives from each rank, -1 when
             not given (MAX_RANKS words); the host compares them with the peers' COUNTS
    DIGEST   per program: this call's signature digest, written before the first barrier
    EPOCH    per program: barriers passed so far (read and advanced by the kernels only, so
             CUDA-graph replays stay in step)
    FLAGS    per program, per source rank: the epoch that source last signalled to us
    PEER_META per rank: peers' META copied by program 0 after the first barrier when the
             digests differ (or for exchange_meta), so the host reads them from its own area
             after peers may have moved on
    CALLS    per program: kernels this program has finished (mirrored into the status block's DONE)
    LAMPORT_CALLS per program: Lamport all-reduces this program has finished (slot = calls % 3)
    LAMPORT_LEN per program, per slot: elements per source that program read from that slot in
             its last call there (what it clears to the sentinel in the next Lamport call)
    LL_CALLS per program: low-latency MoE exchange kernels this program has finished
             (:mod:`transports.kernels.moe_ll`; the watchdog compares them as it does EPOCH)

The *status block* is a rank's own, private words in host-mapped memory (pinned ``cudaHostAlloc``
on a GPU, ordinary memory in emulation): the kernels write them, the host reads them with plain
loads, without a copy or a stream synchronization (errors are read lazily):
    S_ERROR    the ERROR word's value, mirrored when a wait gives up
    S_MISMATCH 1 when a call's signature digest differed from a peer's (reset by the host)
    S_INPUT    a low-latency MoE dispatch source's refused input: ``err * MAX_RANKS + source``
               (err: an INPUT_* code + 256 * detail; reset by the host, which raises ValueError)
    S_PAIRING  a low-latency MoE call whose peer sent another call word (another call, or FP8
               against bfloat16): that source + 1; S_PAIR_WORD its word, S_PAIR_MAX the largest
               word any source sent in that call (the host resynchronizes its call count from it)
    S_DONE     per program: its CALLS word after each kernel

The *Lamport area* after the data buffer: LAMPORT_SLOTS slots, each ``[MAX_RANKS] int64``
headers (a source's call digest | 1, 0 when empty) then ``[MAX_RANKS][lamport_elems]`` float32
words that peers write into and that read as LAMPORT_SENTINEL (-0.0) when empty.
"""

from __future__ import annotations

MAX_RANKS = 16  # ranks of one node that a group may have
MAX_PROGRAMS = 64  # programs (thread blocks) a kernel may be launched with
META_WORDS = 16  # == transports.base.META_LEN (checked by the transport)
META_OPCODE, LOCAL_ERROR = 0, 99  # == transports.base.F_OPCODE, OpCode.LOCAL_ERROR (checked by the transport)

STATE = 0
ABORT = 1
ERROR = 2
COUNTS = 16
META = COUNTS + MAX_RANKS  # 32
RECV_COUNTS = META + META_WORDS  # 48
DIGEST = 64
EPOCH = DIGEST + MAX_PROGRAMS  # 128
FLAGS = 256
PEER_META = FLAGS + MAX_PROGRAMS * MAX_RANKS  # 1280
CALLS = EPOCH + MAX_PROGRAMS  # 192
LAMPORT_CALLS = PEER_META + MAX_RANKS * META_WORDS  # 1536
LAMPORT_SLOTS = 3
LAMPORT_LEN = LAMPORT_CALLS + MAX_PROGRAMS  # 1600
LL_CALLS = LAMPORT_LEN + MAX_PROGRAMS * LAMPORT_SLOTS  # 1792
SIGNAL_WORDS = 2048  # 16 KiB: keeps the data buffer 4 KiB-aligned after it
assert LL_CALLS + MAX_PROGRAMS <= SIGNAL_WORDS
assert RECV_COUNTS + MAX_RANKS <= DIGEST and EPOCH + MAX_PROGRAMS <= CALLS and CALLS + MAX_PROGRAMS <= FLAGS

S_ERROR = 0
S_MISMATCH = 1
S_INPUT = 2
S_PAIRING = 3
S_PAIR_WORD = 4
S_PAIR_MAX = 5
S_DONE = 8
STATUS_WORDS = S_DONE + MAX_PROGRAMS

# what a sender of a low-latency MoE dispatch or combine refused (its error word's low byte; S_INPUT);
# STALE_HANDLE: a combine's topk_idx differ from those its handle's dispatch sent
INPUT_TOO_MANY_TOKENS, INPUT_BAD_ID, INPUT_DUPLICATE_ID, INPUT_BAD_SHAPE, INPUT_STALE_HANDLE = 1, 2, 3, 4, 5

LAMPORT_SENTINEL_BITS = -(1 << 31)  # int32 view of float32 -0.0

STATE_RUNNING, STATE_ABORTED, STATE_CLOSED = 0, 1, 2

LL_WORDS = 512  # int64 words at the start of a low-latency MoE exchange region (transports.kernels.moe_ll)


def lamport_slot_bytes(elems: int) -> int:
    """Bytes of one Lamport slot for ``elems`` elements per source: headers, then float32 rows."""
    return MAX_RANKS * 8 + MAX_RANKS * elems * 4


def lamport_image(elems: int):
    """The empty Lamport area (every slot: zero headers, sentinel rows) as a uint8 NumPy array."""
    import numpy as np

    slot = np.zeros(lamport_slot_bytes(elems), dtype=np.uint8)
    slot[MAX_RANKS * 8 :].view(np.int32)[:] = LAMPORT_SENTINEL_BITS
    return np.tile(slot, LAMPORT_SLOTS)
