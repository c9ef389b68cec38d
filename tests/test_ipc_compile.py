"""The ipc kernels, the Lamport and low-latency MoE ones included, compile for a GPU (sm_90 target) without one: Triton's frontend, its NVIDIA
backend and the ptxas it ships run on the CPU. Catches what the interpreter accepts and the
compiler does not (operand types of atomics, loop-carried types), and checks the barrier's PTX:
system-scope release exchanges, acquire loads, and block-wide bar.sync around them.

Also checks the ipc transport's pre-bound launches (transports/_ipc_launch.py): every launch it
makes, recorded in emulated ranks, has the argument list that the kernel compiled for sm_90 takes.

Runs in subprocesses (two, side by side, each compiling half of the kernels and half of the recorded
launches): this pytest process defines the kernels under the interpreter.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton")

if __name__ != "__main__":  # under pytest; the compiling subprocess (below) needs no harness
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    from ipc_harness import run_ranks
    from spmd import run_side_by_side
    from transports.base import OpCode, ReduceOp, Signature

SHARDS = 2  # compiling is one core's work: the shards share the kernels out over the machine's cores


def _compile_all(shard: int = 0, shards: int = 1) -> dict:
    """Compile every ``shards``-th kernel of the list, from the ``shard``-th (the test runs the shards side by side)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from transports.kernels import collectives, lamport, moe_ll

    common = {"data_ptrs": "*i64", "sig_ptrs": "*i64", "status": "*i64", "rank": "i32", "world": "i32", "digest": "i64",
              "meta": "*i64", "max_spins": "i64"}
    red = {"ACC": "constexpr", "OP": "constexpr", "IS_FLOAT": "constexpr", "OUT_BF16": "constexpr",
           "BLOCK": "constexpr"}
    bf16 = {"ACC": tl.float32, "OP": 1, "IS_FLOAT": True, "OUT_BF16": True, "BLOCK": 1024}
    i64max = {"ACC": tl.int64, "OP": 3, "IS_FLOAT": False, "OUT_BF16": False, "BLOCK": 1024}
    copy = {"BLOCK": 1024}
    jobs = [
        ("barrier_kernel", {k: v for k, v in common.items() if k != "data_ptrs"} | {"COPY_META": "constexpr"},
         {"COPY_META": True}),
        ("all_reduce_one_shot", {"X": "*bf16", "OUT": "*bf16", "n": "i32", **common, **red, "STAGE": "constexpr"},
         {**bf16, "STAGE": True}),
        ("all_reduce_two_shot", {"X": "*i64", "OUT": "*i64", "n": "i32", **common, **red, "ALIGN": "constexpr",
                                 "STAGE": "constexpr"}, {**i64max, "ALIGN": 16, "STAGE": False}),
        ("reduce_scatter", {"X": "*fp16", "OUT": "*fp16", "m_block": "i32", "lo": "i32", "w": "i32", **common, **red},
         {**bf16, "OUT_BF16": False, "OP": 4}),
        ("all_gather", {"X": "*u8", "OUT": "*u8", "m_block": "i32", "lo": "i32", "w": "i32", **common,
                        "BLOCK": "constexpr"}, copy),
        ("broadcast", {"X": "*u8", "OUT": "*u8", "w": "i32", "root": "i32", **common, "BLOCK": "constexpr"}, copy),
        ("all_to_all_stage", {"X": "*u8", "pieces": "*i64", "n_pieces": "i32", "counts": "*i64", **common,
                              "BLOCK": "constexpr"}, copy),
        ("all_to_all_pull", {"OUT": "*u8", "copies": "*i64", "n_copies": "i32", "data_ptrs": "*i64",
                             "sig_ptrs": "*i64", "status": "*i64", "rank": "i32", "world": "i32", "max_spins": "i64",
                             "BLOCK": "constexpr"}, copy),
    ]
    # the Lamport kernels (transports/kernels/lamport.py)
    tail = {"lam_ptrs": "*i64", "sig_ptrs": "*i64", "status": "*i64", "rank": "i32", "world": "i32", "digest": "i64",
            "meta": "*i64", "elems": "i32", "max_spins": "i64"}
    lamport_jobs = []
    for dt, bf16 in (("bf16", True), ("fp32", False)):
        lamport_jobs.append((f"all_reduce_lamport_{dt}", "all_reduce_lamport",
                             {"X": f"*{dt}", "OUT": f"*{dt}", "n": "i32", **tail, "OP": "constexpr",
                              "OUT_BF16": "constexpr", "BLOCK": "constexpr"},
                             {"OP": 1 if bf16 else 3, "OUT_BF16": bf16, "BLOCK": 1024}))
        lamport_jobs.append((f"all_reduce_rmsnorm_lamport_{dt}", "all_reduce_rmsnorm_lamport",
                             {"X": f"*{dt}", "RESIDUAL": f"*{dt}", "WEIGHT": "*fp32", "OUT": f"*{dt}",
                              "RES_OUT": f"*{dt}", "rows": "i32", "H": "i32", "eps": "fp32", **tail,
                              "OUT_BF16": "constexpr", "BLOCK_H": "constexpr"}, {"OUT_BF16": bf16, "BLOCK_H": 4096}))
    # the low-latency MoE exchange (transports/kernels/moe_ll.py), at DeepEP's decoding shape
    exch = {"reg": "*i64", "rank": "i32", "world": "i32", "call": "i32", "sig_ptrs": "*i64", "status": "*i64",
            "max_spins": "i64"}
    rows = {"E": 256, "M": 128, "RB": 14336, "OFF_CNT": 4096, "OFF_INFO": 8192, "OFF_ROWS": 1 << 20}
    ll_jobs = [(f"ll_dispatch_send_{'fp8' if fp8 else 'bf16'}", "ll_dispatch_send",
                {"X": "*bf16", "IDX": "*i64", "SAVED": "*i64", "T": "i32", "K": "i32", "host_err": "i32", **exch},
                {**rows, "KM": 8, "H": 7168, "TB": 128, "KB": 8, "NB": 1024, "CB": 1024, "ITEM": 2, "FP8": fp8})
               for fp8 in (False, True)]
    ll_jobs += [
        ("ll_dispatch_recv", "ll_dispatch_recv", {"OUT": "*i32", "OUT2": "*i32", "INFO": "*i32", "RECV_COUNT": "*i32",
                                                  **exch}, {**rows, "W1": 3584, "W2": 0, "WB": 1024, "LC": 32}),
        ("ll_combine_send", "ll_combine_send", {"Y": "*i32", "INFO": "*i32", "RECV_COUNT": "*i32", "IDX": "*i64",
                                                "SAVED": "*i64", "T": "i32", "K": "i32", "host_err": "i32", **exch},
         {"E": 256, "M": 128, "KM": 8, "W": 3584, "OFF_COMB": 1 << 24, "WB": 1024, "LC": 32, "NB": 1024}),
        ("ll_combine_recv", "ll_combine_recv", {"OUT": "*bf16", "IDX": "*i64", "WEIGHTS": "*fp32", "T": "i32",
                                                "K": "i32", **exch},
         {"KM": 8, "H": 7168, "OFF_COMB": 1 << 24, "CB": 1024, "OUT_BF16": True}),
    ]
    ll_jobs = [(key, name, {n: "constexpr" if n in cx else sig[n] for n in getattr(moe_ll, name).arg_names}, cx)
               for key, name, sig, cx in ll_jobs]
    everything = [(name, collectives, name, sig, cx) for name, sig, cx in jobs] + \
        [(key, lamport, name, sig, cx) for key, name, sig, cx in lamport_jobs] + \
        [(key, moe_ll, name, sig, cx) for key, name, sig, cx in ll_jobs]
    report = {}
    for name, module, kernel, signature, constexprs in everything[shard::shards]:
        fn = getattr(module, kernel)
        try:
            src = ASTSource(fn, signature=signature,
                            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            ptx = compiled.asm["ptx"]
            report[name] = {"ok": True, "cubin": "cubin" in compiled.asm,
                            "ops": sorted(set(re.findall(r"(atom\.global\.[\w.]+|ld\.volatile\.global[\w.]*|"
                                                         r"ld\.global\.sys\.acquire[\w.]*|red\.global[\w.]*|bar\.sync)", ptx)))}
        except Exception as e:  # noqa: BLE001 - reported together
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return report


@pytest.fixture(scope="module")
def sm90(tmp_path_factory) -> tuple[dict, list, dict]:
    """The kernels of ``_compile_all``'s list and every launch the transport makes, compiled for sm_90
    in SHARDS subprocesses side by side: (list reports, recorded launches, their reports)."""
    results = run_ranks(_record_launches, 2, timeout=120.0)
    assert results[0][0] == "ok", results[0]
    launches = results[0][1]
    recorded = tmp_path_factory.mktemp("sm90") / "launches.json"
    recorded.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(recorded.parent / "triton-cache")  # the shards' common cache
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = run_side_by_side([[sys.executable, os.path.abspath(__file__), str(i), str(SHARDS), str(recorded)]
                              for i in range(SHARDS)], timeout=600, envs=[env] * SHARDS, cwd=root)
    listed, compiled = {}, {}
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        listed.update(out["listed"])
        compiled.update(out["recorded"])
    return listed, launches, compiled


def test_every_kernel_compiles_for_sm90_with_system_scope_barriers(sm90):
    report = sm90[0]
    assert len(report) == 17, sorted(report)  # every kernel of the list, from one shard or the other
    failed = {k: v["error"] for k, v in report.items() if not v["ok"]}
    assert not failed, failed
    assert all(v["cubin"] for v in report.values())
    for name in ("barrier_kernel", "all_reduce_one_shot", "all_to_all_pull"):
        ops = report[name]["ops"]
        assert "atom.global.sys.release.exch.b64" in ops, (name, ops)  # the signal
        assert "ld.global.sys.acquire.b64" in ops, (name, ops)  # the wait
        assert "bar.sync" in ops, (name, ops)  # all threads' stores before the signal
    # Lamport: volatile loads of the data words in the spin (a cached load could spin forever on a
    # stale sentinel), the system-scope CAS that records ERROR, the release exchange that publishes
    # a header and the acquire read that waits for one
    lamport = [k for k in report if "lamport" in k]
    assert len(lamport) == 4, sorted(report)
    for name in lamport:
        ops = report[name]["ops"]
        assert "ld.volatile.global.b32" in ops, (name, ops)  # the spin on the (32-bit) data words
        assert "ld.volatile.global.b64" in ops, (name, ops)  # ABORT/ERROR read in the waits
        assert "atom.global.relaxed.sys.cas.b64" in ops, (name, ops)  # ERROR: first error wins, system-wide
        assert "atom.global.sys.release.exch.b64" in ops, (name, ops)  # the header, after META
        assert "ld.global.sys.acquire.b64" in ops, (name, ops)  # waiting for headers (then PEER_META)
        assert "bar.sync" in ops, (name, ops)
    # the low-latency MoE exchange: arrivals and acks are system-scope release adds after a
    # block-wide bar.sync, waits are acquire loads, ERROR a system-scope CAS
    ll = [k for k in report if k.startswith("ll_")]
    assert len(ll) == 5, sorted(report)
    for name in ll:
        ops = report[name]["ops"]
        assert "red.global.sys.release.add.u64" in ops, (name, ops)
        assert "ld.global.sys.acquire.b64" in ops, (name, ops)
        assert "atom.global.relaxed.sys.cas.b64" in ops, (name, ops)
        assert "bar.sync" in ops, (name, ops)


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
    t = IPCTransport(group, buffer_bytes=1 << 14, one_shot_max_bytes=4096)
    x = torch.randn(5000)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for v, op in ((x[:300].to(dtype), ReduceOp.SUM), (x.to(dtype), ReduceOp.MAX)):  # one-shot, two-shot
            t.all_reduce(v, torch.empty_like(v), op, Signature.of(OpCode.ALL_REDUCE, dtype=v.dtype, shape=v.shape, op=op))
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


def test_pre_bound_arguments_match_the_sm90_compiled_signature(sm90):
    _, launches, report = sm90
    names = {entry[0] for entry in launches}
    assert {"all_reduce_one_shot", "all_reduce_two_shot", "reduce_scatter", "all_gather", "broadcast",
            "all_to_all_stage", "all_to_all_pull", "barrier_kernel", "all_reduce_lamport",
            "all_reduce_rmsnorm_lamport"} <= names, names
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


if __name__ == "__main__":
    shard, shards = int(sys.argv[1]), int(sys.argv[2])
    with open(sys.argv[3]) as f:
        launches = json.load(f)
    print(json.dumps({"listed": _compile_all(shard, shards), "recorded": _compile_recorded(launches[shard::shards])}))
