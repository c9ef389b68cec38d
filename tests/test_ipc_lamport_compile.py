"""The Lamport kernels compile for a GPU (sm_90 target) without one, and their PTX holds the
accesses the protocol relies on: volatile loads of the data words in the spin (a cached load
could spin forever on a stale sentinel), the system-scope compare-and-swap that records ERROR,
the release exchange that publishes a header and the acquire read that waits for one.

Runs in a subprocess: this pytest process defines the kernels under the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _compile_all() -> dict:
    os.environ.pop("TRITON_INTERPRET", None)
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from transports.kernels import lamport as K

    tail = {"lam_ptrs": "*i64", "sig_ptrs": "*i64", "status": "*i64", "rank": "i32", "world": "i32", "digest": "i64",
            "meta": "*i64", "elems": "i32", "max_spins": "i64"}
    jobs = []
    for dt, bf16 in (("bf16", True), ("fp32", False)):
        jobs.append((f"all_reduce_lamport_{dt}", "all_reduce_lamport",
                     {"X": f"*{dt}", "OUT": f"*{dt}", "n": "i32", **tail, "OP": "constexpr", "OUT_BF16": "constexpr",
                      "BLOCK": "constexpr"}, {"OP": 1 if bf16 else 3, "OUT_BF16": bf16, "BLOCK": 1024}))
        jobs.append((f"all_reduce_rmsnorm_lamport_{dt}", "all_reduce_rmsnorm_lamport",
                     {"X": f"*{dt}", "RESIDUAL": f"*{dt}", "WEIGHT": "*fp32", "OUT": f"*{dt}", "RES_OUT": f"*{dt}",
                      "rows": "i32", "H": "i32", "eps": "fp32", **tail, "OUT_BF16": "constexpr",
                      "BLOCK_H": "constexpr"}, {"OUT_BF16": bf16, "BLOCK_H": 4096}))
    report = {}
    for key, name, signature, constexprs in jobs:
        fn = getattr(K, name)
        try:
            src = ASTSource(fn, signature=signature,
                            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            ptx = compiled.asm["ptx"]
            report[key] = {"ok": True, "cubin": "cubin" in compiled.asm,
                           "ops": sorted(set(re.findall(r"(atom\.global\.[\w.]+|ld\.volatile\.global[\w.]*|"
                                                        r"ld\.global\.sys\.acquire[\w.]*|bar\.sync)", ptx)))}
        except Exception as e:  # noqa: BLE001 - reported together
            report[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return report


def test_lamport_kernels_compile_for_sm90_with_volatile_spins(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v["error"] for k, v in report.items() if not v["ok"]}
    assert not failed, failed
    assert len(report) == 4 and all(v["cubin"] for v in report.values())
    for name, v in report.items():
        ops = v["ops"]
        assert "ld.volatile.global.b32" in ops, (name, ops)  # the spin on the (32-bit) data words
        assert "ld.volatile.global.b64" in ops, (name, ops)  # ABORT/ERROR read in the waits
        assert "atom.global.relaxed.sys.cas.b64" in ops, (name, ops)  # ERROR: first error wins, system-wide
        assert "atom.global.sys.release.exch.b64" in ops, (name, ops)  # the header, after META
        assert "ld.global.sys.acquire.b64" in ops, (name, ops)  # waiting for headers (then PEER_META)
        assert "bar.sync" in ops, (name, ops)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
