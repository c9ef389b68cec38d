"""Every ``MOECOMM_*`` setting in one table: name, type, default, meaning, and who reads it.

Nothing else in the library reads ``os.environ`` for our settings: components call
:func:`resolve` (environment, overridden by explicit ``options=`` of ``init``/``launch``) and
receive plain values. ``moecomm doctor`` and the README's settings table are generated from
:data:`SETTINGS`.

Settings marked ``agree`` change what the ranks do together (a transport choice, a slot size,
an algorithm switch point): the communicator compares them across ranks when it is created and
raises ``ValueError`` naming each rank's value if they differ, instead of computing wrong
results or waiting in different transports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# Transport names a user may force (kept here, the bottom layer, so nothing imports upwards).
TRANSPORT_CHOICES = ("auto", "shm", "mpi", "nccl", "ipc", "gloo")
LAUNCH_CHOICES = ("mpi", "torchrun", "single")


@dataclass(frozen=True)
class Setting:
    """One ``MOECOMM_*`` variable. ``option`` is its name as a keyword in ``options=``."""

    env: str
    option: str
    type: type
    default: Any
    meaning: str
    component: str
    agree: bool = False
    choices: tuple[str, ...] | None = None
    minimum: int | None = None

    def parse(self, raw: Any, *, source: str) -> Any:
        """``raw`` (a string from the environment or a value from ``options=``) as a checked value.

        Raises ValueError naming the variable and what is accepted.
        """
        if raw is None:
            return self.default
        if self.type is int:
            if isinstance(raw, bool) or (not isinstance(raw, (int, str))):
                raise ValueError(f"{source}: {self.env} must be an integer, got {raw!r}")
            try:
                value = int(str(raw).strip(), 0) if isinstance(raw, str) else int(raw)
            except ValueError:
                raise ValueError(f"{source}: {self.env}={raw!r} is not an integer") from None
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{source}: {self.env}={value} is below its minimum {self.minimum}")
            return value
        value = str(raw).strip()
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{source}: {self.env}={raw!r} is not one of {', '.join(self.choices)}")
        return value


def _s(env: str, type_: type, default: Any, meaning: str, component: str, **kw: Any) -> Setting:
    return Setting(env, env.removeprefix("MOECOMM_").lower(), type_, default, meaning, component, **kw)


SETTINGS: dict[str, Setting] = {s.option: s for s in (
    _s("MOECOMM_TRANSPORT", str, "auto",
       "force one transport for every call of a communicator (same as transport=)",
       "collectives.Communicator", agree=True, choices=TRANSPORT_CHOICES),
    _s("MOECOMM_LAUNCH", str, None,
       "override launch detection (mpi: rendezvous over MPI; torchrun: RANK/WORLD_SIZE/MASTER_ADDR; single)",
       "collectives.rendezvous", choices=LAUNCH_CHOICES),
    _s("MOECOMM_SHM_SLOT_BYTES", int, 1 << 20,
       "per-rank staging slot of the shm transport in bytes (rounded up to 4 KiB); larger messages go in rounds",
       "transports.shm", agree=True, minimum=4096),
    _s("MOECOMM_SHM_ONE_SHOT_MAX", int, None,
       "largest all_reduce in bytes that shm runs one-shot (default: where the performance model's fitted "
       "one-shot and two-shot times cross for the group's rank count, see MOECOMM_MODEL_FILE)",
       "transports.shm", agree=True, minimum=0),
    _s("MOECOMM_SHM_SINGLE_COPY", str, "auto",
       "large shm messages: auto: peers read or write each other's tensors in one copy (Linux "
       "process_vm_readv/writev) from "
       "the per-op sizes in transports/_shm_single_copy.py (from there on all_gather, and an out-of-place all_to_all "
       "whose senders all qualify, runs single copy or staged, whichever rank 0 timed faster on recent calls; an "
       "in-place one swaps blocks by single copy or through the slots, chosen the same way), where "
       "a start-up probe on every rank allows it; off: always "
       "stage through the shared slots; always: single copy at every size (tests)",
       "transports.shm", agree=True, choices=("auto", "off", "always")),
    _s("MOECOMM_SHM_NATIVE", str, "auto",
       "auto: small shm collectives run in the compiled helper transports._shmfast when it was built at "
       "install (when every rank of the group has it); off: in Python (bitwise the same results, but for "
       "NaN payloads and a tied zero's sign in bfloat16 max/min)",
       "transports.shm", agree=True, choices=("auto", "off")),
    _s("MOECOMM_SHM_SLEEP", str, "futex",
       "how an shm wait sleeps once it has spun and yielded: futex (with the compiled helper: woken as soon "
       "as the peer arrives, so ranks that lose their CPU to other work are not late by a sleep) or backoff "
       "(timed sleeps doubling from 20 us to 1 ms)",
       "transports.shm", choices=("futex", "backoff")),
    _s("MOECOMM_MODEL_FILE", str, None,
       "a calibrated performance model of this machine (`moecomm predict --system local --calibrate RUN.json "
       "--save-system F.json`): it sets the default switch points and comm.plan()'s predicted times "
       "(default: the calibration shipped in collectives/model/calibrations/)",
       "collectives.prediction"),
    _s("MOECOMM_SHM_SPIN", int, None,
       "busy-poll turns of an shm wait before it yields (default 400, 16 when ranks outnumber cores)",
       "transports.shm", minimum=0),
    _s("MOECOMM_SHM_YIELD", int, 50,
       "sched_yield turns of an shm wait before it sleeps with backoff",
       "transports.shm", minimum=0),
    _s("MOECOMM_IPC_BUFFER_BYTES", int, 8 << 20,
       "per-rank registered buffer of the ipc transport in bytes; larger messages go in chunks "
       "(8 MiB: the buffer size of vLLM's custom all-reduce)",
       "transports.ipc", agree=True, minimum=4096),
    _s("MOECOMM_IPC_SYMMETRIC_BYTES", int, 16 << 20,
       "per-rank symmetric heap of the ipc transport in bytes: comm.symmetric_empty() tensors live there and "
       "are all-reduced in place, without a copy into the staging buffer",
       "transports.ipc", agree=True, minimum=0),
    _s("MOECOMM_IPC_EMULATE", int, 0,
       "1: the ipc transport serves CPU tensors on one node through POSIX shared memory and Triton's "
       "interpreter (TRITON_INTERPRET=1), so its kernels run without a GPU; 0: ipc serves CUDA tensors only",
       "transports.ipc", agree=True, minimum=0),
    _s("MOECOMM_NCCL_LIBRARY", str, None,
       "an NCCL library (a path) that `moecomm validate-gpu` preloads (LD_PRELOAD) into every step, rank and "
       "torch baseline, e.g. NCCL >= 2.30 built by tools/gpu/build_nccl.sh, which takes two ranks on one GPU "
       "(default: the one torch and cupy load)",
       "benchmarks.gpu_validate"),
    _s("MOECOMM_NCCL_CHECK", str, "first",
       "when the nccl transport compares call signatures across ranks: the first call of each signature, "
       "or always (an extra host exchange per call)",
       "transports.nccl", agree=True, choices=("first", "always")),
)}

SETTINGS_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS.values()}


def resolve(options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            *, source: str = "moecomm") -> dict[str, Any]:
    """Every setting's value: ``options[name]`` if given, else ``MOECOMM_<NAME>`` from the environment,
    else the default.

    options: keyword names of :data:`SETTINGS` (``{"shm_slot_bytes": 1 << 16}``); an unknown name
    raises ValueError listing the known ones. environ: defaults to ``os.environ``.
    Returns option name -> checked value.
    """
    given = parse_options(options or {}, source=source)
    return {name: given[name] if name in given else _from_environment(name, environ, source)
            for name in SETTINGS}


def option_or_environment(name: str, options: Mapping[str, Any] | None = None,
                          environ: Mapping[str, str] | None = None, *, source: str = "moecomm") -> Any:
    """One setting, as :func:`resolve` would give it, without checking the others.

    For what must be known before the others can be checked by every rank together (how the job
    was launched). Raises ValueError for a bad value of this setting only.
    """
    if isinstance(options, Mapping) and options.get(name) is not None:
        return SETTINGS[name].parse(options[name], source=f"{source} option {name}")
    return _from_environment(name, environ, source)


def _from_environment(name: str, environ: Mapping[str, str] | None, source: str) -> Any:
    s = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(s.env)
    return s.parse(raw if raw not in (None, "") else None, source=source)


def parse_options(options: Mapping[str, Any], *, source: str = "moecomm") -> dict[str, Any]:
    """Checked values of ``options`` (option names of :data:`SETTINGS`); a None value means "not given"
    and is left out.

    Raises TypeError if ``options`` is not a mapping, ValueError naming unknown options or bad values.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"{source}: options must be a mapping of setting names to values, got {type(options).__name__}")
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {unknown}; known: {sorted(SETTINGS)}")
    return {name: SETTINGS[name].parse(value, source=f"{source} option {name}")
            for name, value in options.items() if value is not None}


# Key of a settings mapping that lists the settings a rank left unset and the collectives layer
# filled in for the group (e.g. shm_one_shot_max from the performance model), so that a
# disagreement can say where a value came from.
DERIVED = "derived_settings"


def agreed_items(values: Mapping[str, Any]) -> dict[str, Any]:
    """The part of resolved ``values`` that every rank must share (see :attr:`Setting.agree`), with
    the :data:`DERIVED` list if there is one."""
    return {k: v for k, v in values.items() if k == DERIVED or SETTINGS[k].agree}


def markdown_table(fmt: Callable[[Any], str] = repr) -> str:
    """The settings as a Markdown table (variable, default, meaning, read by)."""
    rows = ["| variable | default | meaning | read by |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        default = "(detected)" if s.default is None and s.env == "MOECOMM_LAUNCH" else (
            "(see meaning)" if s.default is None else fmt(s.default))
        rows.append(f"| `{s.env}` | {default} | {s.meaning} | `{s.component}` |")
    return "\n".join(rows)


def check_timeout(timeout: Any, *, source: str = "timeout") -> float:
    """``timeout`` as a float of seconds, or ValueError/TypeError if it is not positive and finite.

    Every wait of a communicator is bounded by it: 0, a negative number, inf or nan would make a
    wait end at once or never, so they are refused up front.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{source} must be a number of seconds, got {timeout!r}")
    t = float(timeout)
    if not (t > 0 and t < float("inf")):  # also false for nan
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {timeout!r}")
    return t


def check_settings_agree(per_rank: list[dict], global_ranks: Sequence[int]) -> None:
    """ValueError naming each rank's value of every agreed setting that differs across ranks."""
    def show(d: Mapping[str, Any], name: str) -> str:
        v = d.get(name)
        if v is None:
            return "unset"
        return f"unset, so {v!r} for this group" if name in d.get(DERIVED, ()) else repr(v)

    diffs = []
    for name in sorted(set().union(*per_rank) - {DERIVED}):
        vals = [d.get(name) for d in per_rank]
        if any(v != vals[0] for v in vals):
            shown = ", ".join(f"rank {global_ranks[r]}: {show(d, name)}" for r, d in enumerate(per_rank))
            diffs.append(f"{SETTINGS[name].env} ({shown})")
    if diffs:
        raise ValueError("ranks disagree on settings that must be equal on every rank: " + "; ".join(diffs)
                         + ". Set them the same way on every rank (environment or init(options=...)).")
