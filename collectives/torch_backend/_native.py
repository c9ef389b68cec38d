"""The compiled trampoline (``_pybackend.cpp``) that lets a Python class be a ``c10d.Backend``.

torch 2.13 gives Python no constructible Backend (``torch._C._distributed_c10d.Backend`` has no
constructor), and a Python ``ProcessGroup`` that defines the collectives itself bypasses torch's
``c10d.*`` operators, so dispatch-level tools (``CommDebugMode``, ``TorchDispatchMode``s) never see
its calls and ``pg._get_backend(device)`` has nothing to return. With the trampoline, the moecomm
group is a ``ProcessGroup`` whose calls dispatch through those operators to a Backend whose methods
are :class:`~collectives.torch_backend._group.MoecommBackend`'s, as for gloo and NCCL.

It is built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and torch's headers;
about a minute on 2 cores), once per torch version and source, into torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): one process builds under a file
lock while the others wait, then every process loads the built module. ``MOECOMM_TORCH_NATIVE=0``
skips it. Without it (no compiler, no headers, a failed build) the group is a Python ProcessGroup
that runs the collectives itself: the same results, invisible to the dispatcher (logged once).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("collectives")

SOURCE = Path(__file__).with_name("_pybackend.cpp")
ENV = "MOECOMM_TORCH_NATIVE"
# how long a process waits for another one's build before it gives up and goes on without it
_LOCK_WAIT_S = 600.0
_loaded: dict[str, ModuleType | None] = {}
_load_lock = threading.Lock()  # the tests' background build and a group created meanwhile, in one process
_lock_files: list = []  # the build lock's file while this process holds it


def _after_fork_in_child() -> None:
    """A child forked while another thread built: a lock of its own, and not the parent's build lock (an
    inherited descriptor would hold the file lock for as long as the child lives)."""
    global _load_lock
    _load_lock = threading.Lock()
    for f in _lock_files:
        f.close()
    _lock_files.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def module_name() -> str:
    """The extension's module name: the source's hash and torch's build in it, so that another torch
    or an edited source never loads a stale build."""
    import torch

    key = "\0".join([SOURCE.read_text(), torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version])
    return "moecomm_pybackend_" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def _cache_dir() -> Path:
    """torch's extension directory (as cpp_extension finds it; importing that module costs 0.5 s)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch._appdirs import user_cache_dir

        root = user_cache_dir(appname="torch_extensions")
    return Path(root).resolve() / "moecomm"


def _import(name: str, path: Path) -> ModuleType:
    if name in sys.modules:  # imported already (by its build in this process)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(name: str, target: Path) -> ModuleType:
    """Compile into a private directory, then move the module into place (readers never see half a file).

    Returns:
        The module, as the build imported it.
    """
    from torch.utils.cpp_extension import load

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=target.parent) as tmp:
        # -O1: the methods only forward to Python; the build is mostly torch's headers
        mod = load(name, [str(SOURCE)], build_directory=tmp, extra_cflags=["-O1"], verbose=False)
        shutil.copy2(Path(tmp) / f"{name}.so", f"{target}.part")
        os.replace(f"{target}.part", target)
    log.info("moecomm: built the c10d backend trampoline %s in %.0f s", target, time.monotonic() - t0)
    return mod


def load() -> ModuleType | None:
    """The built trampoline module (building it first if needed), or None where it cannot be had.

    Returns:
        The module (its ``PyBackend`` class), or None: ``MOECOMM_TORCH_NATIVE=0``, or the build
        failed (logged once with the reason; groups then run the collectives in Python).
    """
    with _load_lock:
        if "module" not in _loaded:
            _loaded["module"] = _load_once()
        return _loaded["module"]


def _load_once() -> ModuleType | None:
    mod, why = None, f"{ENV}=0"
    if os.environ.get(ENV, "1") != "0":
        try:
            mod = _load_or_build()
        except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja: groups work without it
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    if mod is None:
        log.warning("moecomm: torch.distributed groups run their collectives in Python, unseen by torch's "
                    "dispatcher (CommDebugMode counts none; pg._get_backend() has none): the c10d backend "
                    "trampoline is not available (%s)", why)
    return mod


def _load_or_build() -> ModuleType:
    name = module_name()
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}.so"
    if not target.exists():
        # flock: released by the kernel if the builder dies, so a killed build never blocks the others
        with open(directory / f"{name}.lock", "w") as lock:
            _lock_files.append(lock)
            try:
                deadline = time.monotonic() + _LOCK_WAIT_S
                while not target.exists():
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # another process builds
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"another process held {lock.name} for {_LOCK_WAIT_S:.0f} s") from None
                        time.sleep(0.2)
                        continue
                    if not target.exists():
                        return _build(name, target)
            finally:
                _lock_files.remove(lock)
    return _import(name, target)
