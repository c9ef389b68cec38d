"""The ipc kernels on their own (no transport, no processes), under Triton's interpreter.

Memory for n ranks lives in one tensor of this process. To run rank r's kernel alone, a test lays
out what the peers would have done before it: their staged buffers, their signature digests and
the barrier flags they would have sent to r. Then no wait blocks, and the test checks what r's
kernel wrote: its output, its own buffer, the flags it sent to each peer, its epoch words, and
its ERROR/MISMATCH words when a peer is missing, an abort is set or a signature differs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from transports.ipc import load_kernels  # noqa: E402
from transports.kernels import layout as L  # noqa: E402

K = load_kernels(True)
BUF = 1 << 14
E0 = 5  # epochs start mid-way: the kernels must read them from memory


class Mem:
    """Regions of n ranks: [signal words][data buffer] each, and the kernels' address tables."""

    def __init__(self, n: int, programs: int = 1):
        self.n, self.programs = n, programs
        region = L.SIGNAL_WORDS * 8 + BUF
        self.raw = torch.zeros(n * region, dtype=torch.uint8)
        base = self.raw.data_ptr()
        self.sig = [self.raw[r * region : r * region + L.SIGNAL_WORDS * 8].view(torch.int64) for r in range(n)]
        self.data = [self.raw[r * region + L.SIGNAL_WORDS * 8 : (r + 1) * region] for r in range(n)]
        self.sig_ptrs = torch.tensor([base + r * region for r in range(n)], dtype=torch.int64)
        self.data_ptrs = self.sig_ptrs + L.SIGNAL_WORDS * 8
        self.meta = torch.arange(100, 100 + L.META_WORDS, dtype=torch.int64)
        self.status = [torch.zeros(L.STATUS_WORDS, dtype=torch.int64) for _ in range(n)]
        self.digest = 0x1234_5678_9ABC

    def peers_arrive(self, r: int, upto: int = E0 + 3, digest: int | None = None, skip: int = -1) -> None:
        """Peers of r signalled r up to epoch ``upto`` and published ``digest`` (skip: a missing peer)."""
        for p in range(self.programs):
            self.sig[r][L.EPOCH + p] = E0
            for src in range(self.n):
                if src != r:
                    # a missing peer still shows the digest of its previous call, often the same
                    self.sig[r][L.FLAGS + p * L.MAX_RANKS + src] = upto if src != skip else E0
                    self.sig[src][L.DIGEST + p] = self.digest if digest is None else digest
        for src in range(self.n):
            self.sig[src][L.META : L.META + L.META_WORDS] = self.meta + 1000 * src

    def common(self, r: int, max_spins: int = 1 << 40) -> tuple:
        return self.data_ptrs, self.sig_ptrs, self.status[r], r, self.n, self.digest, self.meta, max_spins

    def typed(self, r: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self.data[r][: count * torch.empty(0, dtype=dtype).element_size()].view(dtype)

    def signalled(self, r: int) -> list[list[int]]:
        """[program][peer] the flag r wrote into each peer's area (r itself: -1)."""
        return [[int(self.sig[q][L.FLAGS + p * L.MAX_RANKS + r]) if q != r else -1 for q in range(self.n)]
                for p in range(self.programs)]


def _inputs(n, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [(torch.randn(numel, generator=g) * 3).to(dtype) for _ in range(n)]
    return [torch.randint(-500, 500, (numel,), generator=g, dtype=dtype) for _ in range(n)]


def _ref(xs, op):
    acc_t = torch.float32 if xs[0].dtype in (torch.float16, torch.bfloat16, torch.float32) else xs[0].dtype
    acc = xs[0].to(acc_t)
    for x in xs[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op](acc, x.to(acc_t))
    return (acc / len(xs) if op == "avg" else acc).to(xs[0].dtype)


def _const(dtype, op, block):
    import triton.language as tl

    acc = {torch.float32: tl.float32, torch.bfloat16: tl.float32, torch.float16: tl.float32,
           torch.int32: tl.int32, torch.int64: tl.int64}[dtype]
    return dict(ACC=acc, OP={"sum": 1, "avg": 2, "max": 3, "min": 4}[op], IS_FLOAT=dtype.is_floating_point,
                OUT_BF16=dtype == torch.bfloat16, BLOCK=block)


CASES = [(dt, op) for dt in (torch.float32, torch.bfloat16, torch.float16) for op in ("sum", "avg", "max", "min")] + [
    (dt, op) for dt in (torch.int32, torch.int64) for op in ("sum", "max", "min")]


@pytest.mark.parametrize("programs", [1, 3])
def test_one_shot_all_reduce_every_dtype_and_op(programs):
    n, numel, fails = 3, 201, []
    for i, (dtype, op) in enumerate(CASES):
        mem = Mem(n, programs)
        xs = _inputs(n, numel, dtype, seed=i)
        if dtype.is_floating_point:
            xs[2][7] = float("nan")
        r = 1
        for q in range(n):
            if q != r:
                mem.typed(q, dtype, numel).copy_(xs[q])
        mem.peers_arrive(r)
        out = torch.empty_like(xs[r])
        K.all_reduce_one_shot[(programs,)](xs[r], out, numel, *mem.common(r), **_const(dtype, op, 16), STAGE=True)
        want = _ref(xs, op)
        same = torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(
            out[~torch.isnan(out)], want[~torch.isnan(want)]) if dtype.is_floating_point else torch.equal(out, want)
        if not same:
            fails.append(f"{dtype} {op}")
        if not torch.equal(mem.typed(r, dtype, numel).view(torch.uint8), xs[r].view(torch.uint8)):
            fails.append(f"{dtype} {op}: input not staged in our buffer")
        if mem.signalled(r) != [[E0 + 2, -1, E0 + 2]] * programs:
            fails.append(f"{dtype} {op}: flags sent {mem.signalled(r)}")
        if mem.sig[r][L.EPOCH : L.EPOCH + programs].tolist() != [E0 + 2] * programs:
            fails.append(f"{dtype} {op}: epochs {mem.sig[r][L.EPOCH : L.EPOCH + programs].tolist()}")
    assert not fails, fails


def test_bfloat16_rounds_to_nearest_even_like_torch():
    # 1 + 2^-8 + 2^-10 in fp32 rounds up to 1.0078125 in bf16; the interpreter's own cast truncates
    mem = Mem(2)
    xs = [torch.tensor([1.0, 1.0, -3.0], dtype=torch.bfloat16), torch.tensor([2**-8 + 2**-10, 2**-8, 2**-9],
                                                                             dtype=torch.bfloat16)]
    mem.typed(1, torch.bfloat16, 3).copy_(xs[1])
    mem.peers_arrive(0)
    out = torch.empty(3, dtype=torch.bfloat16)
    K.all_reduce_one_shot[(1,)](xs[0], out, 3, *mem.common(0), **_const(torch.bfloat16, "sum", 16), STAGE=True)
    assert out.view(torch.int16).tolist() == (xs[0].float() + xs[1].float()).bfloat16().view(torch.int16).tolist()
    assert out[0].item() == 1.0078125


def test_two_shot_all_reduce_parts():
    """Ranks run one after another (flags preset): each rank's own part is the full reduction, and
    the last rank, which finds every earlier part reduced in its owner's buffer, has all of it."""
    n, numel, programs = 4, 301, 2
    xs = _inputs(n, numel, torch.float32, seed=3)
    mem = Mem(n, programs)
    for q in range(n):
        mem.typed(q, torch.float32, numel).copy_(xs[q])
    want = _ref(xs, "sum")
    per = -(-(-(-numel // n)) // 16) * 16
    outs = []
    for r in range(n):
        mem.peers_arrive(r)
        out = torch.full((numel,), float("nan"))
        K.all_reduce_two_shot[(programs,)](xs[r], out, numel, *mem.common(r), **_const(torch.float32, "sum", 16),
                                           ALIGN=16, STAGE=True)
        outs.append(out)
        lo, hi = min(r * per, numel), min((r + 1) * per, numel)
        assert torch.equal(out[lo:hi], want[lo:hi]), f"rank {r}'s part"
        assert torch.equal(mem.typed(r, torch.float32, numel)[lo:hi], want[lo:hi]), f"rank {r}'s buffer part"
        assert mem.signalled(r) == [[E0 + 3 if q != r else -1 for q in range(n)]] * programs
        assert mem.sig[r][L.EPOCH : L.EPOCH + programs].tolist() == [E0 + 3] * programs
    assert torch.equal(outs[-1], want)


def test_reduce_scatter_all_gather_broadcast():
    n, m, r, programs = 3, 53, 2, 2
    mem = Mem(n, programs)
    # reduce_scatter window [lo, lo + w) of every rank's [n * m] input, staged at d * w
    xs = _inputs(n, n * m, torch.float16, seed=4)
    lo, w = 10, 29
    for q in range(n):
        staged = mem.typed(q, torch.float16, n * w)
        for d in range(n):
            staged[d * w : (d + 1) * w] = xs[q][d * m + lo : d * m + lo + w]
    mem.peers_arrive(r)
    out = torch.zeros(m, dtype=torch.float16)
    K.reduce_scatter[(programs,)](xs[r], out, m, lo, w, *mem.common(r), **_const(torch.float16, "sum", 16))
    full = _ref(xs, "sum")
    assert torch.equal(out[lo : lo + w], full[r * m + lo : r * m + lo + w])
    assert torch.equal(out[:lo], torch.zeros(lo, dtype=torch.float16))  # outside the window: untouched
    # all_gather window [lo, lo + w) of every rank's [m] bytes into [n * m]
    mem = Mem(n, programs)
    xs = [torch.randint(0, 255, (m,), dtype=torch.uint8) for _ in range(n)]
    for q in range(n):
        mem.data[q][:w] = xs[q][lo : lo + w]
    mem.peers_arrive(r)
    out = torch.zeros(n * m, dtype=torch.uint8)
    K.all_gather[(programs,)](xs[r], out, m, lo, w, *mem.common(r), BLOCK=16)
    for q in range(n):
        assert torch.equal(out[q * m + lo : q * m + lo + w], xs[q][lo : lo + w]), q
    assert int(out[:lo].sum()) == 0
    # broadcast from rank 0 to rank 2
    mem = Mem(n, programs)
    mem.data[0][:m] = xs[0]
    mem.peers_arrive(r)
    out = torch.zeros(m, dtype=torch.uint8)
    K.broadcast[(programs,)](xs[r], out, m, 0, *mem.common(r), BLOCK=16)
    assert torch.equal(out, xs[0])
    assert int(mem.data[r][:m].sum()) == 0  # a non-root stages nothing


def test_all_to_all_stage_and_pull():
    n, r = 3, 1
    mem = Mem(n)
    x = torch.randint(0, 255, (40,), dtype=torch.uint8)
    pieces = torch.tensor([[0, 0, 12], [12, 20, 20]], dtype=torch.int64)  # skip bytes [12, 20): our own block
    counts = torch.tensor([3, 2, 5, 4, 2, 1], dtype=torch.int64)  # sent to each rank, then declared from each
    mem.sig[r][L.COUNTS + n] = mem.sig[r][L.RECV_COUNTS + n] = 77  # words past the world stay untouched
    mem.peers_arrive(r)
    K.all_to_all_stage[(1,)](x, pieces, 2, counts, *mem.common(r), BLOCK=8)
    assert torch.equal(mem.data[r][:32], torch.cat([x[:12], x[20:]]))
    assert mem.sig[r][L.COUNTS : L.COUNTS + n + 1].tolist() == [3, 2, 5, 77]
    assert mem.sig[r][L.RECV_COUNTS : L.RECV_COUNTS + n + 1].tolist() == [4, 2, 1, 77]
    assert mem.sig[r][L.EPOCH].item() == E0 + 1  # the round goes on in the pull kernel
    for q in (0, 2):
        mem.data[q][:50] = torch.arange(50, dtype=torch.uint8) + 100 * q
    out = torch.zeros(30, dtype=torch.uint8)
    copies = torch.tensor([[0, 5, 0, 7], [2, 40, 20, 10]], dtype=torch.int64)
    K.all_to_all_pull[(1,)](out, copies, 2, mem.data_ptrs, mem.sig_ptrs, mem.status[r], r, n, 1 << 40, BLOCK=8)
    assert out[:7].tolist() == list(range(5, 12))
    assert out[20:30].tolist() == list(range(240, 250))
    assert mem.sig[r][L.EPOCH].item() == E0 + 2
    assert mem.signalled(r) == [[E0 + 2, -1, E0 + 2]]


def test_missing_peer_gives_up_names_it_and_moves_no_data():
    n, r = 3, 0
    mem = Mem(n)
    xs = _inputs(n, 50, torch.float32)
    mem.peers_arrive(r, skip=2)
    out = torch.full((50,), 7.0)
    K.all_reduce_one_shot[(1,)](xs[r], out, 50, *mem.common(r, max_spins=50), **_const(torch.float32, "sum", 16), STAGE=True)
    assert mem.sig[r][L.ERROR].item() == 2 + 1  # the peer it waited for, + 1
    assert mem.status[r][L.S_ERROR].item() == 2 + 1  # mirrored where the host reads it lazily
    assert mem.status[r][L.S_DONE].item() == mem.sig[r][L.CALLS].item() == 1  # the kernel ended all the same
    assert torch.equal(out, torch.full((50,), 7.0))  # nothing read from peers that never arrived
    # a later kernel of this rank does not start: ERROR stays, no flags are sent
    before = mem.signalled(r)
    K.barrier_kernel[(1,)](*mem.common(r)[1:], COPY_META=False)
    assert mem.sig[r][L.ERROR].item() == 3 and mem.signalled(r) == before


def test_peer_that_passed_only_the_first_barrier():
    """Data moves after the first barrier; the last barrier then waits for the peer and gives up."""
    n, r = 2, 0
    mem = Mem(n)
    xs = _inputs(n, 50, torch.float32, seed=9)
    mem.typed(1, torch.float32, 50).copy_(xs[1])
    mem.peers_arrive(r, upto=E0 + 1)
    out = torch.full((50,), 7.0)
    K.all_reduce_one_shot[(1,)](xs[r], out, 50, *mem.common(r, max_spins=50), **_const(torch.float32, "sum", 16), STAGE=True)
    assert torch.equal(out, _ref(xs, "sum"))
    assert mem.sig[r][L.ERROR].item() == 1 + 1


def test_abort_word_stops_the_kernel_before_it_waits():
    n, r = 2, 1
    mem = Mem(n)
    mem.peers_arrive(r, skip=0)
    mem.sig[r][L.ABORT] = 1
    out = torch.full((8,), 7.0)
    K.all_reduce_one_shot[(1,)](torch.ones(8), out, 8, *mem.common(r), **_const(torch.float32, "sum", 16), STAGE=True)
    assert mem.sig[r][L.ERROR].item() == n + 1  # "stopped before waiting"
    assert torch.equal(out, torch.full((8,), 7.0))


def test_signature_mismatch_moves_no_data_but_keeps_step():
    n, r, programs = 3, 2, 2
    mem = Mem(n, programs)
    mem.peers_arrive(r, digest=mem.digest + 1)
    out = torch.full((40,), 7.0)
    K.all_reduce_one_shot[(programs,)](torch.ones(40), out, 40, *mem.common(r), **_const(torch.float32, "sum", 16), STAGE=True)
    assert mem.status[r][L.S_MISMATCH].item() == 1 and mem.sig[r][L.ERROR].item() == 0
    assert torch.equal(out, torch.full((40,), 7.0))
    peer_meta = mem.sig[r][L.PEER_META : L.PEER_META + n * L.META_WORDS].view(n, L.META_WORDS)
    assert torch.equal(peer_meta[0], mem.meta) and torch.equal(peer_meta[1], mem.meta + 1000)
    assert torch.equal(peer_meta[r], mem.meta)  # our own (the kernel wrote it)
    # both barriers passed: the peers are not left waiting, epochs advance as for a good call
    assert mem.signalled(r) == [[E0 + 2, E0 + 2, -1]] * programs
    assert mem.sig[r][L.EPOCH : L.EPOCH + programs].tolist() == [E0 + 2] * programs


def test_peer_that_signalled_then_closed_is_no_failure(monkeypatch):
    """A peer signals, finishes its call and closes; the watchdog then sets our ABORT. If that happens
    between the kernel's read of the peer's flag and its read of ABORT, the flag it read is stale: the
    wait must read the flag again after seeing ABORT, and not report a peer that arrived (the ipc twin
    of shm's false peer failure). The interleaving is forced by a hook on the interpreter's loads."""
    from triton.runtime.interpreter import InterpreterBuilder

    n, r, late = 3, 0, 2
    mem = Mem(n)
    mem.peers_arrive(r, skip=late)  # the late peer has not signalled when the kernel starts
    abort_addr = int(mem.sig_ptrs[r]) + L.ABORT * 8
    flag = L.FLAGS + late  # program 0's flag from the late peer, in r's area
    flag_addr = int(mem.sig_ptrs[r]) + flag * 8
    seen = []  # "flag": the late peer's flag was read (not there yet); "abort": then ABORT was read
    real_load, real_rmw = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_atomic_rmw

    def rmw(self, op, ptr, val, mask, sem, scope):
        if ptr.data.size == 1 and int(ptr.data.reshape(-1)[0]) == flag_addr and not seen:
            seen.append("flag")
        return real_rmw(self, op, ptr, val, mask, sem, scope)

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        if ptrs.data.size == 1 and int(ptrs.data.reshape(-1)[0]) == abort_addr and seen == ["flag"]:
            seen.append("abort")
            mem.sig[r][flag] = E0 + 3  # between the two reads the peer signalled both barriers, closed,
            mem.sig[r][L.ABORT] = 1  # and the watchdog saw it closed
        return real_load(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", rmw)
    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", load)
    K.barrier_kernel[(1,)](*mem.common(r)[1:], COPY_META=False)
    assert seen == ["flag", "abort"], f"the hook did not force the interleaving ({seen}): the wait changed"
    assert mem.sig[r][L.ERROR].item() == 0, "a peer that arrived was reported as failed"
    assert mem.signalled(r) == [[-1, E0 + 2, E0 + 2]]
    assert mem.sig[r][L.EPOCH].item() == E0 + 2
