"""The ipc transport's host path: no host wait per call, errors read lazily, symmetric tensors,
and pre-bound launches that match what Triton compiles for the GPU.

Emulation (host provider + Triton's interpreter) in forked ranks; ``eager_check=False`` makes the
transport read its status block only at the next call and at ``synchronize()``, as it does on a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks, sm90_triton_cache  # noqa: E402,F401 - the shared sm_90 compile cache
from spmd import mark_done, run_side_by_side, wait_done  # noqa: E402
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


# ---- pre-bound launches against triton.compile for sm_90 ------------------------------------------
def _record_launches(group):
    """Every (kernel, runtime argument types, constexprs, full argument list) the transport launches."""
    from transports import _ipc_launch
    from transports.ipc import IPCTransport

    seen = {}
    real = _ipc_launch.BoundKernel.__call__

    def record(self, *args, key=None):
        name = self.kernel.__name__ if hasattr(self.kernel, "__name__") else self.kernel.fn.__name__
        sig = self.signature(args)
        full = self.full_args(args)
        const = {k: (v.name if hasattr(v, "name") else v) for k, v in self.constexprs.items()}
        order_ok = all(full[self.names.index(k)] is v for k, v in self.constexprs.items())
        seen.setdefault(f"{name}{sorted(const.items())}", (name, sig, const, len(full), order_ok))
        return real(self, *args, key=key)

    _ipc_launch.BoundKernel.__call__ = record
    t = IPCTransport(group, buffer_bytes=BUF, one_shot_max_bytes=4096)
    x = torch.randn(5000)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        v = x[:300].to(dtype)
        t.all_reduce(v, torch.empty_like(v), ReduceOp.SUM, _sig(v))
        w = x.to(dtype)
        t.all_reduce(w, torch.empty_like(w), ReduceOp.MAX, _sig(w, ReduceOp.MAX))
    t.reduce_scatter(x[:64], torch.empty(32), ReduceOp.SUM,
                     Signature.of(OpCode.REDUCE_SCATTER, dtype=x.dtype, shape=(64,), op=ReduceOp.SUM))
    t.all_gather(x[:8], torch.empty(16), Signature.of(OpCode.ALL_GATHER, dtype=x.dtype, shape=(8,)))
    t.broadcast(x[:8], torch.empty(8), 0, Signature.of(OpCode.BROADCAST, dtype=x.dtype, shape=(8,)))
    t.all_to_all(x[:4], [2, 2], 1, lambda c: torch.empty(sum(c)),
                 Signature.of(OpCode.ALL_TO_ALL, dtype=x.dtype, shape=(4,), compare_first_dim=False))
    t.barrier(Signature.of(OpCode.BARRIER))
    h = x[:96].reshape(3, 32)
    t.all_reduce_rmsnorm(h, h.clone(), torch.ones(32), 1e-6, torch.empty_like(h), torch.empty_like(h),
                         Signature.of(OpCode.ALL_REDUCE, dtype=h.dtype, shape=h.shape, op=ReduceOp.SUM))
    t.close()
    return list(seen.values())


def _compile_recorded(launches: list) -> dict:
    """In a process without the interpreter: compile each recorded launch for sm_90 and read the
    kernel's parameters from its PTX."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from transports.kernels import collectives

    modules = [collectives]
    try:
        from transports.kernels import lamport

        modules.append(lamport)
    except ImportError:
        pass
    types = {d.name: d for d in (tl.float32, tl.float64, tl.int32, tl.int64)}
    report = {}
    for name, sig, const, nfull, _ in launches:
        fn = next(getattr(m, name) for m in modules if hasattr(m, name))
        cx = {(fn.arg_names.index(k),): (types[v] if isinstance(v, str) else v) for k, v in const.items()}
        compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32))
        ptx = compiled.asm["ptx"]
        entry = ptx[ptx.index(".entry") : ptx.index(")", ptx.index(".entry"))]
        params = re.findall(r"\.param \.(\w+)", entry)
        report[f"{name}{sorted(const.items())}"] = {"params": params, "names": list(fn.arg_names),
                                                     "src_sig": list(compiled.src.signature.items()),
                                                     "not_specialized": [p.name for p in fn.params
                                                                         if p.do_not_specialize]}
    return report


def test_pre_bound_arguments_match_the_sm90_compiled_signature(sm90_triton_cache):  # noqa: F811 - the fixture
    results = run_ranks(_record_launches, 2, timeout=120.0)
    assert results[0][0] == "ok", results[0]
    launches = results[0][1]
    names = {entry[0] for entry in launches}
    assert {"all_reduce_one_shot", "all_reduce_two_shot", "reduce_scatter", "all_gather", "broadcast",
            "all_to_all_stage", "all_to_all_pull", "barrier_kernel", "all_reduce_lamport",
            "all_reduce_rmsnorm_lamport"} <= names, names
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = sm90_triton_cache
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + os.path.join(root, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    # two subprocesses side by side, each compiling every other launch (compiling is one core's work)
    code = ("import json, sys; from test_ipc_lazy import _compile_recorded; "
            "print(json.dumps(_compile_recorded(json.loads(sys.argv[1]))))")
    procs = run_side_by_side([[sys.executable, "-c", code, json.dumps(launches[i::2])] for i in range(2)],
                             timeout=600, envs=[env] * 2, cwd=root)
    report = {}
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        report.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    width = {"i32": "u32", "i64": "u64", "i1": "pred", "fp32": "f32"}
    for name, sig, const, nfull, order_ok in launches:
        got = report[f"{name}{sorted(const.items())}"]
        assert list(sig) == got["names"] and nfull == len(got["names"]), name  # every parameter, in order
        assert order_ok, name  # constexprs in their places
        assert [k for k, v in sig.items() if v == "constexpr"] == list(const), name
        ours = [("u64" if v.startswith("*") else width[v]) for v in sig.values() if v != "constexpr"]
        # the compiled entry takes our runtime arguments, in order and width, then Triton's own scratch pointers
        assert got["params"][: len(ours)] == ours, (name, got["params"], ours)
        assert all(p == "u64" for p in got["params"][len(ours):]) and len(got["params"]) - len(ours) <= 2, name
        # no integer is specialized on its value (1, multiples of 16): a compiled variant then serves every value
        ints = [k for k, v in sig.items() if v in ("i32", "i64")]
        assert set(ints) <= set(got["not_specialized"]), (name, sorted(set(ints) - set(got["not_specialized"])))


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
