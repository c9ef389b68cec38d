"""Bad input and faults: every rank raises a clear error, nobody hangs, nothing is left in /dev/shm."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

import collectives
from collectives import CollectiveTimeoutError, PeerFailedError, RankFailedError
from spmd import (SHM_PATHS, UNDER_MPI, left_behind, mark_done, run, shm_segments, transports_under_test,
                  wait_done)


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return None


def _body_mismatch(comm):
    """Each case differs on one rank; every rank must raise ValueError naming what differs, then go on."""
    r = comm.rank
    x = torch.randn(8, 3)
    results = {
        "shape": _catch(lambda: comm.all_reduce(torch.randn(8 + r, 3))),
        "dtype": _catch(lambda: comm.all_gather(x.double() if r == 1 else x)),
        "op": _catch(lambda: comm.all_reduce(x, op="max" if r == 0 else "sum")),
        "collective": _catch(lambda: comm.all_gather(x) if r == 0 else comm.broadcast(x)),
        "src": _catch(lambda: comm.broadcast(x, src=r)),
        "a2a_trailing": _catch(lambda: comm.all_to_all(torch.randn(comm.size * 2, 3 + r))),
        "local_dtype": _catch(lambda: comm.all_reduce(torch.zeros(4, dtype=torch.complex64) if r == 1 else
                                                      torch.zeros(4))),
        "bad_counts": _catch(lambda: comm.all_to_all(torch.randn(4, 2), [4] + [0] * (comm.size - 1) if r else [1, 1])),
        "bad_rs_rows": _catch(lambda: comm.reduce_scatter(torch.randn(comm.size * 2 + (r == 0), 2))),
        "reject": _catch(lambda: comm.reject(KeyError("layer config")) if r == 1 else comm.all_gather(x)),
    }
    results["rank"] = r
    # the communicator stays usable after every one of these
    ok = comm.all_reduce(torch.ones(3) * (r + 1))
    assert torch.equal(ok, torch.full((3,), float(sum(range(1, comm.size + 1)))))
    return results


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_mismatched_arguments_raise_on_every_rank(transport):
    res = run(_body_mismatch, 2, transport=transport)
    for results in res:
        r = results["rank"]
        shape = results["shape"]
        assert shape[0] == "ValueError" and "shape differs" in shape[1] and "rank 0: (8, 3)" in shape[1] \
            and "rank 1: (9, 3)" in shape[1], shape
        assert results["dtype"][0] == "ValueError" and "dtype differs" in results["dtype"][1]
        assert "float64" in results["dtype"][1]
        assert results["op"][0] == "ValueError" and "op differs" in results["op"][1] and "max" in results["op"][1]
        assert results["collective"][0] == "ValueError" and "collective differs" in results["collective"][1]
        assert results["src"][0] == "ValueError" and "src differs" in results["src"][1]
        assert results["a2a_trailing"][0] == "ValueError" and "shape differs" in results["a2a_trailing"][1]
        if r == 1:  # the rank that passed complex64
            assert results["local_dtype"][0] == "TypeError" and "complex64" in results["local_dtype"][1]
        else:
            assert results["local_dtype"][0] == "ValueError" and "rank(s) [1] rejected" in results["local_dtype"][1]
        if r == 1:
            assert results["reject"][0] == "KeyError"
        else:
            assert results["reject"][0] == "ValueError" and "rank(s) [1] rejected" in results["reject"][1]
        assert results["bad_counts"] is not None and results["bad_counts"][0] == "ValueError"
        assert results["bad_rs_rows"] is not None and results["bad_rs_rows"][0] == "ValueError"


def _body_unsupported(comm):
    r = {}
    r["avg_int"] = _catch(lambda: comm.all_reduce(torch.arange(4), op="avg"))
    r["sum_bool"] = _catch(lambda: comm.all_reduce(torch.ones(4, dtype=torch.bool)))
    r["bad_op"] = _catch(lambda: comm.all_reduce(torch.ones(4), op="xor"))
    r["bad_type"] = _catch(lambda: comm.all_reduce([1.0, 2.0]))
    r["np_complex"] = _catch(lambda: comm.all_gather(np.zeros(3, dtype=np.complex128)))
    r["bad_src"] = _catch(lambda: comm.broadcast(torch.ones(2), src=comm.size))
    r["bad_out"] = _catch(lambda: comm.all_reduce(torch.ones(4), out=torch.empty(5)))
    r["after"] = comm.all_reduce(torch.ones(2)).tolist()
    return r


def test_unsupported_input_raises_up_front():
    res = run(_body_unsupported, 2)[0]
    assert res["avg_int"][0] == "TypeError" and "floating" in res["avg_int"][1]
    assert res["sum_bool"][0] == "TypeError" and "bool" in res["sum_bool"][1]
    assert res["bad_op"][0] == "ValueError" and "xor" in res["bad_op"][1]
    assert res["bad_type"][0] == "TypeError"
    assert res["np_complex"][0] == "TypeError"
    assert res["bad_src"][0] == "ValueError" and "src" in res["bad_src"][1]
    assert res["bad_out"][0] == "ValueError" and "out has shape (5,)" in res["bad_out"][1]
    assert res["after"] == [2.0, 2.0]


# ---- process faults: spawned ranks only (under mpiexec a dead rank takes the job down) -------------
pytestmark_spawn = pytest.mark.skipif(UNDER_MPI, reason="fault injection needs spawned ranks")


def _body_user_error(comm):
    comm.barrier()
    if comm.rank == 1:
        raise KeyError("boom on rank 1")
    comm.all_reduce(torch.ones(3))  # rank 0 waits here until launch kills it
    return "unreachable"


@pytestmark_spawn
def test_rank_error_is_reraised_and_others_killed():
    before = shm_segments()
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank 1") as info:
        collectives.launch(_body_user_error, 3, timeout=60)
    assert time.monotonic() - t0 < 30  # not the 60 s timeout: launch killed the waiting ranks
    assert info.value.rank == 1
    assert "Traceback on rank 1" in str(info.value.__cause__)
    assert not left_behind(before)


def _body_cause_after_consequence(comm):
    if comm.rank == 1:
        comm.close()  # rank 0 raises PeerFailedError at once ...
        time.sleep(0.5)
        raise KeyError("the cause, reported after its consequence")  # ... and this arrives later
    comm.barrier()
    return "unreachable"


@pytestmark_spawn
def test_launch_raises_the_cause_not_the_peers_consequence():
    with pytest.raises(KeyError, match="the cause") as info:
        collectives.launch(_body_cause_after_consequence, 2, timeout=30)
    assert info.value.rank == 1


def _body_killed(comm, victim: int):
    small, large = torch.randn(1000), torch.randn(300_000)  # the latency path; single copy where it is on
    rows = torch.randn(4 * 40_000)  # in-place all_to_all: swapped in chunks where single copy is on
    for i in range(10_000):
        if comm.rank == victim and i == 50 + victim:  # the others wait in an all_to_all swap (rank 2 here)
            os.kill(os.getpid(), signal.SIGKILL)
        step = i % 4
        if step == 3:
            comm.all_to_all(rows, out=rows)
        elif step == 2:
            comm.all_gather(large)  # pushed into the peers where single copy is on
        else:
            comm.all_reduce(small if step else large)
    return "finished"


@pytestmark_spawn
@pytest.mark.parametrize("path", SHM_PATHS)
def test_rank_killed_mid_loop_makes_others_raise(path):
    before = shm_segments()
    timeout = 20.0
    t0 = time.monotonic()
    res = collectives.launch(_body_killed, 4, 2, timeout=timeout, return_exceptions=True, options=SHM_PATHS[path])
    elapsed = time.monotonic() - t0
    assert isinstance(res[2], RankFailedError) and "SIGKILL" in str(res[2])
    for r in (0, 1, 3):
        assert isinstance(res[r], PeerFailedError), res[r]
        assert "rank 2" in str(res[r]) and res[r].missing_ranks == [2]
    assert elapsed < timeout, f"survivors took {elapsed:.1f}s: a dead peer must be noticed before the timeout"
    assert not left_behind(before)


def _body_killed_timed(comm, op: str, path: int):
    """A rank dies while the others are in a timed all_gather or all_to_all (transports/_path_choice.py) on
    ``path``: rank 0's choice, forced here, which every rank follows. ``all_to_all_in_place``: the
    in-place swap, by single copy or through the slots."""
    from transports import _shm_single_copy
    from transports.base import OpCode

    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_GATHER] = 32 << 10  # small sizes, several staged rounds
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_TO_ALL] = 32 << 10
    _shm_single_copy.SINGLE_COPY_WHEN_OVERSUBSCRIBED = True  # 3 ranks on the 2-core CI machine
    sub = comm.split(0, options={"shm_slot_bytes": 4096})
    shm = sub.transports["shm"]
    chooser = {"all_gather": shm._gather_chooser, "all_to_all": shm._a2a_chooser,
               "all_to_all_in_place": shm._swap_chooser}[op]
    if sub.rank == 0:
        chooser.choose = lambda key: path
        chooser.record = lambda key, path, seconds: None
    x = torch.randn(3 * 3_000)  # 36 KB per rank: timed
    for i in range(10_000):
        if sub.rank == 2 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        if op == "all_gather":
            sub.all_gather(x)
        elif op == "all_to_all":
            sub.all_to_all(x)
        else:
            sub.all_to_all(x, out=x)
    return "finished"


@pytestmark_spawn
@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "all_to_all_in_place"])
@pytest.mark.parametrize("path", ["staged", "single copy"])
def test_rank_killed_in_a_timed_path_makes_others_raise(op, path):
    from transports._shm_single_copy import SINGLE_PATH, STAGED_PATH

    before = shm_segments()
    res = collectives.launch(_body_killed_timed, 3, op, STAGED_PATH if path == "staged" else SINGLE_PATH,
                             timeout=20.0, return_exceptions=True, transport="shm")
    assert isinstance(res[2], RankFailedError) and "SIGKILL" in str(res[2])
    for r in (0, 1):
        assert isinstance(res[r], PeerFailedError) and res[r].missing_ranks == [2], res[r]
    assert not left_behind(before)


def _body_absent(comm, flags):
    if comm.rank == 1:
        wait_done(flags, [0, 2])  # never arrives: alive, away until the others have given up
        return "late"
    t0 = time.monotonic()
    try:
        comm.all_gather(torch.ones(2))
    except CollectiveTimeoutError as e:
        return type(e).__name__, str(e), e.missing_ranks, time.monotonic() - t0
    finally:
        mark_done(flags, comm.rank)
    return "no error"


@pytestmark_spawn
@pytest.mark.parametrize("path", SHM_PATHS)
def test_absent_rank_times_out_naming_it(path, tmp_path):
    res = collectives.launch(_body_absent, 3, str(tmp_path), timeout=2.0, return_exceptions=True,
                             options=SHM_PATHS[path])
    for r in (0, 2):
        name, msg, missing, waited = res[r]
        assert name == "CollectiveTimeoutError" and missing == [1] and "rank(s) [1]" in msg
        assert 1.5 < waited < 6, waited


def _body_closed_peer(comm, flags):
    if comm.rank == 0:
        comm.close()
        wait_done(flags, [1])  # alive (closed, not dead) until rank 1 has seen it
        return "closed"
    try:
        comm.barrier()
    except PeerFailedError as e:
        return str(e)
    finally:
        mark_done(flags, 1)
    return "no error"


@pytestmark_spawn
def test_peer_that_closed_makes_waiters_raise(tmp_path):
    res = collectives.launch(_body_closed_peer, 2, str(tmp_path), timeout=30.0)
    assert "rank 0 closed its communicator" in res[1]


def _body_broken_after_failure(comm, flags):
    if comm.rank == 1:
        wait_done(flags, [0])  # never calls: away until rank 0 is done
        return "late"
    try:
        with pytest.raises(CollectiveTimeoutError):
            comm.all_reduce(torch.ones(1))
        with pytest.raises(collectives.CommunicatorBrokenError, match="create a new one"):
            comm.all_reduce(torch.ones(1))
    finally:
        mark_done(flags, 0)
    return "ok"


@pytestmark_spawn
def test_communicator_unusable_after_timeout_says_so(tmp_path):
    assert collectives.launch(_body_broken_after_failure, 2, str(tmp_path), timeout=1.0)[0] == "ok"


# ---- shared memory hygiene ----------------------------------------------------------------------
@pytestmark_spawn
def test_segment_private_unguessable_and_unlinked(monkeypatch):
    seen = []
    real_unlink = os.unlink

    def spy(path, *a, **k):
        if "moecomm-" in str(path):
            st = os.stat(path)
            seen.append((os.path.basename(path), st.st_mode & 0o777, st.st_uid))
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", spy)
    with collectives.init(transport="shm") as comm:
        assert comm.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
        name = comm.transports["shm"].segment_name
    assert [s[0] for s in seen] == [name]
    _, mode, uid = seen[0]
    assert mode == 0o600 and uid == os.getuid()
    token = name.rsplit("-", 1)[1]
    assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits
    assert name not in shm_segments()


@pytestmark_spawn
def test_stale_segment_of_dead_process_is_removed_on_next_start():
    import subprocess

    from transports._segment import remove_stale_segments

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/moecomm-{os.getuid()}-{dead.pid}-{'ab' * 16}"
    live = f"/dev/shm/moecomm-{os.getuid()}-{os.getpid()}-{'cd' * 16}"
    for p in (stale, live):
        with open(p, "wb") as f:
            f.write(b"x")
    try:
        with collectives.init(transport="shm"):
            pass  # creating a communicator sweeps stale segments
        assert not os.path.exists(stale)
        assert os.path.exists(live)  # its creator (this process) is alive
    finally:
        for p in (stale, live):
            if os.path.exists(p):
                os.unlink(p)
    assert remove_stale_segments() == []


@pytestmark_spawn
def test_forced_transport_unavailable_says_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="mpi needs a launch by mpirun"):
        collectives.init(transport="mpi")
    monkeypatch.setenv("MOECOMM_TRANSPORT", "shm")
    with collectives.init() as comm:
        assert comm.plan("all_reduce", torch.ones(3)).reason.startswith("forced")


@pytest.mark.skipif(UNDER_MPI, reason="one process against another: the spawned suite checks it")
def test_signature_digest_is_the_same_in_every_process():
    """The fast agreement check compares digests across processes, so they must not be salted: a
    process whose string hashes differ from this one's (another PYTHONHASHSEED) computes the same."""
    import subprocess
    import sys

    from transports.base import OpCode, Signature

    code = ("from transports.base import Signature, OpCode; import torch; print(hash('moecomm')); "
            "print(Signature.of(OpCode.ALL_REDUCE, dtype=torch.float32, shape=(3, 5)).value)")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # not this process's seed
    their_hash, their_digest = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()
    assert int(their_hash) != hash("moecomm"), "the other process hashes strings as this one does"
    assert their_digest == str(Signature.of(OpCode.ALL_REDUCE, dtype=torch.float32, shape=(3, 5)).value)


# ---- local errors reach the peers (adversarial findings 5, 6, 8, 12, 14) --------------------------
def _local_error_cases(comm) -> dict:
    """Cases where rank 1 alone passes something wrong; name -> (call, words rank 1's error must name)."""
    r, n = comm.rank, comm.size
    bad = r == 1
    g = torch.Generator().manual_seed(7 + r)
    x = torch.rand(4, generator=g) + 0.5
    x2 = torch.rand(2, 2, generator=g) + 0.5
    rows = torch.rand(2 * n, 3, generator=g)
    ro = np.random.default_rng(r).random(4).astype(np.float32)
    ro.flags.writeable = False
    return {
        # out= that cannot hold the result
        "out_list_all_reduce": (lambda: comm.all_reduce(x, out=[0, 0, 0, 0] if bad else None), ["out", "list"]),
        "out_list_all_gather": (lambda: comm.all_gather(x, out=[0] * 4 * n if bad else None), ["out", "list"]),
        "out_list_reduce_scatter": (lambda: comm.reduce_scatter(rows, out=[[0.0] * 3] * 2 if bad else None),
                                    ["out", "list"]),
        "out_list_broadcast": (lambda: comm.broadcast(x, out=[0] * 4 if bad else None), ["out", "list"]),
        "out_list_all_to_all": (lambda: comm.all_to_all(rows, out=[[0.0] * 3] * 2 if bad else None),
                                ["out", "list"]),
        "out_requires_grad": (lambda: comm.all_reduce(x, out=torch.empty(4, requires_grad=True) if bad else None),
                              ["out", "requires grad"]),
        "out_requires_grad_a2a": (lambda: comm.all_to_all(
            rows, out=torch.empty(2, 3, requires_grad=True) if bad else None), ["out", "requires grad"]),
        "out_read_only_numpy": (lambda: comm.all_reduce(ro, out=ro if bad else None), ["out", "read-only"]),
        "out_sparse": (lambda: comm.all_reduce(x, out=torch.zeros(4).to_sparse() if bad else None),
                       ["out", "sparse"]),
        # inputs without a dense native-endian layout
        "big_endian": (lambda: comm.all_reduce(x.numpy().astype(">f4") if bad else x.numpy()), ["byte order"]),
        "sparse_coo": (lambda: comm.all_reduce(x.to_sparse() if bad else x), ["sparse", "to_dense"]),
        "sparse_csr": (lambda: comm.all_reduce(x2.to_sparse_csr() if bad else x2), ["sparse_csr", "to_dense"]),
        "meta": (lambda: comm.all_reduce(torch.empty(4, device="meta") if bad else x), ["meta"]),
        # integers: int and NumPy integers only, the same rule on every path
        "src_bool": (lambda: comm.broadcast(x, src=True if bad else 1), ["src", "integer", "True"]),
        "src_float": (lambda: comm.broadcast(x, src=1.0 if bad else 1), ["src", "integer", "1.0"]),
        "counts_bool": (lambda: comm.all_to_all(rows, [True] * n if bad else [2] * n), ["send_counts", "True"]),
        "counts_float": (lambda: comm.all_to_all(rows, [2.0] * n if bad else [2] * n), ["send_counts", "2.0"]),
        "counts_float_tensor": (lambda: comm.all_to_all(rows, torch.full((n,), 2.0) if bad else [2] * n),
                                ["send_counts", "float32"]),
        "split_str": (lambda: comm.split("a" if bad else 0), ["color", "'a'"]),
        "split_float": (lambda: comm.split(0.5 if bad else 0), ["color", "0.5"]),
        "split_key_float": (lambda: comm.split(0, key=1.5 if bad else None), ["key", "1.5"]),
    }


def _body_local_errors(comm):
    """Each case is wrong on rank 1 only: rank 1 raises a TypeError naming the problem, the others a
    ValueError naming rank 1, at once; then the communicator still works."""
    r = comm.rank
    comm.all_reduce(torch.rand(4))  # shapes seen before take the hot path: it must check as well
    comm.all_reduce(torch.rand(2, 2))
    results = {name: _catch(call) for name, (call, _) in _local_error_cases(comm).items()}
    # shapes past 8 dims that differ only in the folded trailing dims (finding 6)
    results["dims_past_8"] = _catch(lambda: comm.all_reduce(torch.rand((1,) * 7 + ((2, 3) if r == 0 else (3, 2)))))
    results["split_bad_option"] = _catch(lambda: comm.split(0, options={"shm_slot_bytes": "lots"} if r == 1 else None))
    # float colors are refused on every rank, not truncated into one group
    results["split_float_everywhere"] = _catch(lambda: comm.split(0.5 if r == 0 else 0.4))

    def big_color():  # any Python int is a color, on every path (MPI colors are C ints)
        sub = comm.split(2**40, key=-(2**40) * r)
        try:
            return sub.size, sub.rank, sub.all_reduce(torch.full((2,), float(r + 1))).tolist()
        finally:
            sub.close()

    def neg_stride_out():  # a NumPy out= with negative strides is written, not refused
        neg = np.zeros(4, dtype=np.float32)[::-1]
        vals = np.random.default_rng(3).random(4).astype(np.float32)
        return comm.all_reduce(vals, out=neg) is neg and np.allclose(neg, vals * comm.size)

    def after():
        return comm.all_reduce(torch.ones(3) * (r + 1)).tolist()

    for name, fn in (("big_color", big_color), ("neg_stride_out", neg_stride_out), ("after", after)):
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported with the other cases
            results[name] = (type(e).__name__, str(e))
    results["rank"] = r
    return results


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_local_errors_reach_every_rank(transport):
    res = run(_body_local_errors, 2, transport=transport, timeout=10.0)
    n = len(res) if not UNDER_MPI else 2
    failures = []
    for results in res:
        r = results["rank"]
        for name, (_, words) in _local_error_cases(_NameOnly(r, n)).items():
            got = results[name]
            if r == 1:
                ok = got is not None and got[0] == "TypeError" and all(w in got[1] for w in words)
            else:
                ok = got is not None and got[0] == "ValueError" and "rank(s) [1]" in got[1]
            if not ok:
                failures.append(f"rank {r} {name}: {got}")
        dims = results["dims_past_8"]
        if not (dims and dims[0] == "ValueError" and "shape differs" in dims[1] and "last 2 dims" in dims[1]):
            failures.append(f"rank {r} dims_past_8: {dims}")
        opt = results["split_bad_option"]
        if not (opt and opt[0] == "ValueError" and ("MOECOMM_SHM_SLOT_BYTES" in opt[1] if r == 1 else
                                                     "rank(s) [1] passed an invalid" in opt[1])):
            failures.append(f"rank {r} split_bad_option: {opt}")
        sfe = results["split_float_everywhere"]
        if not (sfe and sfe[0] == "TypeError" and "color" in sfe[1]):
            failures.append(f"rank {r} split_float_everywhere: {sfe}")
        if results["big_color"] != (2, 1 - r, [3.0, 3.0]):
            failures.append(f"rank {r} big_color: {results['big_color']}")
        if results["neg_stride_out"] is not True:
            failures.append(f"rank {r} neg_stride_out: {results['neg_stride_out']}")
        if results["after"] != [3.0] * 3:
            failures.append(f"rank {r} after: {results['after']}")
    assert not failures, "\n".join(failures)


class _NameOnly:
    """Stands in for a communicator when only the case names and expected words are needed."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _body_closed(comm):
    """After close(), every call (also of a view, also of a shape used before) raises CommunicatorBrokenError."""
    sub = comm.split(0)
    view = sub.using("auto")
    x = torch.rand(4)
    sub.all_reduce(x), view.all_reduce(x), sub.all_gather(x), sub.barrier(), view.barrier()
    sub.close()
    calls = {
        "all_reduce": lambda c: c.all_reduce(x),
        "all_gather": lambda c: c.all_gather(x),
        "reduce_scatter": lambda c: c.reduce_scatter(torch.rand(2 * comm.size)),
        "broadcast": lambda c: c.broadcast(x),
        "all_to_all": lambda c: c.all_to_all(torch.rand(2 * comm.size)),
        "barrier": lambda c: c.barrier(),
        "split": lambda c: c.split(0),
        "using": lambda c: c.using("auto"),
    }
    got = {f"{who}.{name}": _catch(lambda: call(c)) for who, c in (("sub", sub), ("view", view))
           for name, call in calls.items()}
    got["closed"] = (getattr(sub, "closed", None), getattr(view, "closed", None))
    return got


@pytest.mark.parametrize("transport", transports_under_test())
def test_calls_after_close_raise_communicator_broken(transport):
    for got in run(_body_closed, 2, transport=transport):
        closed = got.pop("closed")
        wrong = {k: v for k, v in got.items() if v is None or v[0] != "CommunicatorBrokenError" or "closed" not in v[1]}
        assert not wrong and closed == (True, True), (wrong, closed)


def _body_creation_errors(comm):
    """Communicator creation: a bad argument or setting on one rank makes every rank raise ValueError."""
    from collectives.communicator import Communicator
    from transports.settings import resolve

    r = comm.rank

    def fresh(**kw):
        # a new communicator over the same ranks, built the way init()/launch() build theirs
        rdv = comm._rdv.split(0, r, r, comm.size, list(range(comm.size)))
        return Communicator(rdv, comm.topology, **{"timeout": 10.0, **kw}).close()

    def with_env(name, value, **kw):
        old = os.environ.get(name)
        if r == 1:
            os.environ[name] = value
        try:
            return fresh(**kw)
        finally:
            if r == 1:
                if old is None:
                    del os.environ[name]
                else:
                    os.environ[name] = old

    return {
        "rank": r,
        "timeout_nan": _catch(lambda: fresh(timeout=float("nan") if r == 1 else 10.0)),
        "timeout_str": _catch(lambda: fresh(timeout="10" if r == 1 else 10.0)),
        "env_one_shot": _catch(lambda: with_env("MOECOMM_SHM_ONE_SHOT_MAX", "1000")),
        "env_transport": _catch(lambda: with_env("MOECOMM_TRANSPORT", "shm")),
        "env_bad_value": _catch(lambda: with_env("MOECOMM_SHM_SLOT_BYTES", "lots")),
        "options_slot": _catch(lambda: fresh(settings=resolve({"shm_slot_bytes": 8192} if r == 1 else {}))),
        "after": comm.all_reduce(torch.ones(2)).tolist(),
    }


@pytest.mark.parametrize("transport", transports_under_test())
def test_creation_errors_and_differing_settings_raise_on_every_rank(transport):
    failures = []
    for got in run(_body_creation_errors, 2, transport=transport):
        r = got.pop("rank")
        assert got.pop("after") == [2.0, 2.0]
        expect = {
            "timeout_nan": ("ValueError", ["timeout", "nan"] if r == 1 else ["rank(s) [1]", "timeout"]),
            "timeout_str": ("TypeError" if r == 1 else "ValueError", ["timeout", "'10'"]),
            "env_one_shot": ("ValueError", ["MOECOMM_SHM_ONE_SHOT_MAX", "rank 0: unset", "rank 1: 1000"]),
            "env_transport": ("ValueError", ["MOECOMM_TRANSPORT", "rank 0: 'auto'", "rank 1: 'shm'"]),
            "env_bad_value": ("ValueError", ["MOECOMM_SHM_SLOT_BYTES", "lots"]),
            "options_slot": ("ValueError", ["MOECOMM_SHM_SLOT_BYTES", "rank 0: 1048576", "rank 1: 8192"]),
        }
        for name, (kind, words) in expect.items():
            e = got[name]
            if e is None or e[0] != kind or not all(w in e[1] for w in words):
                failures.append(f"rank {r} {name}: {e}")
    assert not failures, "\n".join(failures)
