"""moecomm's own host time per repeated ipc all_reduce, without a GPU: the latency path from
``comm.all_reduce(x)`` to the point where the kernel launcher is called, with the launcher replaced
by a no-op (the arguments are still built and passed to it).

    python tools/ipc_host_overhead.py [--calls 20000] [--numel 2048]

One process, one rank, ipc emulated (host provider); the transport's latency closure is built as on
a GPU (``emulate`` off: addresses, not tensors, after the first call). What it leaves out:
Triton's compiled launcher (``CompiledKernel.run``, about 4 us per tritonbench PRs 1016 and 669)
and ``cuLaunchKernel`` itself. On a GPU, ``python -m tools.profile_ipc`` measures the whole
call. Prints the median and p90 in microseconds of the full call and of the transport's closure.
"""

from __future__ import annotations

import os
import statistics
import time

import click


class _NoLaunch:
    """Stands for a CompiledKernel: its launcher does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args: object) -> None:
        pass


@click.command()
@click.option("--calls", type=click.IntRange(min=100), default=20000, show_default=True)
@click.option("--numel", type=click.IntRange(min=1), default=2048, show_default=True)
def main(calls: int, numel: int) -> None:
    os.environ.setdefault("MOECOMM_IPC_EMULATE", "1")
    os.environ.setdefault("MOECOMM_LAUNCH", "single")
    import torch

    import collectives
    from transports import _ipc_launch

    comm = collectives.init(transport="ipc")
    ipc = comm.transports["ipc"]
    launched = []
    _ipc_launch.BoundKernel.__call__ = lambda self, *args, key=None: launched.append(key)  # no kernel
    ipc.emulate = ipc.eager_check = False  # build the closure the way it is built on a GPU
    x = torch.randn(numel, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    comm.all_reduce(x, out=out)  # makes the cached entry and its closure
    for b in ipc._bound.values():  # as after the first GPU launch: the variant is compiled
        for key in set(launched):
            b._compiled[key] = _NoLaunch()
    _ipc_launch.current_stream = lambda device: 0
    torch.cuda.current_device = lambda: 0  # no CUDA here: the stream lookup above is a stand-in
    ipc._status[:] = 0
    ipc._launched = 0
    whole, closure = [], []
    ent = next(e for e in comm._cpu_cache.values() if e.by_address is not None)
    xa, oa = x.data_ptr(), out.data_ptr()
    for _ in range(calls):
        t0 = time.perf_counter()
        comm.all_reduce(x, out=out)
        t1 = time.perf_counter()
        ent.by_address(xa, oa)
        t2 = time.perf_counter()
        whole.append((t1 - t0) * 1e6)
        closure.append((t2 - t1) * 1e6)
    ipc._launched = ipc._done()  # nothing ran: nothing is in flight
    for name, vs in (("comm.all_reduce", whole), ("latency closure", closure)):
        vs.sort()
        click.echo(f"{name:<16} median {statistics.median(vs):6.2f} us  p90 {vs[9 * len(vs) // 10]:6.2f} us "
                   f"({calls} calls, {numel} x bfloat16, launcher excluded)")
    comm.close()


if __name__ == "__main__":
    main()
