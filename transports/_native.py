"""Loads the shm transport's optional compiled helper, :mod:`transports._shmfast`.

``pip install -e .`` builds it from transports/_shmfast.c with the machine's C compiler (setup.py);
where that fails the install still succeeds, and the shm transport runs its Python path, which is
slower for small messages: one warning per process says so and how to fix it.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

# The API_VERSION this Python code expects of the built module (the constant in _shmfast.c): a
# stale in-place build from an older checkout is refused rather than called with other arguments.
API_VERSION = 7

_HINT = "reinstall with a C compiler available (pip install -e .)"
_loaded: ModuleType | None = None
_why_not: str | None = None  # why the module is unusable; None before the first attempt or when loaded
_warned = False


def _load() -> ModuleType | None:
    global _loaded, _why_not
    if _loaded is None and _why_not is None:
        try:
            _shmfast = importlib.import_module(f"{__package__}._shmfast")
        except ImportError as exc:
            _why_not = f"not built ({exc})"
        else:
            version = getattr(_shmfast, "API_VERSION", None)
            if version == API_VERSION:
                _loaded = _shmfast
            else:
                _why_not = f"stale build (API_VERSION {version}, this code needs {API_VERSION}: {_shmfast.__file__})"
    return _loaded


def load_shmfast(*, enabled: bool = True) -> ModuleType | None:
    """The compiled helper module, or None when it cannot or should not be used.

    Args:
        enabled: False when the caller's settings turn the helper off (``MOECOMM_SHM_NATIVE=off``):
            then None, without a warning.

    Returns:
        :mod:`transports._shmfast`, or None when disabled, not built or built from another version
        (the first such None of a process logs one warning saying what to do).
    """
    global _warned
    if not enabled:
        return None
    module = _load()
    if module is None and not _warned:
        _warned = True
        log.warning("moecomm's compiled shm helper (transports._shmfast) is %s: small shm collectives run in "
                    "Python, which costs several microseconds more per call; %s", _why_not, _HINT)
    return module


def describe(*, enabled: bool = True) -> str:
    """One line for ``moecomm doctor``: whether the compiled shm helper is used, and if not, why.

    Args:
        enabled: the caller's setting, as for :func:`load_shmfast`.

    Returns:
        e.g. ``"built (/path/transports/_shmfast.cpython-311-x86_64-linux-gnu.so)"``,
        ``"not built (No module named 'transports._shmfast'): reinstall with a C compiler ..."``, or
        ``"disabled (MOECOMM_SHM_NATIVE=off)"``.
    """
    if not enabled:
        return "disabled (MOECOMM_SHM_NATIVE=off)"
    module = _load()
    if module is not None:
        return f"built ({module.__file__})"
    return f"{_why_not}: {_HINT}"
