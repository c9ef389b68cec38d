"""Running a command's body on its ranks, the same way for every ``moecomm`` command.

Under mpirun/mpiexec/torchrun every process is a rank and joins the job's communicator
(``collectives.init``); otherwise the command starts ``nprocs`` local ranks itself
(``collectives.launch``). Self-launched ranks are new processes that do not inherit the CLI's
logging configuration, so the CLI's log level travels with the call and each rank configures
logging with it (``moecomm -vv bench`` shows every rank's transport decisions).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import click

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
_LEVEL_KEY = "moecomm.log_level"


def configure_logging(level: int, *, force: bool = False) -> None:
    """Log records of ``level`` and above to stderr in the CLI's format.

    Args:
        level: a ``logging`` level (WARNING, INFO, DEBUG).
        force: replace handlers already installed (a rank process owns its logging).
    """
    logging.basicConfig(level=level, format=LOG_FORMAT, force=force)


def set_cli_log_level(ctx: click.Context, level: int) -> None:
    """Remember the level ``-v``/``-vv`` asked for, for the ranks that a command starts."""
    ctx.meta[_LEVEL_KEY] = level


def cli_log_level() -> int:
    """The level the ``moecomm`` group's ``-v``/``-vv`` asked for (WARNING outside a click command)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(_LEVEL_KEY, logging.WARNING) if ctx is not None else logging.WARNING


def _logged(comm, level: int, fn: Callable[..., Any], *args: Any) -> Any:
    """A self-launched rank's body: configure logging at the CLI's level, then ``fn(comm, *args)``."""
    configure_logging(level, force=True)
    return fn(comm, *args)


def launch_logged(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float,
                  options: dict[str, Any] | None = None, transport: str = "auto",
                  env: dict[str, str] | None = None) -> list[Any]:
    """``collectives.launch(fn, nprocs, *args)`` whose ranks log at the CLI's level.

    Args:
        fn: a module-level function ``fn(comm, *args)``.
        nprocs: local ranks to start.
        timeout: the communicators' timeout in seconds.
        options: transport settings (``transports.settings`` option names), passed to launch.
        transport: the communicators' ``transport=`` ("auto": chosen per call).
        env: environment variables of the ranks (``collectives.launch(env=)``).

    Returns:
        Every rank's result, in rank order (a rank's exception is re-raised here).
    """
    import collectives

    kw: dict[str, Any] = {"options": options} if options else {}
    if env:
        kw["env"] = env
    return collectives.launch(_logged, nprocs, cli_log_level(), fn, *args, timeout=timeout, transport=transport, **kw)


def on_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float,
             check_size: Callable[[int], None] | None = None, transport: str = "auto",
             options: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> tuple[bool, Any]:
    """Run ``fn(comm, *args)`` on this job's ranks, or on ``nprocs`` self-launched local ranks.

    Args:
        fn: a module-level function, collective over ``comm``.
        nprocs: local ranks to start when no launcher started this process (ignored otherwise).
        timeout: the communicators' timeout in seconds.
        check_size: called with the number of ranks before ``fn`` runs (in this process when
            self-launching, on every rank otherwise); raises click errors for options that do
            not fit that many ranks.
        transport: the communicator's ``transport=`` ("auto": chosen per call).
        options: settings by option name (:mod:`transports.settings`) for the communicators.
        env: environment variables the ranks need before their communicator is made (NCCL's);
            under a launcher this process is a rank, and they are set here.

    Returns:
        (lead, result): ``lead`` is True in the process that reports (rank 0, or the launching
        process), ``result`` rank 0's result there and this rank's elsewhere.
    """
    import collectives

    if collectives.detect_launch() in ("mpi", "torchrun"):
        os.environ.update(env or {})
        with collectives.init(transport, timeout=timeout, options=options) as comm:
            if check_size is not None:
                check_size(comm.size)
            return comm.rank == 0, fn(comm, *args)
    if check_size is not None:
        check_size(nprocs)
    extra = {"env": env} if env else {}
    return True, launch_logged(fn, nprocs, *args, timeout=timeout, transport=transport, options=options, **extra)[0]


def allgather_text(comm, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (collective over ``comm``, any device's communicator): the
    lengths, then the padded UTF-8 bytes, as two all_gathers of host arrays."""
    import numpy as np

    mine = text.encode()
    lens = comm.all_gather(np.array([len(mine)], dtype=np.int64))
    width = max(int(lens.max()), 1)
    buf = np.zeros(width, dtype=np.uint8)
    buf[:len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    everyone = comm.all_gather(buf).reshape(comm.size, width)
    return [everyone[r, :int(lens[r])].tobytes().decode() for r in range(comm.size)]
