"""The libraries a sweep measures side by side: moecomm (per transport, and auto), mpi4py, torch.distributed.

Each peer binds an op to preallocated buffers (out-of-place or in-place, nccl-tests' layouts) and
returns a :class:`Bound` call; :func:`benchmarks.sweep.time_step` times and checks it the same way
for every peer. How each peer's variants map to its API:

================  ===============================  ================================================
peer              out-of-place                     in-place
================  ===============================  ================================================
moecomm           ``comm.<op>(x, out=out)``        ``out=`` aliasing the input per nccl-tests
                                                   (all_gather/reduce_scatter alias one block;
                                                   moecomm stages those through a temporary)
mpi4py            Allreduce, Allgather,            ``MPI.IN_PLACE``; Reduce_scatter_block's
                  Reduce_scatter_block, Alltoall,  result is the first block of the buffer (MPI's
                  Bcast (root sends x, others      definition, not nccl-tests' rank block)
                  receive into out)
torch.distributed copy + ``all_reduce`` /          ``all_reduce(buf)``, ``all_gather_single(buf,
(gloo, nccl)      ``broadcast`` (both in-place     block)``, ``reduce_scatter_single(block, buf)``,
                  only in torch); all_gather_,     ``all_to_all_single(buf, buf)``,
                  reduce_scatter_single,           ``broadcast(buf)``
                  all_to_all_single
================  ===============================  ================================================

The memcpy reference (:class:`MemcpyPeer`, with ``--compare``) is no library under measurement:
every rank copies the sweep size locally at the same time, once per size, timed by the same
harness, so each op's busbw can be read as a fraction of what this memory system copies.

mpi4py reductions use NumPy's typed buffers (so no float16/bfloat16 reductions: MPI has no
predefined type for them, and no average); data movement without reduction goes as bytes.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .common import DTYPES, MEMCPY, REDUCING, REFERENCE, out_numel

log = logging.getLogger("benchmarks")

EXTERNAL = ("mpi4py", "gloo", "nccl")


class Bound(NamedTuple):
    """One variant of one op on fixed buffers: ``call()`` runs it, ``result()`` is this rank's output,
    ``reset()`` restores the in-place buffer (None for out-of-place), ``sync()`` waits for the device."""

    call: Callable[[], object]
    result: Callable[[], torch.Tensor]
    reset: Callable[[], object] | None
    sync: Callable[[], None]


def _no_sync() -> None:
    return None


class Peer:
    """A library under measurement on this rank.

    Subclasses implement ``_call`` (one op from a source into a destination tensor); a library
    whose in-place API differs from nccl-tests' layouts (MPI's ``IN_PLACE``) overrides
    ``_out_of_place``/``_in_place`` instead.
    """

    name: str = "?"
    library: str = "?"
    device: str = "cpu"
    reference_op: str | None = None  # a reference (MemcpyPeer): the one op it runs, once per size
    # whether the library defines an in-place all_to_all (out is the input), so the sweep checks that
    # variant like the others; nccl-tests checks none ("We don't support in-place alltoall": NCCL has none)
    defines_in_place_all_to_all: bool = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def supports(self, op: str, dtype: str, redop: str) -> str | None:
        """Whether the peer can run ``op`` on ``dtype`` with ``redop`` (names as in :mod:`common`).

        Returns:
            None if it can, else why not (the same answer on every rank).
        """
        return None

    def algorithm(self, op: str, x: torch.Tensor) -> str:
        """What the peer runs for ``op`` on ``x`` (the table's peer/algorithm column)."""
        return op

    def graph_support(self, op: str) -> str | None:
        """Whether ``op`` can be captured in a CUDA graph (``bench --cuda-graph``).

        Returns:
            None if it can, else why not (the same answer on every rank).
        """
        return None if self.device.startswith("cuda") else "CUDA graphs need CUDA tensors"

    def sync(self) -> None:
        """Wait for the device (CUDA peers), so timings cover the work."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def bind(self, op: str, x: torch.Tensor, count: int, redop: str, root: int, *, in_place: bool) -> Bound:
        """Buffers and call for one variant of ``op``.

        Args:
            op, redop, root: what to run.
            x: this rank's input, [numel] on the CPU (moved to the peer's device).
            count: elements per rank (:func:`common.counts_for`).
            in_place: nccl-tests' in-place variant instead of out-of-place.

        Returns:
            The bound call (its buffers are allocated once, here).
        """
        n, r = self.size, self.rank
        sync = self.sync if self.device.startswith("cuda") else _no_sync
        x = x.to(self.device)
        if not in_place:
            out = torch.empty(out_numel(op, count, n), dtype=x.dtype, device=x.device)
            call, res = self._out_of_place(op, x, out, count, redop, root)
            return Bound(call, lambda: res, None, sync)
        if op == "all_gather":  # nccl-tests: the input is this rank's block of the output
            init = torch.zeros(n * count, dtype=x.dtype, device=x.device)
            init[r * count : (r + 1) * count] = x
        else:
            init = x
        buf = init.clone()
        call, res = self._in_place(op, buf, count, redop, root)
        return Bound(call, lambda: res, lambda: buf.copy_(init), sync)

    def _call(self, op: str, src: torch.Tensor, dst: torch.Tensor, redop: str, root: int) -> Callable[[], object]:
        """The library's ``op`` from ``src`` into ``dst`` (the same tensor, or aliasing, in place)."""
        raise NotImplementedError

    def _out_of_place(self, op: str, x: torch.Tensor, out: torch.Tensor, count: int, redop: str,
                      root: int) -> tuple[Callable[[], object], torch.Tensor]:
        """(call, result) of the out-of-place variant: from ``x`` into ``out``."""
        return self._call(op, x, out, redop, root), out

    def _in_place(self, op: str, buf: torch.Tensor, count: int, redop: str,
                  root: int) -> tuple[Callable[[], object], torch.Tensor]:
        """(call, result) of the in-place variant, in nccl-tests' layouts: all_gather's input is
        this rank's block of ``buf``, reduce_scatter's result lands in this rank's block of ``buf``."""
        block = buf[self.rank * count : (self.rank + 1) * count]
        if op == "all_gather":
            return self._call(op, block, buf, redop, root), buf
        if op == "reduce_scatter":
            return self._call(op, buf, block, redop, root), block
        return self._call(op, buf, buf, redop, root), buf

    def describe(self) -> str:
        """The peer, its library and version, and its device, for the run's header."""
        return f"{self.name} ({self.library}, {self.device})"

    def close(self) -> None:
        """Release what the peer holds (a duplicated MPI communicator, a process group)."""


class MoecommPeer(Peer):
    """moecomm through one communicator (a ``comm.using(t)`` view, or the auto-selecting comm)."""

    library = "moecomm"
    defines_in_place_all_to_all = True  # Communicator.all_to_all(x, out=x), on every device

    def __init__(self, comm, name: str, *, show_transport: bool = False, device: str = "cpu") -> None:
        super().__init__(comm.rank, comm.size)
        self.comm, self.name, self.device = comm, name, device
        self._show_transport = show_transport

    def algorithm(self, op: str, x: torch.Tensor) -> str:
        plan = self.comm.plan(op, x.to(self.device))
        return f"{plan.transport}:{plan.algorithm}" if self._show_transport else plan.algorithm

    def graph_support(self, op: str) -> str | None:
        if op == "all_to_all":  # Communicator.all_to_all without recv_counts sizes its output on the host
            return "its all_to_all exchanges counts and sizes the output on the host each call"
        return super().graph_support(op)

    def _call(self, op, src, dst, redop, root):
        c = self.comm
        if op == "all_reduce":
            return lambda: c.all_reduce(src, redop, out=dst)
        if op == "all_gather":
            return lambda: c.all_gather(src, out=dst)
        if op == "reduce_scatter":
            return lambda: c.reduce_scatter(src, redop, out=dst)
        if op == "all_to_all":
            return lambda: c.all_to_all(src, out=dst)
        if op == "broadcast":
            return lambda: c.broadcast(src, root, out=dst)
        raise ValueError(f"unknown op {op!r}")


class MemcpyPeer(Peer):
    """The memory-bandwidth reference: ``size`` bytes copied from a preallocated random source into a
    preallocated destination on every rank, the ranks copying at the same time (as they move bytes
    in a collective, so they share the memory bandwidth as the ops do).

    On the CPU the copy is ``numpy.copyto`` on uint8 views: one thread per rank, the primitive the
    shm transport copies with, and on this 2-core machine as fast as or faster than
    ``Tensor.copy_`` at one thread (1 MiB-32 MiB; copy_ spreads over torch's intra-op threads,
    which ranks sharing the cores would oversubscribe). On a GPU it is ``Tensor.copy_`` between two
    tensors of the rank's device (a device-to-device copy). The reference has no in-place variant
    (:func:`common.has_in_place`): its in-place columns print ``N/A``. Its result is checked
    bitwise against the source.
    """

    name = MEMCPY
    library = REFERENCE
    reference_op = MEMCPY

    def __init__(self, rank: int, size: int, device: str = "cpu") -> None:
        super().__init__(rank, size)
        self.device = device

    def supports(self, op: str, dtype: str, redop: str) -> str | None:
        return None if op == MEMCPY else "the memcpy reference copies bytes; it is no collective"

    def algorithm(self, op: str, x: torch.Tensor) -> str:
        return "numpy.copyto" if self.device == "cpu" else "copy_ device-to-device"

    def _call(self, op, src, dst, redop, root):
        if op != MEMCPY:
            raise ValueError(f"the memcpy reference runs {MEMCPY!r}, not {op!r}")
        if self.device == "cpu":
            s, d = src.view(torch.uint8).numpy(), dst.view(torch.uint8).numpy()
            return lambda: np.copyto(d, s)
        return lambda: dst.copy_(src)

    def describe(self) -> str:
        return f"memcpy (reference: {self.algorithm(MEMCPY, torch.empty(0))} on each rank, {self.device})"


_MPI_REDUCE_DTYPES = ("float32", "float64", "int32", "int64", "uint8")


class Mpi4pyPeer(Peer):
    """mpi4py's blocking collectives on NumPy views of the tensors, on a duplicate of COMM_WORLD."""

    name = library = "mpi4py"
    defines_in_place_all_to_all = True  # MPI_Alltoall(MPI_IN_PLACE, ...), defined by the MPI standard since 2.2

    def __init__(self, mpi_comm) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.c = mpi_comm.Dup()
        super().__init__(self.c.Get_rank(), self.c.Get_size())
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}

    def supports(self, op: str, dtype: str, redop: str) -> str | None:
        if op in REDUCING and dtype not in _MPI_REDUCE_DTYPES:
            return "MPI has no predefined reduction type for it"
        if op in REDUCING and redop not in self._ops:
            return "MPI has no predefined reduction op for it"
        return None

    def algorithm(self, op: str, x: torch.Tensor) -> str:
        return {"all_reduce": "Allreduce", "all_gather": "Allgather", "reduce_scatter": "Reduce_scatter_block",
                "all_to_all": "Alltoall", "broadcast": "Bcast"}[op]

    @staticmethod
    def _typed(t: torch.Tensor):
        return t.numpy()

    @staticmethod
    def _bytes(t: torch.Tensor):
        return t.view(torch.uint8).numpy()

    def _out_of_place(self, op, x, out, count, redop, root):
        c = self.c
        if op == "all_reduce":
            xs, os_, mop = self._typed(x), self._typed(out), self._ops[redop]
            return (lambda: c.Allreduce(xs, os_, mop)), out
        if op == "reduce_scatter":
            xs, os_, mop = self._typed(x), self._typed(out), self._ops[redop]
            return (lambda: c.Reduce_scatter_block(xs, os_, mop)), out
        xb, ob = self._bytes(x), self._bytes(out)
        if op == "all_gather":
            return (lambda: c.Allgather(xb, ob)), out
        if op == "all_to_all":
            return (lambda: c.Alltoall(xb, ob)), out
        if op == "broadcast":  # one buffer per rank in MPI: the root's x, everyone else's out
            if self.rank == root:
                return (lambda: c.Bcast(xb, root)), x
            return (lambda: c.Bcast(ob, root)), out
        raise ValueError(f"unknown op {op!r}")

    def _in_place(self, op, buf, count, redop, root):
        c, IN_PLACE = self.c, self.MPI.IN_PLACE
        if op == "all_reduce":
            bs, mop = self._typed(buf), self._ops[redop]
            return (lambda: c.Allreduce(IN_PLACE, bs, mop)), buf
        if op == "reduce_scatter":  # MPI_IN_PLACE: the result is the buffer's first block
            bs, mop = self._typed(buf), self._ops[redop]
            return (lambda: c.Reduce_scatter_block(IN_PLACE, bs, mop)), buf[:count]
        bb = self._bytes(buf)
        if op == "all_gather":
            return (lambda: c.Allgather(IN_PLACE, bb)), buf
        if op == "all_to_all":
            return (lambda: c.Alltoall(IN_PLACE, bb)), buf
        if op == "broadcast":
            return (lambda: c.Bcast(bb, root)), buf
        raise ValueError(f"unknown op {op!r}")

    def describe(self) -> str:
        from mpi4py import __version__

        lib = " ".join(self.MPI.Get_library_version().splitlines()[0].split())
        return f"mpi4py {__version__} ({lib})"

    def close(self) -> None:
        try:
            self.c.Free()
        except Exception:  # noqa: BLE001 - MPI may already be finalizing
            pass


class TorchPeer(Peer):
    """torch.distributed's collectives on the default process group (gloo for CPU, NCCL for CUDA)."""

    library = "torch"

    def __init__(self, rank: int, size: int, backend: str, device: str) -> None:
        import torch.distributed as dist

        super().__init__(rank, size)
        self.dist, self.name, self.device = dist, backend, device
        R = dist.ReduceOp
        self._ops = {"sum": R.SUM, "prod": R.PRODUCT, "max": R.MAX, "min": R.MIN, "avg": R.AVG}
        # all_gather_single / reduce_scatter_single are the names from torch 2.10 on
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def supports(self, op: str, dtype: str, redop: str) -> str | None:
        if op in REDUCING and redop == "avg" and self.name != "nccl" and not DTYPES[dtype].is_floating_point:
            return "avg needs a floating dtype"
        return None

    def algorithm(self, op: str, x: torch.Tensor) -> str:
        return {"all_reduce": "all_reduce", "all_gather": self._ag.__name__, "reduce_scatter": self._rs.__name__,
                "all_to_all": "all_to_all_single", "broadcast": "broadcast"}[op]

    def _call(self, op, src, dst, redop, root):
        d = self.dist
        if op == "all_reduce":  # in place only in torch: the out-of-place variant copies first
            mop = self._ops[redop]
            if src is dst:
                return lambda: d.all_reduce(dst, op=mop)
            return lambda: d.all_reduce(dst.copy_(src), op=mop)
        if op == "all_gather":
            return lambda: self._ag(dst, src)
        if op == "reduce_scatter":
            mop = self._ops[redop]
            return lambda: self._rs(dst, src, op=mop)
        if op == "all_to_all":
            return lambda: d.all_to_all_single(dst, src)
        if op == "broadcast":  # in place only too: the root's out-of-place variant copies first
            if src is dst or self.rank != root:
                return lambda: d.broadcast(dst, root)
            return lambda: d.broadcast(dst.copy_(src), root)
        raise ValueError(f"unknown op {op!r}")

    def describe(self) -> str:
        extra = ""
        if self.name == "nccl":
            from .output import nccl_version

            v = nccl_version()  # the loaded library's (torch.cuda.nccl.version() is torch's build's)
            extra = f" NCCL {v}" if v else ""
        return f"{self.name} (torch {torch.__version__}{extra}, {self.device})"

    def close(self) -> None:
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - best effort at the end of a run
            log.debug("destroy_process_group: %s", e)


def _agree(comm, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (peers must be chosen collectively)."""
    return bool(int(comm.all_reduce(torch.tensor([1 if ok else 0], dtype=torch.int64), op="min")[0]))


def gpus_per_rank_available(comm) -> bool:
    """Every rank has a CUDA device (agreed across ranks): one of its own (local rank < device count), or
    a shared one where NCCL allows several ranks per GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30)."""
    try:
        shared_ok = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
        ok = torch.cuda.is_available() and (torch.cuda.device_count() >= comm.local_size or shared_ok)
    except Exception:  # noqa: BLE001 - a broken driver means no GPU here
        ok = False
    return _agree(comm, ok)


def comm_gpu(comm) -> torch.device:
    """The GPU a benchmark binds to: the communicator's own (ranks may share one: cuda:local_rank modulo
    the GPUs seen), else ``cuda:local_rank``."""
    return comm.device if comm.device.type == "cuda" else torch.device("cuda", comm.local_rank)


def bench_device(comm, requested: str) -> str:
    """The device a benchmark's tensors live on: "cuda" or "cpu" (agreed across ranks).

    Args:
        requested: "auto" (cuda when every local rank has a GPU, see :func:`gpus_per_rank_available`),
            "cpu" or "cuda" (a usage error where some rank has none).
    """
    import click

    has_gpus = gpus_per_rank_available(comm) if requested in ("auto", "cuda") else False
    if requested == "cuda" and not has_gpus:
        raise click.UsageError("--device cuda needs a CUDA GPU for every local rank (torch.cuda.device_count() "
                               f">= {comm.local_size}); use --device cpu")
    return "cuda" if has_gpus else "cpu"


def bench_placement(comm, requested: str) -> tuple[torch.device, Callable[[], None]]:
    """Where a benchmark's tensors live (:func:`bench_device`) and what its clock reads wait for:
    the communicator's GPU (:func:`comm_gpu`) with ``torch.cuda.synchronize``, so a phase's time is
    of finished GPU work, or the CPU with nothing to wait for."""
    if bench_device(comm, requested) == "cuda":
        return comm_gpu(comm), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def _store_address(comm) -> str:
    """The address rank 0's store listens on: loopback when every rank is on this node, else this
    host's address on the route to another rank's host (a UDP connect sends nothing; it only
    asks the kernel which local address that route leaves from)."""
    topo = comm.topology
    if topo.single_node:
        return "127.0.0.1"
    others = [h for h in topo.hosts if h != topo.hosts[comm.rank]]
    if not others:
        raise RuntimeError(f"the ranks span {topo.num_nodes} nodes that all call themselves "
                           f"{topo.hosts[comm.rank]!r}: no other host to route to")
    family, _, _, _, sockaddr = socket.getaddrinfo(others[0], 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr[:2])
        return s.getsockname()[0]


def torch_store(comm, timeout: float) -> tuple[Any, str]:
    """A TCPStore for a torch.distributed group over ``comm``'s ranks (collective).

    Rank 0 binds the server socket with port 0, so the OS picks a free port and nothing can take
    it between picking and listening; it sends the address and port to the others over ``comm``
    (or why it could not, so that every rank raises, not rank 0 alone). Environment variables
    (env://, torchrun's agent store) are not used, so this works the same self-launched, under
    torchrun and under mpiexec.

    Args:
        comm: a moecomm Communicator.
        timeout: seconds the store waits for a key or a connection.

    Returns:
        (store, "address:port") on every rank; the store is a ``torch.distributed.PrefixStore``.
        Raises RuntimeError on every rank if rank 0 could not start the server.
    """
    import torch.distributed as dist

    from collectives.rendezvous import bound_store_server, store_client

    server, text = None, ""
    if comm.rank == 0:
        try:
            addr = _store_address(comm)
            server, port = bound_store_server(addr, 0, timeout)
            text = f"ok {addr} {port}"
        except (OSError, RuntimeError) as e:
            text = f"error {type(e).__name__}: {e}"
    data = text.encode()[:_MESSAGE_BYTES]
    message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    message[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    status, _, rest = bytes(comm.broadcast(message, 0).tolist()).rstrip(b"\0").decode(errors="replace").partition(" ")
    if status != "ok":
        raise RuntimeError(f"rank 0 could not start the torch.distributed store: {rest}")
    addr, port = rest.split()
    store = server if server is not None else store_client(addr, int(port), timeout)
    return dist.PrefixStore("moecomm-benchmarks", store), f"{addr}:{port}"


_MESSAGE_BYTES = 256  # "ok <address> <port>" or "error <why>", padded with NULs


def init_torch_distributed(comm, backend: str, timeout: float) -> None:
    """torch.distributed's default group over ``comm``'s ranks, whatever launched them (collective).

    Args:
        comm: a moecomm Communicator; rank r of the group is rank r of ``comm``.
        backend: "gloo" or "nccl" (nccl: the communicator's GPU, else ``cuda:local_rank``).
        timeout: seconds for the store and the group's collectives.
    """
    import torch.distributed as dist

    store, _ = torch_store(comm, timeout)
    kw = {}
    if backend == "nccl":
        device = comm_gpu(comm)
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size,
                            timeout=timedelta(seconds=timeout), **kw)


def build_peers(comm, *, transports: Sequence[str] | None, compare: bool, peers: Sequence[str] | None,
                device: str, timeout: float, memcpy: bool = False) -> tuple[list[Peer], list[str]]:
    """The peers of one sweep, chosen collectively, and notes on the ones left out.

    Args:
        comm: the moecomm Communicator of the sweep's ranks.
        transports: moecomm transports to measure (None: with ``compare`` every available one,
            else auto alone).
        compare: also moecomm auto and the external peers.
        peers: which external peers (None: every one of mpi4py / gloo / nccl that can run here).
        device: "cpu" or "cuda" (tensors of every peer).
        timeout: seconds for torch.distributed's store and group.
        memcpy: also the memory-bandwidth reference (:class:`MemcpyPeer`, last in the list).

    Returns:
        (peers, notes), the same on every rank. Raises ValueError for a transport that is not
        available or an unknown peer.
    """
    notes: list[str] = []
    mdev = str(comm_gpu(comm)) if device == "cuda" else "cpu"
    # with --compare: every transport that moves this device's tensors itself (not staged through host)
    native = [t for t in sorted(comm.transports) if device in getattr(comm.transports[t], "devices", ("cpu",))]
    names = list(transports) if transports else (native if compare else ["auto"])
    missing = [t for t in names if t != "auto" and t not in comm.transports]
    if missing:
        raise ValueError(f"transport(s) {missing} not available here (available: {sorted(comm.transports)}); "
                         "the mpi transport needs `mpiexec -n N moecomm bench`")
    if compare and "auto" not in names:
        names.append("auto")
    out: list[Peer] = []
    for t in dict.fromkeys(names):
        if t == "auto" and not compare:
            # label a lone auto by what it picks (same pick at every size and op on CPU)
            picked = comm.plan("all_reduce", torch.zeros(1, device=mdev)).transport
            label = picked if picked not in names else "auto"
            out.append(MoecommPeer(comm, label, device=mdev))
        elif t == "auto":
            out.append(MoecommPeer(comm, "auto", show_transport=True, device=mdev))
        else:
            out.append(MoecommPeer(comm.using(t), t, device=mdev))
    reference = [MemcpyPeer(comm.rank, comm.size, mdev)] if memcpy else []
    if not compare:
        return out + reference, notes
    wanted = list(peers) if peers else list(EXTERNAL)
    unknown = [p for p in wanted if p not in EXTERNAL]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(EXTERNAL)}")
    if "mpi4py" in wanted:
        if device != "cpu":
            notes.append("mpi4py left out: it is measured on host (NumPy) buffers, this sweep is on cuda")
        elif comm.topology.launch != "mpi":
            notes.append("mpi4py left out: it needs an MPI launch (mpiexec -n N moecomm bench --compare)")
        else:
            from mpi4py import MPI

            out.append(Mpi4pyPeer(MPI.COMM_WORLD))
    backend = "nccl" if device == "cuda" else "gloo"
    other = "gloo" if backend == "nccl" else "nccl"
    if other in wanted and peers:
        notes.append(f"{other} left out: this sweep is on {device} tensors (--device "
                     f"{'cpu' if other == 'gloo' else 'cuda'} measures it)")
    if backend in wanted:
        import torch.distributed as dist

        ok = dist.is_available() and (dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available())
        if not _agree(comm, ok):
            notes.append(f"{backend} left out: this torch build has no {backend} backend on every rank")
        elif dist.is_initialized():
            notes.append(f"{backend} left out: torch.distributed is already initialized in this process")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                init_torch_distributed(comm, backend, timeout)
            out.append(TorchPeer(comm.rank, comm.size, backend, mdev))
    # moecomm's own gloo/nccl transports share a name with torch.distributed's backends: rows must not collide
    external = {p.name for p in out if not isinstance(p, MoecommPeer)}
    for p in out:
        if isinstance(p, MoecommPeer) and p.name in external:
            p.name = f"moecomm-{p.name}"
    return out + reference, notes
