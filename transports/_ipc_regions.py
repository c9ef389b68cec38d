"""The ipc transport's region providers: map every rank's region, read and write its signal words.

Two providers, one interface (``sig_ptrs``/``data_ptrs`` tables for the kernels, ``read``/``write``
of signal words, ``bind_thread``, ``sync``, ``capturing``, ``close``); see :mod:`transports.ipc`:

- :class:`_HostRegions`: every region in one POSIX shared-memory segment (emulation, CPU tensors);
- :class:`_CudaRegions`: one cudaMalloc region per rank, opened by the peers through CUDA IPC handles
  (run on an H100, two ranks on one GPU: benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-notes.md).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import GroupInfo
from .kernels import layout as L


class _HostRegions:
    """All regions in one POSIX shared-memory segment (emulation)."""

    def __init__(self, group: GroupInfo, region_bytes: int):
        from ._segment import create_and_map

        self.region_bytes = region_bytes
        n = group.size
        self._map, self.name = create_and_map(group, n * region_bytes, what="ipc host provider")
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        base = self._bytes.ctypes.data
        self.signals = [np.frombuffer(self._map, dtype=np.int64, count=L.SIGNAL_WORDS, offset=r * region_bytes)
                        for r in range(n)]
        sig_addrs = [base + r * region_bytes for r in range(n)]
        self.sig_ptrs = torch.tensor(sig_addrs, dtype=torch.int64)
        self.data_ptrs = torch.tensor([a + L.SIGNAL_WORDS * 8 for a in sig_addrs], dtype=torch.int64)
        self.device = torch.device("cpu")

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

    def __init__(self, group: GroupInfo, region_bytes: int):
        import cupy
        from cupy.cuda import runtime

        self._rt = runtime
        self.region_bytes = region_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())
        me = group.rank
        self._own = runtime.malloc(region_bytes)
        runtime.memset(self._own, 0, region_bytes)
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
        return torch.cuda.is_current_stream_capturing()

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
