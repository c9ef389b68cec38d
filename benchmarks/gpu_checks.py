"""The GPU checks of ``moecomm validate-gpu`` (:mod:`benchmarks.gpu_validate`), each run there as a
``moecomm validate-gpu --check ...`` subprocess: every collective against a CPU reference
(:func:`check_collectives`), CUDA-graph replays (:func:`check_graphs`), the timeout path
(:func:`check_abort`). Each returns ``{..., "failures": [...]}`` with every rank's failures.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

# NCCL takes several ranks on one GPU from 2.30 on, when every rank sets this variable ("Duplicate GPU
# detected" before): the GPU checks and benchmarks put two ranks on the one lent GPU.
MULTI_RANK_NCCL = (2, 30, 0)
MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def gpu_transports(nprocs: int) -> tuple[tuple[str, ...], str, list[str]]:
    """The GPU transports ``nprocs`` ranks sharing cuda:0 can be checked through here.

    Returns:
        (transports, the communicator's transport= ("auto", or "ipc" when NCCL cannot start),
        what is not run and why). NCCL refuses two ranks on one GPU before 2.30 ("Duplicate GPU
        detected"); 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1.
    """
    from transports.nccl import nccl_version

    version = nccl_version()
    if nprocs > 1 and (version is None or version < MULTI_RANK_NCCL):
        have = ".".join(map(str, version)) if version else "none"
        return ("ipc",), "ipc", [f"nccl with {nprocs} ranks on one GPU: this machine's NCCL ({have}) is older "
                                  "than 2.30, which refuses ranks sharing a GPU"]
    return ("nccl", "ipc"), "auto", []


_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
_OPS = ("sum", "prod", "max", "min", "avg")
_TOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def _inputs(rank: int, case: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """Rank ``rank``'s input of case ``case``: random, regenerable on any rank (for the reference);
    values in [0.5, 1.5) (floats) or [1, 3] (ints) so a product of a few ranks neither overflows
    nor underflows."""
    import torch

    g = torch.Generator().manual_seed(7919 * case + rank)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(1, 4, shape, generator=g).to(dtype)


def _reference(op: str, xs: list[Any]) -> Any:
    import torch

    stacked = torch.stack([x.double() for x in xs])
    return {"sum": stacked.sum(0), "prod": stacked.prod(0), "max": stacked.amax(0), "min": stacked.amin(0),
            "avg": stacked.mean(0)}[op]


def _close(got: Any, want: Any, dtype_name: str) -> bool:
    import torch

    tol = _TOL.get(dtype_name, 0.0)
    return got.shape == want.shape and bool(torch.allclose(got.double().cpu(), want.double(), rtol=tol, atol=tol))


def _difference(got: Any, want: Any) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"max abs diff {(got.double().cpu() - want.double()).abs().max().item():.3g}"


def _collectives_body(comm: Any, device: str, required: Sequence[str], large_numel: int = 0) -> dict[str, Any]:
    """On every rank: every collective x dtype x op through each required transport and auto,
    against a reference computed from every rank's regenerated input; uneven all_to_all with zero
    counts; sum all_reduce, all_gather and all_to_all of float32 at 0 and 1001 elements (and
    ``large_numel``, 256 MiB on the GPU, when > 0); split.

    Returns:
        {"transports": [...], "cases": n, "failures": ["transport op dtype: what", ...]} (this rank's).
    """
    import torch

    failures: list[str] = []
    missing = [t for t in required if t not in comm.transports]
    if missing:
        failures.append(f"transport(s) {missing} did not come up (available: {sorted(comm.transports)})")
    names = [t for t in required if t in comm.transports] + ["auto"]
    n, r, cases = comm.size, comm.rank, 0
    for t in names:
        view = comm.using(t)
        for dn in _DTYPES:
            dtype = getattr(torch, dn)
            jobs: list[tuple[str, str]] = [("all_reduce", op) for op in _OPS] + [("reduce_scatter", op) for op in _OPS]
            jobs += [("all_gather", ""), ("broadcast", ""), ("all_to_all", "")]
            for coll, op in jobs:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                cases += 1
                case = cases
                shape = (n * 3, 5)
                xs = [_inputs(q, case, shape, dtype) for q in range(n)]
                x = xs[r].to(device)
                label = f"{t} {coll}{'(' + op + ')' if op else ''} {dn}"
                try:
                    if coll == "all_reduce":
                        got, want = view.all_reduce(x, op), _reference(op, xs)
                    elif coll == "reduce_scatter":
                        got, want = view.reduce_scatter(x, op), _reference(op, xs)[r * 3:(r + 1) * 3]
                    elif coll == "all_gather":
                        got, want = view.all_gather(x), torch.cat(xs)
                    elif coll == "broadcast":
                        src = n - 1
                        got, want = view.broadcast(x, src), xs[src]
                    else:  # uneven, zero counts among them: rank q sends (q + 2p + 1) % 3 rows to rank p
                        rows = [[_inputs(q, case, (_rows(q, p), 5), dtype) for p in range(n)] for q in range(n)]
                        send = torch.cat(rows[r]).to(device)
                        got = view.all_to_all(send, [_rows(r, p) for p in range(n)])
                        want = torch.cat([rows[q][r] for q in range(n)])
                    if want.dtype != dtype and dtype.is_floating_point:
                        want = want.to(dtype)  # the reference rounded as the result is
                    if got.device.type != torch.device(device).type:
                        failures.append(f"{label}: result on {got.device}, input on {device}")
                    elif not _close(got, want, dn):
                        failures.append(f"{label}: wrong result ({_difference(got, want)})")
                except Exception as e:  # noqa: BLE001 - recorded; the next case goes on
                    failures.append(f"{label}: raised {type(e).__name__}: {str(e)[:300]}")
        for numel in (0, 1001, large_numel) if large_numel else (0, 1001):
            for coll in ("all_reduce", "all_gather", "all_to_all"):
                cases += 1
                label = f"{t} {coll} float32 x {numel}"
                xs = [_inputs(q, 20_000 + cases, (numel,), torch.float32) for q in range(n)]
                try:
                    x = xs[r].to(device)
                    if coll == "all_reduce":
                        got, want = view.all_reduce(x), _reference("sum", xs).float()
                    elif coll == "all_gather":
                        got, want = view.all_gather(x), torch.cat(xs)
                    else:  # even split of whole rows where it divides, the rest to the last rank
                        counts = [numel // n] * (n - 1) + [numel - (numel // n) * (n - 1)]
                        got = view.all_to_all(x, counts)
                        offsets = [sum(counts[:p]) for p in range(n)]
                        want = torch.cat([xs[q][offsets[r]:offsets[r] + counts[r]] for q in range(n)])
                    if not _close(got, want, "float32"):
                        failures.append(f"{label}: wrong result ({_difference(got, want)})")
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{label}: raised {type(e).__name__}: {str(e)[:300]}")
    try:  # split: everyone in one group, then every rank alone
        for together in (True, False):
            sub = comm.split(0 if together else 1 + r)
            try:
                cases += 1
                xs = [_inputs(q, 10_000 + together, (4, 3), torch.float32) for q in range(n)]
                members = list(range(n)) if together else [r]
                got = sub.all_reduce(xs[r].to(device))
                if sub.size != len(members) or not _close(got, _reference("sum", [xs[q] for q in members]), "float32"):
                    failures.append(f"split({'one group' if together else 'each rank alone'}): wrong all_reduce")
            finally:
                sub.close()
    except Exception as e:  # noqa: BLE001
        failures.append(f"split: raised {type(e).__name__}: {str(e)[:300]}")
    return {"transports": names, "cases": cases, "failures": failures}


def _rows(sender: int, receiver: int) -> int:
    """Rows ``sender`` sends ``receiver`` in the uneven all_to_all case: 0, 1 or 2, zeros included."""
    return (sender + 2 * receiver + 1) % 3


def _graphs_body(comm: Any, device: str, replays: int, transports: Sequence[str]) -> dict[str, Any]:
    """On every rank (CUDA only): per transport nccl and ipc, capture one all_reduce in a CUDA graph,
    then replay it ``replays`` times with fresh inputs copied into the captured buffer, each result
    checked against the sum of every rank's regenerated input."""
    import torch

    failures: list[str] = []
    n, r = comm.size, comm.rank
    for t in transports:
        if t not in comm.transports:
            failures.append(f"{t}: did not come up (available: {sorted(comm.transports)})")
            continue
        view = comm.using(t)
        try:
            x = _inputs(r, 0, (4096,), torch.float32).to(device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm up outside the capture (lazy setup must not be captured)
                    view.all_reduce(x)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = view.all_reduce(x)
            wrong = 0
            for i in range(1, replays + 1):
                xs = [_inputs(q, i, (4096,), torch.float32) for q in range(n)]
                x.copy_(xs[r].to(device))
                graph.replay()
                torch.cuda.synchronize()
                wrong += not _close(y, _reference("sum", xs), "float32")
            if wrong:
                failures.append(f"{t}: {wrong} of {replays} replays gave a wrong sum")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{t}: raised {type(e).__name__}: {str(e)[:300]}")
    return {"replays": replays, "failures": failures}


def _abort_body(comm: Any, device: str, transport: str, timeout: float) -> dict[str, Any]:
    """Rank 1 never joins the all_reduce (it sleeps past the timeout); every other rank must raise
    CollectiveTimeoutError naming rank 1 after about ``timeout`` seconds, not hang.

    Returns:
        {"failures": [...]} (this rank's).
    """
    import torch

    from transports.base import CollectiveTimeoutError

    if comm.rank == 1:
        time.sleep(2.5 * timeout)
        return {"failures": []}
    if transport not in comm.transports:
        return {"failures": [f"{transport}: did not come up (available: {sorted(comm.transports)})"]}
    x = _inputs(comm.rank, 0, (1024,), torch.float32).to(device)
    t0 = time.monotonic()
    try:
        comm.using(transport).all_reduce(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    except CollectiveTimeoutError as e:
        waited = time.monotonic() - t0
        failures = [] if e.missing_ranks == [1] else [f"{transport}: missing_ranks {e.missing_ranks}, expected [1]"]
        if not 0.5 * timeout < waited < 2.4 * timeout:
            failures.append(f"{transport}: raised after {waited:.1f} s with a {timeout} s timeout")
        return {"failures": failures}
    except Exception as e:  # noqa: BLE001
        return {"failures": [f"{transport}: raised {type(e).__name__}: {str(e)[:300]}, not CollectiveTimeoutError"]}
    return {"failures": [f"{transport}: all_reduce returned without rank 1"]}


def check_abort(nprocs: int = 2, device: str = "cuda:0", transports: Sequence[str] | None = None,
                timeout: float = 4.0) -> dict[str, Any]:
    """Run :func:`_abort_body` once per transport (a communicator is unusable after a timeout);
    ``transports`` defaults to :func:`gpu_transports`'s."""
    import collectives

    forced, not_run = "auto", []
    if transports is None:
        transports, forced, not_run = gpu_transports(nprocs)
    failures = []
    for t in transports:
        results = collectives.launch(_abort_body, nprocs, device, t, timeout, timeout=timeout, device=device,
                                     transport=forced, return_exceptions=True)
        for q, res in enumerate(results):
            if isinstance(res, BaseException):
                failures.append(f"rank {q}: {t}: the rank failed: {type(res).__name__}: {str(res)[:300]}")
            else:
                failures += [f"rank {q}: {f}" for f in res["failures"]]
    return {"nprocs": nprocs, "device": device, "transports": list(transports), "not_run": not_run,
            "failures": failures}


LARGE_NUMEL = 64 << 20  # float32 elements: 256 MiB per rank, the size the GPU issues ask the checks to reach


def check_collectives(nprocs: int, device: str = "cuda:0", required: Sequence[str] | None = None,
                      transport: str | None = None, options: dict[str, Any] | None = None,
                      timeout: float = 120.0, large_numel: int = LARGE_NUMEL) -> dict[str, Any]:
    """Run :func:`_collectives_body` on ``nprocs`` ranks, all on ``device``.

    Args:
        required, transport: the transports that must come up and the communicator's transport=
            [default: :func:`gpu_transports`].
        large_numel: float32 elements of the largest size case (0: none).
    Returns:
        {"nprocs", "device", "cases", "transports", "not_run", "failures": [per-rank failure strings,
        rank-prefixed]}.
    """
    import collectives

    not_run: list[str] = []
    if required is None:
        required, forced, not_run = gpu_transports(nprocs)
        transport = transport or forced
    transport = transport or "auto"

    results = collectives.launch(_collectives_body, nprocs, device, list(required), large_numel,
                                 transport=transport, options=options, timeout=timeout, device=device)
    failures = [f"rank {q}: {f}" for q, res in enumerate(results) for f in res["failures"]]
    return {"nprocs": nprocs, "device": device, "cases": results[0]["cases"], "transports": results[0]["transports"],
            "not_run": not_run, "failures": failures}


def check_graphs(nprocs: int, device: str = "cuda:0", replays: int = 100, timeout: float = 120.0) -> dict[str, Any]:
    """Run :func:`_graphs_body` on ``nprocs`` ranks, all on ``device`` (needs CUDA)."""
    import collectives

    transports, forced, not_run = gpu_transports(nprocs)
    results = collectives.launch(_graphs_body, nprocs, device, replays, transports, timeout=timeout, device=device,
                                 transport=forced)
    return {"nprocs": nprocs, "device": device, "replays": replays, "transports": list(transports),
            "not_run": not_run, "failures": [f"rank {q}: {f}" for q, res in enumerate(results) for f in res["failures"]]}
