"""Pre-bound launches of the ipc kernels: Triton's JIT once per argument types, then its compiled
kernel's launcher directly.

``kernel[grid](*args)`` binds and type-checks every argument and looks up the compiled variant on
each call: 6-13 us of host time, where the launcher itself (``CompiledKernel.run``) costs about 4
(tritonbench PRs 1016 and 669). :class:`BoundKernel` keeps, per variant (pointer dtypes and 16-byte
alignment, integer widths), the ``CompiledKernel`` the first JIT launch returned, and then calls
its launcher with the arguments in the kernel's parameter order, constexprs in their places,
exactly as ``JITFunction.run`` does after binding. Per-call integers of the kernels are
``do_not_specialize``, so values never pick another variant, only types do.

Under Triton's interpreter (emulation) there is nothing compiled: every call is the JIT call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}


def arg_type(v: Any) -> str:
    """The Triton signature type of a runtime argument, as the JIT types it: ``*<dtype>`` for
    tensors and pointer objects, ``i32``/``i64``/``u64`` for ints by range, ``i1`` for bools."""
    if hasattr(v, "data_ptr"):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        if -(1 << 31) <= v < (1 << 31):
            return "i32"
        return "i64" if -(1 << 63) <= v < (1 << 63) else "u64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__}")


def _variant(args: tuple) -> tuple:
    """What makes the JIT pick another compiled kernel for these arguments (constexprs aside):
    types, and 16-byte alignment of pointers (it specializes on that; our integers never)."""
    return tuple((arg_type(v), v.data_ptr() % 16 == 0) if hasattr(v, "data_ptr") else arg_type(v) for v in args)


def pointer_variant(dtype: torch.dtype) -> Callable[[int], tuple]:
    """``f(addr)``: :func:`_variant`'s entry for a ``dtype`` pointer at ``addr``, for callers that
    key by address (the pointee's dtype is part of the variant: a kernel compiled for float32 reads
    float16 data as float32)."""
    t = "*" + _TYPES[dtype]
    aligned, unaligned = (t, True), (t, False)
    return lambda addr: unaligned if addr & 15 else aligned


class BoundKernel:
    """One kernel with fixed constexprs, launched on ``programs`` programs.

    ``bound(*args)`` launches with the runtime arguments in parameter order (constexprs left
    out); :meth:`full_args` and :meth:`signature` say what the launcher receives and the Triton
    signature the compiled variant has (tests compare them with ``triton.compile``'s).
    """

    def __init__(self, kernel: Any, programs: int, constexprs: dict[str, Any], emulate: bool):
        self.kernel = kernel
        self.programs = programs
        self.constexprs = dict(constexprs)
        names = list(kernel.arg_names)
        unknown = set(constexprs) - set(names)
        if unknown:
            raise TypeError(f"{kernel.__name__} has no parameters {sorted(unknown)}")
        self.names = names
        self._runtime = [n for n in names if n not in constexprs]
        self._slots = [names.index(n) for n in self._runtime]  # where each runtime argument goes
        self._compiled: dict[tuple, Any] = {}
        self._grid = (programs,)
        self._jit_only = emulate or _hooks_set()

    def full_args(self, args: tuple) -> list:
        """Every parameter's value in the kernel's order, constexprs in their places (what
        ``JITFunction.run`` gives the compiled kernel's launcher)."""
        if len(args) != len(self._runtime):
            raise TypeError(f"{self.kernel.__name__} takes {len(self._runtime)} runtime arguments "
                            f"({', '.join(self._runtime)}), got {len(args)}")
        full = [self.constexprs.get(n) for n in self.names]
        for slot, v in zip(self._slots, args):
            full[slot] = v
        return full

    def signature(self, args: tuple) -> dict[str, str]:
        """The Triton signature of the variant these arguments launch: ``{name: type}`` in parameter
        order, ``"constexpr"`` for constexprs."""
        types = dict(zip(self._runtime, (arg_type(v) for v in args)))
        return {n: "constexpr" if n in self.constexprs else types[n] for n in self.names}

    def __call__(self, *args: Any, key: Any = None) -> None:
        """Launch with the runtime arguments in parameter order. ``key``: what determines the
        compiled variant of these arguments when the caller knows it cheaply (default: computed)."""
        if self._jit_only:
            self.kernel[self._grid](*args, **self.constexprs)
            return
        if key is None:
            key = _variant(args)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[self._grid](*args, **self.constexprs)
            return
        launch(compiled, self.programs, self.full_args(args))


def _hooks_set() -> bool:
    """Whether a profiler set Triton's launch hooks (launches then go through the JIT, which calls them).

    Triton 3.6+ keeps each hook as a ``HookChain`` that is never None; it is set when it holds calls.
    """
    try:
        from triton import knobs

        return any(h is not None and bool(getattr(h, "calls", True))
                   for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
    except Exception:  # noqa: BLE001 - a Triton without knobs: stay on the JIT
        return True


def current_stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device)


def launch(compiled: Any, programs: int, full: list, device: int | None = None) -> None:
    """``compiled``'s launcher on ``device``'s current stream (default: the current device), as
    ``JITFunction.run`` calls it."""
    stream = current_stream(torch.cuda.current_device() if device is None else device)
    compiled.run(programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)


class Pointer:
    """A device address as a pointer argument of ``dtype`` (``data_ptr()``, ``dtype``): what the
    JIT types and aligns like a tensor; the compiled launcher takes the plain int as well."""

    __slots__ = ("addr", "dtype")

    def __init__(self, addr: int, dtype: torch.dtype):
        self.addr, self.dtype = int(addr), dtype

    def data_ptr(self) -> int:
        return self.addr
