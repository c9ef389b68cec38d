"""The ipc transport's region providers: map every rank's region, read and write its signal words.

Two providers, one interface (``sig_ptrs``/``data_ptrs`` tables for the kernels, ``read``/``write``
of signal words, the private ``status`` block, ``bind_thread``, ``sync``, ``capturing``,
``stream_probe``, ``close``);
see :mod:`transports.ipc`. ``status`` (int64 [layout.STATUS_WORDS], NumPy) is this rank's
status block, which the kernels write (``status_arg``) and the host reads with plain loads: no
copy and no stream synchronization per call.

- :class:`_HostRegions`: every region in one POSIX shared-memory segment (emulation, CPU tensors);
- :class:`_CudaRegions`: one cudaMalloc region per rank, opened by the peers through CUDA IPC handles
  (run on an H100, two ranks on one GPU: benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-notes.md).
"""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np
import torch

from ._ipc_launch import Pointer
from .base import GroupInfo
from .kernels import layout as L


class _HostRegions:
    """All regions in one POSIX shared-memory segment (emulation)."""

    def __init__(self, group: GroupInfo, region_bytes: int, init: tuple[int, np.ndarray] | None = None):
        from ._segment import create_and_map

        self.region_bytes = region_bytes
        n = group.size
        self._map, self.name = create_and_map(group, n * region_bytes, what="ipc host provider")
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        base = self._bytes.ctypes.data
        if init is not None:  # our own region only: a peer writes there only after the creation probe
            at = group.rank * region_bytes + init[0]
            self._bytes[at : at + init[1].size] = init[1]
        self.status = np.zeros(L.STATUS_WORDS, dtype=np.int64)
        self.status_arg = torch.from_numpy(self.status)  # the same memory, as the kernels' pointer
        self.signals = [np.frombuffer(self._map, dtype=np.int64, count=L.SIGNAL_WORDS, offset=r * region_bytes)
                        for r in range(n)]
        sig_addrs = [base + r * region_bytes for r in range(n)]
        self.sig_ptrs = torch.tensor(sig_addrs, dtype=torch.int64)
        self.data_ptrs = torch.tensor([a + L.SIGNAL_WORDS * 8 for a in sig_addrs], dtype=torch.int64)
        self.device = torch.device("cpu")
        self._rank_base = group.rank * region_bytes
        self.own_addr = sig_addrs[group.rank]

    def read(self, r: int, lo: int, count: int) -> np.ndarray:
        return self.signals[r][lo : lo + count].copy()

    def write(self, r: int, word: int, value: int) -> None:
        self.signals[r][word] = value

    def bind_thread(self) -> None:
        pass

    def sync(self) -> None:
        pass  # the interpreter ran the kernel to its end before the launch returned

    def capturing(self) -> bool:
        return False

    def stream_probe(self) -> Callable[[], bool]:
        """Whether the work queued so far has ended (see :meth:`_CudaRegions.stream_probe`): always
        here, the interpreter ran each kernel to its end before its launch returned."""
        return lambda: True

    def tensor(self, offset: int, nbytes: int, on_free: Callable[[], None]) -> torch.Tensor:
        """uint8 [nbytes] view of our own region from ``offset`` (the symmetric heap's tensors);
        ``on_free()`` runs when the last tensor over that memory is gone."""
        arr = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=self._rank_base + offset)
        weakref.finalize(arr, on_free)  # torch.from_numpy keeps arr alive as long as any view
        return torch.from_numpy(arr)

    def close(self) -> None:
        if self._map is None:
            return
        self.signals = self._bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        self._map = None


class _CudaRegions:
    """One cudaMalloc region per rank, opened by the peers through CUDA IPC handles.

    Run on an H100 (CUDA 13, cupy-cuda13x 14.2), two ranks on one GPU; CUDA IPC between GPUs is untried.
    Signal words are read and written with async copies on a non-blocking stream of our own, so
    the watchdog can read peers' states and set our ABORT word while a kernel spins.
    """

    def __init__(self, group: GroupInfo, region_bytes: int, init: tuple[int, np.ndarray] | None = None):
        import cupy
        from cupy.cuda import runtime

        self._rt = runtime
        self.region_bytes = region_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())
        me = group.rank
        self._own = runtime.malloc(region_bytes)
        runtime.memset(self._own, 0, region_bytes)
        if init is not None:
            runtime.memcpy(self._own + init[0], init[1].ctypes.data, init[1].size, runtime.memcpyHostToDevice)
        # the status block: pinned host memory (cudaHostAlloc through torch's host allocator), which
        # with unified addressing (every 64-bit CUDA platform) the device reaches at the same address
        self._status_tensor = torch.zeros(L.STATUS_WORDS, dtype=torch.int64, pin_memory=True)
        self.status = self._status_tensor.numpy()
        self.status_arg = Pointer(self._status_tensor.data_ptr(), torch.int64)
        runtime.deviceSynchronize()
        self._opened: list[int] = []
        err = ""
        try:
            handle = runtime.ipcGetMemHandle(self._own)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            handle, err = b"", f"rank {group.global_ranks[me]}: cudaIpcGetMemHandle failed: {e}"
        handles = group.rendezvous.allgather_bytes(b"E" + err.encode() if err else b"H" + bytes(handle))
        errors = [h[1:].decode() for h in handles if h[:1] == b"E"]
        addrs = []
        if not errors:
            for r, h in enumerate(handles):
                if r == me:
                    addrs.append(self._own)
                    continue
                try:  # a peer on the same GPU works across processes (not for our own handle)
                    p = runtime.ipcOpenMemHandle(h[1:], runtime.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(p)
                    addrs.append(p)
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    err = f"rank {group.global_ranks[me]} could not open rank {group.global_ranks[r]}'s handle: {e}"
                    break
        status = group.rendezvous.allgather_bytes(err.encode())
        errors += [s.decode() for s in status if s]
        if errors:
            self.close()
            raise RuntimeError("ipc cuda provider unavailable: " + "; ".join(errors))
        self._addrs = addrs
        self.own_addr = self._own
        self.sig_ptrs = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        self.data_ptrs = torch.tensor([a + L.SIGNAL_WORDS * 8 for a in addrs], dtype=torch.int64, device=self.device)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._host = np.zeros(L.SIGNAL_WORDS, dtype=np.int64)

    def read(self, r: int, lo: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        self._rt.memcpyAsync(out.ctypes.data, self._addrs[r] + lo * 8, count * 8,
                             self._rt.memcpyDeviceToHost, self._stream.ptr)
        self._stream.synchronize()
        return out

    def write(self, r: int, word: int, value: int) -> None:
        v = np.array([value], dtype=np.int64)
        self._rt.memcpyAsync(self._addrs[r] + word * 8, v.ctypes.data, 8, self._rt.memcpyHostToDevice,
                             self._stream.ptr)
        self._stream.synchronize()

    def bind_thread(self) -> None:
        """Make our device current in the calling thread (the watchdog's copies use our stream)."""
        self._rt.setDevice(self.device.index)

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def capturing(self) -> bool:
        return torch._C._cuda_isCurrentStreamCapturing()  # what torch.cuda.is_current_stream_capturing() calls

    def stream_probe(self) -> Callable[[], bool]:
        """A test, without blocking, of whether the work queued so far on our device's current stream
        has ended (an event recorded now): it sees CUDA-graph replays there, which the host's launch
        count does not; work on other streams it does not see. Under capture: always true (captured
        kernels run at replays, not now, and a captured event cannot be queried)."""
        if self.capturing():
            return lambda: True
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event.query

    def tensor(self, offset: int, nbytes: int, on_free: Callable[[], None]) -> torch.Tensor:
        """uint8 [nbytes] CUDA tensor over our own region from ``offset`` (the symmetric heap's tensors);
        ``on_free()`` runs when the last tensor over that memory is gone. The region itself stays
        until the transport closes."""
        # the owner is held by the memory, the array, and through torch's storage
        return cuda_bytes(self._own + offset, nbytes, self.device, _Owner(on_free))

    def close(self) -> None:
        for p in getattr(self, "_opened", []):
            try:
                self._rt.ipcCloseMemHandle(p)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._opened = []
        if getattr(self, "_own", None):
            try:
                self._rt.free(self._own)
            except Exception:  # noqa: BLE001
                pass
            self._own = 0


def cuda_bytes(addr: int, nbytes: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """uint8 [nbytes] CUDA tensor over device memory at ``addr`` that torch did not allocate (cupy's
    UnownedMemory, handed over through ``__cuda_array_interface__``); ``owner`` lives as long as it."""
    import cupy

    mem = cupy.cuda.UnownedMemory(addr, nbytes, owner)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=device)


class _Owner:
    """Runs ``on_free`` when the last reference to a symmetric tensor's memory goes."""

    def __init__(self, on_free: Callable[[], None]):
        self._on_free = on_free

    def __del__(self) -> None:
        self._on_free()
