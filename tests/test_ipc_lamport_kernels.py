"""The Lamport kernels on their own (no transport, no processes), under Triton's interpreter.

Memory of n ranks (signal areas, status blocks, Lamport areas) lives in tensors of this process.
To run rank r's kernel alone, a test writes what the peers would have pushed into r's slot (their
rows as float32 with -0.0 made +0.0, their headers ``digest | 1``), so no wait blocks, and then
checks what r's kernel did: its output, its pushes into every rank's slot, the previous slot
cleared over the recorded length (and only there), its counters and status words, and its
ERROR/MISMATCH words when a peer is missing, ABORT is set or a header differs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from transports.ipc import load_kernels  # noqa: E402
from transports.kernels import layout as L  # noqa: E402

load_kernels(True)
from transports.kernels import lamport as LK  # noqa: E402

SENT = L.LAMPORT_SENTINEL_BITS
GARBAGE = 0x3F80_0001  # a float32 word a previous call left in a slot
OPS = {"sum": 1, "avg": 2, "max": 3, "min": 4, "prod": 5}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class World:
    """n ranks: signal areas, status blocks, Lamport areas (empty, as the host creates them)."""

    def __init__(self, n: int, elems: int, programs: int = 1):
        self.n, self.elems, self.programs = n, elems, programs
        self.sig = torch.zeros(n, L.SIGNAL_WORDS, dtype=torch.int64)
        self.status = torch.zeros(n, L.STATUS_WORDS, dtype=torch.int64)
        image = torch.from_numpy(L.lamport_image(elems))
        self.lam = image.repeat(n, 1)
        self.sig_ptrs = torch.tensor([self.sig[r].data_ptr() for r in range(n)], dtype=torch.int64)
        self.lam_ptrs = torch.tensor([self.lam[r].data_ptr() for r in range(n)], dtype=torch.int64)
        self.meta = torch.arange(100, 100 + L.META_WORDS, dtype=torch.int64)
        self.digest = 0x1234_5678_9ABC
        for r in range(n):  # what the peers published (PEER_META checks)
            self.sig[r][L.META : L.META + L.META_WORDS] = self.meta + 1000 * r

    def _slot(self, q: int, s: int) -> torch.Tensor:
        b = L.lamport_slot_bytes(self.elems)
        return self.lam[q][s * b : (s + 1) * b]

    def headers(self, q: int, s: int) -> torch.Tensor:
        """int64 [MAX_RANKS] headers of rank q's slot s (a view)."""
        return self._slot(q, s)[: L.MAX_RANKS * 8].view(torch.int64)

    def rows(self, q: int, s: int) -> torch.Tensor:
        """int32 [MAX_RANKS, elems] data words of rank q's slot s (a view)."""
        return self._slot(q, s)[L.MAX_RANKS * 8 :].view(torch.int32).view(L.MAX_RANKS, self.elems)

    def set_calls(self, r: int, i: int) -> None:
        self.sig[r][L.LAMPORT_CALLS : L.LAMPORT_CALLS + self.programs] = i

    def peers_push(self, r: int, s: int, xs: list, skip: int = -1, digest: int | None = None, upto: int | None = None):
        """Peers of r pushed xs (their flat inputs) into r's slot s and their headers (skip: a
        missing peer; upto: elements the last peer in order got to push)."""
        for q in range(self.n):
            if q == r or q == skip:
                continue
            b = bits(xs[q])
            k = b.numel() if upto is None or q != max(set(range(self.n)) - {r}) else upto
            self.rows(r, s)[q, :k] = b[:k]
            self.headers(r, s)[q] = (self.digest if digest is None else digest) | 1

    def common(self, r: int, max_spins: int = 200) -> tuple:
        return (self.lam_ptrs, self.sig_ptrs, self.status[r], r, self.n, self.digest, self.meta, self.elems,
                max_spins)

    def word(self, r: int, at: int, count: int | None = None):
        return self.sig[r][at].item() if count is None else self.sig[r][at : at + count].tolist()


def bits(x: torch.Tensor) -> torch.Tensor:
    """x as the int32 words a rank pushes: float32, -0.0 as +0.0."""
    f = x.reshape(-1).float()
    return torch.where(f == 0, torch.zeros_like(f), f).view(torch.int32)


def ref_all_reduce(xs: list, op: str) -> torch.Tensor:
    """op over ranks in order, in float32, of the pushed values; rounded to the dtype (torch: to nearest even)."""
    vals = [bits(x).view(torch.float32) for x in xs]
    acc = vals[0].clone()
    f = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}[op]
    for v in vals[1:]:
        acc = f(acc, v)
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(xs[0].dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal NaN positions and equal bits everywhere else."""
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ia = a.view({4: torch.int32, 2: torch.int16}[a.element_size()])
    ib = b.view({4: torch.int32, 2: torch.int16}[b.element_size()])
    return torch.equal(ia[~na], ib[~nb])


def inputs(n: int, numel: int, dtype: torch.dtype, seed: int, specials: bool = True) -> list:
    """Random inputs (never all zeros or ones); with specials a NaN in one rank and -0.0 here and there."""
    g = torch.Generator().manual_seed(seed)
    xs = [((torch.rand(numel, generator=g) * 2 + 0.25) * torch.sign(torch.randn(numel, generator=g))).to(dtype)
          for _ in range(n)]
    if specials and numel >= 7:
        for q in range(n):
            xs[q][3] = -0.0  # in every rank: the result is +0.0 however -0.0 would combine
            xs[q][q + 4] = -0.0
        xs[n - 1][1] = float("nan")
    return xs


def run_all_reduce(w: World, r: int, x, out, op: str, block: int = 128, max_spins: int = 200):
    LK.all_reduce_lamport[(w.programs,)](x, out, x.numel(), *w.common(r, max_spins), OP=OPS[op],
                                         OUT_BF16=x.dtype == torch.bfloat16, BLOCK=block)


def dirty_previous(w: World, r: int, p: int, plen: int) -> None:
    """Slot p of r's area as a previous call of length plen left it (garbage everywhere, to see
    exactly what the clear touches)."""
    w.rows(r, p)[:] = GARBAGE
    w.headers(r, p)[:] = 77
    for pid in range(w.programs):
        w.sig[r][L.LAMPORT_LEN + pid * L.LAMPORT_SLOTS + p] = plen


def check_call(w: World, r: int, i: int, x: torch.Tensor, plen: int, calls: int) -> list:
    """What rank r's call i (slot i % 3) of x must have done besides OUT; returns failures."""
    fails = []
    s, p, n = i % 3, (i + 2) % 3, x.numel()
    want = bits(x)
    for q in range(w.n):
        row = w.rows(q, s)[r]
        if not torch.equal(row[:n], want):
            fails.append(f"push into rank {q}")
        if not bool((row[n:] == SENT).all()):
            fails.append(f"push into rank {q} past n")
        if w.headers(q, s)[r].item() != w.digest | 1:
            fails.append(f"header in rank {q}: {w.headers(q, s)[r].item():#x}")
    prev = w.rows(r, p)
    if not bool((prev[: w.n, :plen] == SENT).all()):
        fails.append("previous slot not cleared")
    if not (bool((prev[: w.n, plen:] == GARBAGE).all()) and bool((prev[w.n :] == GARBAGE).all())):
        fails.append("cleared past the recorded length or the world's rows")
    if w.headers(r, p).tolist() != [0] * L.MAX_RANKS:
        fails.append("previous headers not zeroed")
    P = w.programs
    if w.word(r, L.LAMPORT_CALLS, P) != [i + 1] * P:
        fails.append(f"LAMPORT_CALLS {w.word(r, L.LAMPORT_CALLS, P)}")
    if [w.word(r, L.LAMPORT_LEN + pid * 3 + s) for pid in range(P)] != [n] * P:
        fails.append("LAMPORT_LEN")
    if w.word(r, L.CALLS, P) != [calls] * P or w.status[r][L.S_DONE : L.S_DONE + P].tolist() != [calls] * P:
        fails.append(f"CALLS {w.word(r, L.CALLS, P)} DONE {w.status[r][L.S_DONE : L.S_DONE + P].tolist()}")
    if w.word(r, L.ERROR) or w.status[r][L.S_ERROR].item() or w.status[r][L.S_MISMATCH].item():
        fails.append(f"error {w.word(r, L.ERROR)}")
    if w.word(r, L.META, L.META_WORDS) != w.meta.tolist():
        fails.append("META")
    return fails


# ---- all_reduce_lamport --------------------------------------------------------------------------
@pytest.mark.parametrize("programs", [1, 2, 3])
def test_all_reduce_every_dtype_op_and_size(programs):
    """Every dtype and op; every size with one program, the extremes with several (tiles of 256:
    a program has one tile or several)."""
    n, r, elems = 3, 1, 1031
    fails = []
    sizes = (1, 7, 1000, elems) if programs == 1 else (7, elems)
    for d, dtype in enumerate(DTYPES):
        for o, op in enumerate(OPS):
            for k, numel in enumerate(sizes):
                case = f"{dtype} {op} {numel}"
                w = World(n, elems, programs)
                i = 4 + d + o + k  # mid-way: the kernel reads its slot from memory
                s, p = i % 3, (i + 2) % 3
                w.set_calls(r, i)
                w.sig[r][L.CALLS : L.CALLS + programs] = 10
                plen = (97 * (d + o + k + 1)) % elems
                dirty_previous(w, r, p, plen)
                xs = inputs(n, numel, dtype, seed=100 * d + 10 * o + k)
                w.peers_push(r, s, xs)
                out = torch.full_like(xs[r], 7.0)
                x = xs[r].clone()
                run_all_reduce(w, r, x, out, op, block=256)
                if not same_bits(out, ref_all_reduce(xs, op)):
                    fails.append(case)
                if not torch.equal(x.view(torch.uint8), xs[r].view(torch.uint8)):
                    fails.append(f"{case}: input changed")
                fails += [f"{case}: {f}" for f in check_call(w, r, i, xs[r], plen, 11)]
    assert not fails, fails


def test_in_place_and_small_block_many_tiles():
    n, r, elems, programs = 4, 3, 1000, 2
    w = World(n, elems, programs)
    xs = inputs(n, 999, torch.bfloat16, seed=5)
    w.peers_push(r, 0, xs)
    x = xs[r].clone()
    run_all_reduce(w, r, x, x, "sum", block=16)  # OUT is X
    assert same_bits(x, ref_all_reduce(xs, "sum"))
    assert torch.equal(w.rows(0, 0)[r, :999], bits(xs[r]))  # pushed before it was overwritten


def test_bfloat16_rounds_to_nearest_even_like_torch():
    # 1 + 2^-8 + 2^-10 in float32 rounds up to 1.0078125 in bf16; the interpreter's own cast truncates
    w = World(2, 16)
    xs = [torch.tensor([1.0, 1.0, -3.0], dtype=torch.bfloat16),
          torch.tensor([2**-8 + 2**-10, 2**-8, 2**-9], dtype=torch.bfloat16)]
    w.peers_push(0, 0, xs)
    out = torch.empty(3, dtype=torch.bfloat16)
    run_all_reduce(w, 0, xs[0], out, "sum")
    assert out.view(torch.int16).tolist() == (xs[0].float() + xs[1].float()).bfloat16().view(torch.int16).tolist()
    assert out[0].item() == 1.0078125


def test_calls_cycle_through_the_three_slots():
    """Four calls in a row (fresh area): each writes slot i % 3 and clears the previous call's
    slot over that call's length; the fourth reuses slot 0, which the second cleared."""
    n, r, elems, programs = 3, 2, 400, 2
    w = World(n, elems, programs)
    empty = torch.from_numpy(L.lamport_image(elems))[: L.lamport_slot_bytes(elems)]
    sizes = (300, 37, 129, 400)
    for i, numel in enumerate(sizes):
        s, p = i % 3, (i + 2) % 3
        xs = inputs(n, numel, torch.float32, seed=i)
        w.peers_push(r, s, xs)
        out = torch.empty(numel)
        run_all_reduce(w, r, xs[r], out, "sum", block=32)
        assert same_bits(out, ref_all_reduce(xs, "sum")), i
        assert [w.word(r, L.LAMPORT_LEN + pid * 3 + s) for pid in range(programs)] == [numel] * programs
        assert w.word(r, L.LAMPORT_CALLS, programs) == [i + 1] * programs
        assert w.word(r, L.CALLS, programs) == [i + 1] * programs
        if i:
            assert torch.equal(w._slot(r, p), empty), f"call {i} left slot {p} dirty"
        assert torch.equal(w.rows(r, s)[:n, :numel], torch.stack([bits(x) for x in xs])), i
        assert w.headers(r, s)[:n].tolist() == [w.digest | 1] * n
    # after the fourth call: slot 0 holds its data, slots 1 and 2 are empty again (2 by call 3, 1 by call 2)
    assert torch.equal(w._slot(r, 1), empty) and torch.equal(w._slot(r, 2), empty)


def test_missing_peer_data_gives_up_and_names_it():
    n, r, elems = 3, 0, 64
    for programs in (1, 2):
        w = World(n, elems, programs)
        xs = inputs(n, 50, torch.float32, seed=1)
        w.peers_push(r, 0, xs, upto=49)  # peer 2's last element never arrives
        out = torch.full((50,), 7.0)
        run_all_reduce(w, r, xs[r], out, "sum", block=16, max_spins=5)
        assert w.word(r, L.ERROR) == 2 + 1 and w.status[r][L.S_ERROR].item() == 3, programs
        assert w.word(r, L.LAMPORT_CALLS, programs) == [1] * programs  # the kernel ended all the same
        assert w.status[r][L.S_DONE : L.S_DONE + programs].tolist() == [1] * programs
        want = ref_all_reduce(xs, "sum")
        if programs == 1:  # tiles before the missing element were reduced, the last one was not
            assert same_bits(out[:48], want[:48]) and torch.equal(out[48:], torch.full((2,), 7.0))
        # a later call does not start: ERROR stays, nothing is pushed
        w.peers_push(r, 1, xs)
        run_all_reduce(w, r, xs[r], out, "sum", block=16, max_spins=5)
        assert w.word(r, L.ERROR) == 3
        assert bool((w.rows(1, 1)[r] == SENT).all()) and w.headers(1, 1)[r].item() == 0


def test_missing_peer_header_gives_up_and_names_it():
    n, r, elems = 3, 1, 64
    w = World(n, elems)
    xs = inputs(n, 20, torch.float16, seed=2)
    w.peers_push(r, 0, xs)
    w.headers(r, 0)[0] = 0  # peer 0's data came, its header did not
    out = torch.full((20,), 7.0, dtype=torch.float16)
    run_all_reduce(w, r, xs[r], out, "max", max_spins=5)
    assert w.word(r, L.ERROR) == 0 + 1 and w.status[r][L.S_ERROR].item() == 1
    assert torch.equal(out, torch.full((20,), 7.0, dtype=torch.float16))


def test_abort_stops_before_anything_moves():
    n, r, elems, programs = 3, 1, 64, 2
    w = World(n, elems, programs)
    xs = inputs(n, 40, torch.float32, seed=3)
    w.set_calls(r, 1)
    dirty_previous(w, r, 0, 30)
    w.peers_push(r, 1, xs)
    w.sig[r][L.ABORT] = 1
    out = torch.full((40,), 7.0)
    run_all_reduce(w, r, xs[r], out, "sum", block=16)
    assert w.word(r, L.ERROR) == n + 1 and w.status[r][L.S_ERROR].item() == n + 1
    assert torch.equal(out, torch.full((40,), 7.0))
    for q in range(n):
        assert bool((w.rows(q, 1)[r] == SENT).all()) and w.headers(q, 1)[r].item() == 0, q
    assert bool((w.rows(r, 0) == GARBAGE).all())  # no clear either
    assert w.word(r, L.LAMPORT_CALLS, programs) == [2] * programs
    assert w.status[r][L.S_DONE : L.S_DONE + programs].tolist() == [1] * programs


def test_header_with_another_digest_is_a_fatal_mismatch():
    n, r, elems, programs = 3, 2, 64, 2
    w = World(n, elems, programs)
    xs = inputs(n, 40, torch.float32, seed=4)
    w.peers_push(r, 0, xs)
    w.headers(r, 0)[1] = (w.digest + 2) | 1
    out = torch.full((40,), 7.0)
    run_all_reduce(w, r, xs[r], out, "sum", block=16)
    assert w.status[r][L.S_MISMATCH].item() == 1
    assert w.word(r, L.ERROR) == n + 2 and w.status[r][L.S_ERROR].item() == n + 2
    assert torch.equal(out, torch.full((40,), 7.0))
    peer_meta = w.sig[r][L.PEER_META : L.PEER_META + n * L.META_WORDS].view(n, L.META_WORDS)
    assert torch.equal(peer_meta[0], w.meta) and torch.equal(peer_meta[1], w.meta + 1000)
    assert torch.equal(peer_meta[r], w.meta)  # our own, which the kernel wrote
    assert w.word(r, L.LAMPORT_CALLS, programs) == [1] * programs


def test_data_that_came_with_abort_is_no_failure(monkeypatch):
    """A peer pushes, finishes and closes; the watchdog then sets our ABORT. If that happens between
    the spin's read of the data and its read of ABORT, the data it read are stale: the wait must look
    again after seeing ABORT. The interleaving is forced by a hook on the interpreter's loads."""
    from triton.runtime.interpreter import InterpreterBuilder

    n, r, late, numel = 3, 0, 2, 10
    w = World(n, 16)
    xs = inputs(n, numel, torch.float32, seed=6)
    w.peers_push(r, 0, xs, skip=late)
    w.headers(r, 0)[late] = w.digest | 1
    data_addr = w.rows(r, 0)[late].data_ptr()
    abort_addr = int(w.sig_ptrs[r]) + L.ABORT * 8
    seen = []
    real_load = InterpreterBuilder.create_masked_load

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        a = ptrs.data.reshape(-1)
        if a.size > 1 and int(a[0]) == data_addr and not seen:
            seen.append("data")
        elif a.size == 1 and int(a[0]) == abort_addr and seen == ["data"]:
            seen.append("abort")
            w.rows(r, 0)[late, :numel] = bits(xs[late])  # the peer pushed, closed,
            w.sig[r][L.ABORT] = 1  # and the watchdog saw it closed
        return real_load(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", load)
    out = torch.empty(numel)
    run_all_reduce(w, r, xs[r], out, "sum", block=16)
    assert seen == ["data", "abort"], f"the hook did not force the interleaving ({seen}): the wait changed"
    assert w.word(r, L.ERROR) == 0, "a peer whose data arrived was reported as failed"
    assert same_bits(out, ref_all_reduce(xs, "sum"))


# ---- all_reduce_rmsnorm_lamport ------------------------------------------------------------------
def ref_fused(xs, residual, weight, eps):
    """(out, res_out): the torch composition r = all_reduce(x) + residual, rmsnorm(r) * weight;
    res_out exact (float32 sum in rank order, rounded), out in float64 from it."""
    dtype = residual.dtype
    a = ref_all_reduce([x.reshape(-1) for x in xs], "sum").reshape(residual.shape)
    res = (a.float() + residual.float()).to(dtype)
    r64 = res.double()
    out = r64 * torch.rsqrt((r64 * r64).mean(-1, keepdim=True) + eps) * weight.double()
    return out, res


TOL = {torch.float32: {"rtol": 2e-6, "atol": 1e-6}, torch.float16: {"rtol": 1e-3, "atol": 1e-4},
       torch.bfloat16: {"rtol": 8e-3, "atol": 1e-3}}


def run_fused(w, r, x, residual, weight, out, res_out, eps, block_h, max_spins=200):
    rows, H = x.shape
    LK.all_reduce_rmsnorm_lamport[(w.programs,)](x, residual, weight, out, res_out, rows, H, eps,
                                                 *w.common(r, max_spins), OUT_BF16=x.dtype == torch.bfloat16,
                                                 BLOCK_H=block_h)


@pytest.mark.parametrize("programs", [1, 2, 3])
def test_fused_rmsnorm_against_the_torch_composition(programs):
    n, r, elems, eps = 3, 1, 512, 1e-6
    fails = []
    k = 0
    for dtype in DTYPES:
        for wdt in dict.fromkeys((torch.float32, dtype)):
            for rows, H in ((1, 7), (5, 100), (4, 64)):
                for in_place in (False, True):
                    k += 1
                    if programs > 1 and in_place != bool((k - 1) // 2 % 2):  # several programs: half the cases
                        continue
                    case = f"{dtype} w={wdt} {rows}x{H} in_place={in_place}"
                    w = World(n, elems, programs)
                    i = k
                    s, p = i % 3, (i + 2) % 3
                    w.set_calls(r, i)
                    plen = (31 * k) % elems
                    dirty_previous(w, r, p, plen)
                    xs = [x.view(rows, H) for x in inputs(n, rows * H, dtype, seed=k, specials=False)]
                    xs[0][0, 0] = -0.0
                    g = torch.Generator().manual_seed(k)
                    residual = torch.randn(rows, H, generator=g).to(dtype)
                    weight = (torch.rand(H, generator=g) + 0.5).to(wdt)
                    w.peers_push(r, s, xs)
                    want_out, want_res = ref_fused(xs, residual, weight, eps)
                    x, res_in = xs[r].clone(), residual.clone()
                    if in_place:
                        out, res_out = x, res_in
                    else:
                        out, res_out = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
                    block_h = 1 << (H - 1).bit_length()
                    run_fused(w, r, x, res_in, weight, out, res_out, eps, block_h)
                    if not same_bits(res_out, want_res):
                        fails.append(f"{case}: RES_OUT")
                    try:
                        torch.testing.assert_close(out.double(), want_out, **TOL[dtype])
                    except AssertionError as e:
                        fails.append(f"{case}: OUT {str(e)[:300]}")
                    fails += [f"{case}: {f}" for f in check_call(w, r, i, xs[r], plen, 1)]
    assert not fails, fails


def test_fused_missing_peer_and_mismatch():
    n, r, elems, rows, H = 2, 0, 64, 3, 7
    xs = [x.view(rows, H) for x in inputs(n, rows * H, torch.bfloat16, seed=8, specials=False)]
    residual = torch.randn(rows, H).to(torch.bfloat16)
    weight = torch.ones(H)
    w = World(n, elems, 2)
    w.peers_push(r, 0, xs, upto=rows * H - 1)
    out = torch.full_like(xs[r], 7.0)
    run_fused(w, r, xs[r], residual, weight, out, out.clone(), 1e-5, 8, max_spins=5)
    assert w.word(r, L.ERROR) == 2 and w.status[r][L.S_ERROR].item() == 2
    assert torch.equal(out[2], torch.full((H,), 7.0, dtype=torch.bfloat16))  # the row that never arrived
    w = World(n, elems, 2)
    w.peers_push(r, 0, xs, digest=w.digest + 4)
    run_fused(w, r, xs[r], residual, weight, out, out.clone(), 1e-5, 8)
    assert w.word(r, L.ERROR) == n + 2 and w.status[r][L.S_MISMATCH].item() == 1


def test_fused_and_plain_calls_share_the_slots():
    """Lengths and partitions differ between the two kernels; each clears what the other left."""
    n, r, elems, programs = 3, 0, 300, 3
    w = World(n, elems, programs)
    empty = torch.from_numpy(L.lamport_image(elems))[: L.lamport_slot_bytes(elems)]
    calls = [("plain", 300), ("fused", (3, 37)), ("plain", 50), ("fused", (7, 40)), ("plain", 1)]
    for i, (kind, size) in enumerate(calls):
        s, p = i % 3, (i + 2) % 3
        if kind == "plain":
            xs = inputs(n, size, torch.float16, seed=i)
            w.peers_push(r, s, xs)
            out = torch.empty_like(xs[r])
            run_all_reduce(w, r, xs[r], out, "avg", block=64)
            assert same_bits(out, ref_all_reduce(xs, "avg")), i
        else:
            rows, H = size
            xs = [x.view(rows, H) for x in inputs(n, rows * H, torch.float16, seed=i, specials=False)]
            w.peers_push(r, s, xs)
            residual, weight = torch.randn(rows, H).half(), torch.rand(H).half() + 0.5
            out, res_out = torch.empty_like(xs[r]), torch.empty_like(xs[r])
            run_fused(w, r, xs[r], residual, weight, out, res_out, 1e-5, 64)
            want_out, want_res = ref_fused(xs, residual, weight, 1e-5)
            assert same_bits(res_out, want_res), i
            torch.testing.assert_close(out.double(), want_out, **TOL[torch.float16])
        if i:
            assert torch.equal(w._slot(r, p), empty), f"call {i} ({kind}) left slot {p} dirty"
        assert w.word(r, L.ERROR) == 0
