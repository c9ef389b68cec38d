"""How fast the ipc kernels' bounded waits turn on this GPU, against ``transports.ipc._SPINS_PER_SECOND``.

The ipc transport bounds every in-kernel wait at ``timeout * _SPINS_PER_SECOND + 1`` turns, assuming
a turn takes at least 1 us on every device. If a turn is faster, a kernel gives up before the host's
timeout and records the peer it waited for (ERROR = peer + 1): a peer that is merely slow (compiling
its kernels, say) is blamed for failing. Here one program spins on a word that never arrives, with
the bound the transport would give a timeout of TIMEOUT_S, and the wait must last at least that long.
Measured for both kinds of loop the kernels have: ``sync.wait_flag`` (an acquire atomic and the ABORT
word per turn: barriers, the MoE exchange) and ``lamport._arrive`` (a tile of volatile loads, a
reduction and two words per turn) at a small and at the transport's tile. One program: nothing
contends with it, so its turns are the fastest a launch gets.

The measured turns per second are logged (``validate-gpu --quick`` shows them: pytest ``-rsP``) and
named in a failure. On the CPU the same kernels run in Triton's interpreter, far slower than the bound
assumes, with a tiny timeout: that proves the test's kernels and bookkeeping, not the GPU's speed.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from transports.ipc import CUDA_BLOCK, _SPINS_PER_SECOND  # noqa: E402
from transports.kernels import layout as L  # noqa: E402
from transports.kernels.lamport import _arrive  # noqa: E402
from transports.kernels.sync import wait_flag  # noqa: E402

log = logging.getLogger(__name__)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
emulated = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                              reason="emulation runs in the CPU suite (Triton's interpreter)")

TIMEOUT_S = 0.5  # on the GPU: long enough that the launch and the host's timer are noise
# (loop, tile): wait_flag has no tile; the Lamport reader at a small row (the fused RMSNorm of a small
# hidden size: BLOCK_H) and at the all_reduce's tile
LOOPS = [("wait_flag", 1), ("lamport_arrive", 16), ("lamport_arrive", CUDA_BLOCK)]


@triton.jit(do_not_specialize=["max_spins"])
def _wait_flag_kernel(flag, my_sig, status, max_spins):
    wait_flag(flag, 1, my_sig, status, 0, max_spins)


@triton.jit(do_not_specialize=["max_spins"])
def _arrive_kernel(rows, my_sig, status, max_spins, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    _arrive(rows + offs, offs < BLOCK, my_sig, status, 0, max_spins)


def max_spins(timeout: float) -> int:
    """The bound IPCTransport gives its waits for a communicator timeout (its ``_max_spins``)."""
    return min(int(timeout * _SPINS_PER_SECOND) + 1, 1 << 62)


def timed_wait(loop: str, tile: int, spins: int, device: str) -> tuple[float, int]:
    """(seconds, ERROR word) of one program waiting ``spins`` turns for data that never come."""
    my_sig = torch.zeros(L.SIGNAL_WORDS, dtype=torch.int64, device=device)  # ABORT and ERROR 0
    status = torch.zeros(L.STATUS_WORDS, dtype=torch.int64, device=device)
    if loop == "wait_flag":
        target = torch.zeros(1, dtype=torch.int64, device=device)  # the flag stays below 1
        launch = lambda: _wait_flag_kernel[(1,)](target, my_sig, status, spins)  # noqa: E731
    else:
        target = torch.full((tile,), L.LAMPORT_SENTINEL_BITS, dtype=torch.int32, device=device)  # never arrived
        launch = lambda: _arrive_kernel[(1,)](target, my_sig, status, spins, BLOCK=tile)  # noqa: E731
    if device == "cpu":  # the interpreter runs the kernel in the call
        t0 = time.perf_counter()
        launch()
        return time.perf_counter() - t0, int(my_sig[L.ERROR])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    launch()
    end.record()
    torch.cuda.synchronize()  # the kernel's own time, without the host's launch
    return start.elapsed_time(end) / 1000, int(my_sig[L.ERROR])


def _check(loop: str, tile: int, timeout: float, device: str) -> float:
    """Assert the wait bounded for ``timeout`` lasts at least ``timeout`` and gave up on its own; the
    measured turns per second."""
    timed_wait(loop, tile, 2, device)  # compiles outside the timed launch
    spins = max_spins(timeout)
    seconds, error = timed_wait(loop, tile, spins, device)
    rate = spins / seconds
    log.warning("%s (tile %d) on %s: %d turns in %.3f s: %.3g turns/s; the bound assumes <= %.3g",
                loop, tile, device, spins, seconds, rate, _SPINS_PER_SECOND)
    assert error == 1, f"{loop}: ERROR {error}, not peer 0 + 1: the wait did not give up on its bound"
    assert seconds >= timeout, (
        f"{loop} (tile {tile}): {spins} turns took {seconds:.3f} s, less than the {timeout} s timeout they stand "
        f"for: {rate:.3g} turns/s here, above transports.ipc._SPINS_PER_SECOND = {_SPINS_PER_SECOND:.3g}; a wait "
        f"gives up early and blames a peer that is only slow (raise _SPINS_PER_SECOND to at least {rate:.2g})")
    return rate


@needs_gpu
@pytest.mark.parametrize("loop,tile", LOOPS)
def test_a_bounded_wait_lasts_the_host_timeout_on_the_gpu(loop, tile):
    _check(loop, tile, TIMEOUT_S, "cuda")


@emulated
@pytest.mark.parametrize("loop,tile", LOOPS[:2])
def test_the_same_waits_in_emulation(loop, tile):
    # the interpreter takes about a millisecond a turn: 0.2 ms of bound is 201 turns
    _check(loop, tile, 0.0002, "cpu")
