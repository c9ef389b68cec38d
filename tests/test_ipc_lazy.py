"""The ipc transport's host path: no host wait per call, errors read lazily, symmetric tensors,
pre-bound launches (their arguments against what Triton compiles for the GPU: test_ipc_compile).

Emulation (host provider + Triton's interpreter) in forked ranks; ``eager_check=False`` makes the
transport read its status block only at the next call and at ``synchronize()``, as it does on a GPU.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks  # noqa: E402
from spmd import mark_done, wait_done  # noqa: E402
from transports.base import (  # noqa: E402
    CommunicatorBrokenError,
    OpCode,
    ReduceOp,
    Signature,
)

BUF = 1 << 14


def _sig(x: torch.Tensor, op=ReduceOp.SUM) -> Signature:
    return Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=op)


def _counting(t) -> dict:
    """Count the calling thread's signal-word reads and stream synchronizations through the
    regions object from now on (the watchdog thread reads the peers' STATE words meanwhile)."""
    import threading

    counts = {"read": 0, "sync": 0}
    regions = t._regions
    read, sync = regions.read, regions.sync
    me = threading.current_thread()

    def counted_read(*a):
        counts["read"] += threading.current_thread() is me
        return read(*a)

    def counted_sync():
        counts["sync"] += 1
        return sync()

    regions.read, regions.sync = counted_read, counted_sync
    return counts


# half through the latency closure, half through all_reduce; nothing here counts calls, and the only
# state that cycles is the Lamport slot (37 floats take the Lamport all_reduce): calls i % 3 of 3 slots,
# so 12 calls run every (slot, closure / all_reduce) pair twice and reuse every slot after its clearing
CACHED_CALLS = 12


def _no_host_wait(group, eager):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF, eager_check=eager)
    n, me = group.size, group.rank
    xs = [torch.randn(37, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    ref = xs[0].clone()
    for x in xs[1:]:
        ref += x
    sig = _sig(xs[me])
    call = t.latency_call(OpCode.ALL_REDUCE, 37, torch.float32, ReduceOp.SUM, sig)
    x = xs[me].clone()
    out = torch.empty(37)
    call(x.data_ptr(), out.data_ptr())  # the first call binds the launch
    counts = _counting(t)
    bad = 0
    for i in range(CACHED_CALLS):
        out.zero_()
        if i % 2:
            call(x.data_ptr(), out.data_ptr())
        else:
            t.all_reduce(x, out, ReduceOp.SUM, sig)
        bad += not torch.equal(out, ref)
    during = dict(counts)
    t.synchronize()
    after = dict(counts)
    done = t._done()
    t.close()
    return bad, during, after, done


@pytest.mark.parametrize("eager", [True, False])
def test_cached_calls_neither_read_signal_words_nor_synchronize(eager):
    results = run_ranks(_no_host_wait, 2, eager, timeout=60.0)
    for res in results:
        assert res[0] == "ok", res
        bad, during, after, done = res[1]
        assert bad == 0
        assert during == {"read": 0, "sync": 0}, during  # CACHED_CALLS calls, no host round trip
        assert after == {"read": 0, "sync": 1}, after  # synchronize(): one
        assert done >= CACHED_CALLS + 1  # every kernel reported its end in the status block


def _lazy_failure(group, how, flags):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF, eager_check=False)
    name = t._regions.name
    x = torch.randn(64)
    sig = _sig(x)
    t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)  # everybody up
    t.synchronize()
    if group.rank == 1:
        if how == "killed":
            time.sleep(0.3)  # rank 0 is inside its kernel by now
            os.kill(os.getpid(), signal.SIGKILL)
        wait_done(flags, [0])  # never arrives: away (not closed) until rank 0 is done
        t.close()
        return None
    try:
        t0 = time.monotonic()
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)  # returns: errors are read lazily
        returned = time.monotonic() - t0
        try:
            if how == "sync":
                t.synchronize()
            else:
                t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
            outcome = ("no error", "", [])
        except Exception as e:  # noqa: BLE001 - inspected by the test
            outcome = (type(e).__name__, str(e), getattr(e, "missing_ranks", None))
        raised = time.monotonic() - t0
        try:
            t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
            later = "no error"
        except CommunicatorBrokenError:
            later = "broken"
    finally:
        mark_done(flags, 0)
    t.close()
    return outcome, returned, raised, later, name


@pytest.mark.parametrize("how", ["next_call", "sync", "killed"])
def test_a_failure_surfaces_at_the_next_call_or_synchronize_naming_the_rank(how, tmp_path):
    results = run_ranks(_lazy_failure, 2, how, str(tmp_path), timeout=2.0)
    assert results[0][0] == "ok", results[0]
    (kind, msg, missing), returned, raised, later, name = results[0][1]
    if how == "killed":
        assert kind == "PeerFailedError" and "rank 1" in msg and "died" in msg, msg
        assert raised < 2.0, raised  # the watchdog saw the death before the timeout
    else:
        assert kind == "CollectiveTimeoutError" and missing == [1], msg
        assert 1.9 < raised < 6.0, raised  # within the timeout, plus the watchdog's period
    assert missing == [1], missing
    assert later == "broken"
    assert not os.path.exists(os.path.join("/dev/shm", name))


def _symmetric(group):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=4096, symmetric_bytes=1 << 16)
    n, me = group.size, group.rank
    report = {}
    for dtype, numel in ((torch.float32, 3001), (torch.bfloat16, 17), (torch.int64, 1000)):
        xs = [(torch.randn(numel, generator=torch.Generator().manual_seed(10 * r + 1)) * 8).to(dtype)
              for r in range(n)]
        acc_t = torch.int64 if dtype == torch.int64 else torch.float32  # the kernels' order and accumulator
        acc = xs[0].to(acc_t)
        for x in xs[1:]:
            acc = acc + x.to(acc_t)
        ref = acc.to(dtype)
        s = t.symmetric_empty((numel,), dtype)
        inside = t._heap_lo <= s.data_ptr() < t._heap_hi
        s.copy_(xs[me])
        out = torch.empty_like(s)
        t.all_reduce(s, out, ReduceOp.SUM, _sig(s))  # one-shot over the peers' tensors
        t.all_reduce(s, s, ReduceOp.SUM, _sig(s))  # in place: two-shot over them
        same = torch.equal(out, s)
        report[str(dtype)] = (inside, same, torch.equal(out, ref), out.clone())
        del s
    # the ranks' allocations must agree: rank 0 asks for another size
    try:
        t.symmetric_empty((8 if me else 9,), torch.float32)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    after = t.symmetric_empty((4,), torch.float32)  # the communicator still works
    after.fill_(me + 1)
    t.all_reduce(after, after, ReduceOp.SUM, _sig(after))
    t.close()
    return report, mismatch, after.tolist()


def test_symmetric_tensors_reduce_in_place_without_staging():
    results = run_ranks(_symmetric, 3, timeout=60.0)
    reports = []
    for res in results:
        assert res[0] == "ok", res
        report, mismatch, after = res[1]
        for dtype, (inside, same, exact, _) in report.items():
            assert inside and same and exact, dtype
        assert "allocations differ" in mismatch and "rank 0" in mismatch and "rank 1" in mismatch, mismatch
        assert after == [6.0] * 4
        reports.append(report)
    for dtype in reports[0]:  # bitwise the same on every rank
        assert all(torch.equal(r[dtype][3], reports[0][dtype][3]) for r in reports), dtype


def _communicator(comm):
    """The Communicator's symmetric_empty, synchronize and latency path over ipc."""
    n, me = comm.size, comm.rank
    xs = [torch.randn(33, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    ref = xs[0] + xs[1]
    s = comm.symmetric_empty((33,), torch.float32)
    s.copy_(xs[me])
    comm.all_reduce(s, out=s)
    ok = [torch.equal(s, ref)]
    x = xs[me].clone()
    for _ in range(5):  # the cached entry's latency path
        ok.append(torch.equal(comm.all_reduce(x), ref))
    comm.synchronize()
    return ok, str(comm.plan("all_reduce", x))


def test_communicator_symmetric_empty_and_synchronize():
    import collectives

    results = collectives.launch(_communicator, 2, transport="ipc", options={"ipc_emulate": 1}, timeout=60.0)
    for ok, plan in results:
        assert all(ok), ok
        assert "-> ipc/" in plan, plan


def test_bound_launch_is_used_unless_a_launch_hook_is_set():
    # Triton keeps each launch hook as a HookChain that is never None: an empty one must not send every
    # GPU launch back through the JIT (the first GPU run found the bound launcher never used).
    from triton import knobs

    from transports._ipc_launch import BoundKernel, _hooks_set
    from transports.kernels.collectives import barrier_kernel

    assert not _hooks_set()
    assert not BoundKernel(barrier_kernel, 1, {}, emulate=False)._jit_only

    def hook(metadata):
        return None

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert _hooks_set()
            assert BoundKernel(barrier_kernel, 1, {}, emulate=False)._jit_only
        finally:
            chain.remove(hook)
    assert not _hooks_set()


def _stand_in_compiler():
    """Run ipc's bound launches as on a GPU, under the interpreter: the first launch of a variant
    returns a stand-in for Triton's CompiledKernel that remembers the pointer dtypes it was compiled
    for, and its launcher reads the X/OUT addresses as those dtypes (as a compiled kernel would)."""
    import transports._ipc_launch as launch_mod
    import transports.ipc as ipc_mod

    class Compiled:
        def __init__(self, kernel, args, constexprs):
            self.kernel, self.constexprs = kernel, constexprs
            self.dtypes = [getattr(v, "dtype", None) if hasattr(v, "data_ptr") else None for v in args]

    class Jit:
        def __init__(self, kernel):
            self.kernel, self.__name__ = kernel, kernel.__name__

        def __getitem__(self, grid):
            def run(*args, **constexprs):
                self.kernel[grid](*args, **constexprs)
                return Compiled(self.kernel, args, constexprs)
            return run

    def launch(c, programs, full, device=None):
        runtime = [v for v, name in zip(full, c.kernel.arg_names) if name not in c.constexprs]
        n = runtime[2]  # every all_reduce kernel: X, OUT, n, ...
        args = [ipc_mod._at(v, n, dt, torch.device("cpu")) if isinstance(v, int) and dt is not None else v
                for v, dt in zip(runtime, c.dtypes)]
        c.kernel[(programs,)](*args, **c.constexprs)

    init = launch_mod.BoundKernel.__init__

    def bound_init(self, kernel, programs, constexprs, emulate):
        init(self, kernel, programs, constexprs, emulate)
        self.kernel, self._jit_only = Jit(kernel), False

    launch_mod.BoundKernel.__init__ = bound_init
    launch_mod.launch = ipc_mod.launch = launch


def _closures_per_dtype(group):
    from transports.ipc import IPCTransport

    _stand_in_compiler()
    t = IPCTransport(group, buffer_bytes=BUF)
    n, me = group.size, group.rank
    bad = []
    # float32 first: its compiled variant exists when float16 (same kernel and constexprs) comes
    for dtype, numel in ((torch.float32, 1000), (torch.float16, 777), (torch.float32, 1000), (torch.bfloat16, 333)):
        xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(n)]
        ref = sum((x.float() for x in xs), torch.zeros(numel)).to(dtype)
        sig = _sig(xs[me])
        call = t.latency_call(OpCode.ALL_REDUCE, numel, dtype, ReduceOp.SUM, sig)
        # room after each tensor: a variant of a wider dtype reads and writes past a narrower one's end
        x = torch.empty(4 * numel, dtype=dtype)[:numel].copy_(xs[me])
        out = torch.zeros(4 * numel, dtype=dtype)[:numel]
        for i in range(4):  # the first call compiles (the stand-in JIT), the rest launch the variant
            out.zero_()
            call(x.data_ptr(), out.data_ptr())
            if not torch.equal(out, ref):
                bad.append((str(dtype), i))
    t.synchronize()
    launched = sum(len(b._compiled) for b in t._bound.values())
    t.close()
    return bad, launched


def test_latency_closures_launch_the_variant_of_their_dtype():
    # The GPU run found a float16 all_reduce launched with the float32 variant of the same kernel.
    results = run_ranks(_closures_per_dtype, 2, timeout=120.0)
    for status, value in results:
        assert status == "ok", value
        bad, launched = value
        assert bad == [], bad
        assert launched >= 3, launched  # the stand-in compiled a variant per dtype: the bound path ran
