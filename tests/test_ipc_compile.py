"""The ipc kernels, the Lamport and low-latency MoE ones included, compile for a GPU (sm_90 target) without one: Triton's frontend, its NVIDIA
backend and the ptxas it ships run on the CPU. Catches what the interpreter accepts and the
compiler does not (operand types of atomics, loop-carried types), and checks the barrier's PTX:
system-scope release exchanges, acquire loads, and block-wide bar.sync around them.

Runs in subprocesses (two, side by side, each compiling half the kernels): this pytest process defines
the kernels under the interpreter.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton")

if __name__ != "__main__":  # under pytest; the compiling subprocess (below) needs no harness
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ipc_harness import sm90_triton_cache  # noqa: F401 - the sm_90 compile cache test_ipc_lazy shares
    from spmd import run_side_by_side

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
    exch = {"reg": "*i64", "rank": "i32", "world": "i32", "sig_ptrs": "*i64", "status": "*i64", "max_spins": "i64"}
    rows = {"E": 256, "M": 128, "RB": 14336, "OFF_CNT": 4096, "OFF_INFO": 8192, "OFF_ROWS": 1 << 20}
    ll_jobs = [(f"ll_dispatch_send_{'fp8' if fp8 else 'bf16'}", "ll_dispatch_send",
                {"X": "*bf16", "IDX": "*i64", "T": "i32", "K": "i32", "host_err": "i32", **exch},
                {**rows, "KM": 8, "H": 7168, "TB": 128, "KB": 8, "NB": 1024, "CB": 1024, "ITEM": 2, "FP8": fp8})
               for fp8 in (False, True)]
    ll_jobs += [
        ("ll_dispatch_recv", "ll_dispatch_recv", {"OUT": "*i32", "OUT2": "*i32", "INFO": "*i32", "RECV_COUNT": "*i32",
                                                  **exch}, {**rows, "W1": 3584, "W2": 0, "WB": 1024}),
        ("ll_combine_send", "ll_combine_send", {"Y": "*i32", "INFO": "*i32", "RECV_COUNT": "*i32", **exch},
         {"E": 256, "M": 128, "KM": 8, "W": 3584, "OFF_COMB": 1 << 24, "WB": 1024}),
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


def test_every_kernel_compiles_for_sm90_with_system_scope_barriers(sm90_triton_cache):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = sm90_triton_cache
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = run_side_by_side([[sys.executable, os.path.abspath(__file__), str(i), str(SHARDS)] for i in range(SHARDS)],
                             timeout=300, envs=[env] * SHARDS, cwd=root)
    report = {}
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        report.update(json.loads(proc.stdout.strip().splitlines()[-1]))
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


if __name__ == "__main__":
    print(json.dumps(_compile_all(*map(int, sys.argv[1:3]))))
