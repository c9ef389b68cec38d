"""What the performance model (:mod:`collectives.model`) decides for a communicator, and what it predicts.

Two uses, both from a calibrated model of this machine (a System fitted from ``moecomm bench`` /
``tools/tune_shm.py --json`` runs by :func:`collectives.model.calibrate`):

- **Switch points.** The shm transport's one-shot/two-shot all_reduce switch is where the fitted
  (piecewise) predictions of the two algorithms first cross (:func:`shm_one_shot_limit`). It is
  computed per communicator (it depends on the rank count) into the settings the transports get;
  ``shm_one_shot_max`` is an agreed setting, so ranks whose models differ raise ``ValueError`` at creation instead of running
  different algorithms. An explicit ``MOECOMM_SHM_ONE_SHOT_MAX`` still wins. (ipc vs nccl on GPUs
  stays the measured-nowhere table in :mod:`collectives.selection` until a GPU run is calibrated.)
- **Predicted times** for :meth:`Communicator.plan`: the chosen plan's and the runner-up's.

The model is ``MOECOMM_MODEL_FILE`` (a System JSON: ``moecomm predict --system local --calibrate RUN.json
--save-system F.json``) or, by default, the calibration shipped in ``collectives/model/calibrations/``
(fitted on the 2-vCPU CI machine by ``tools/calibrate_host.py``; see that file's ``sources``). CUDA
tensors use the preset of the GPU's architecture (dgx-a100 / dgx-h100 / b200-8) unless the model file
describes GPUs.

Fits exist for the rank counts a run measured. For another count the nearest fitted one is rescaled
by the algorithm's traffic (bytes moved per byte of size: ``n - 1`` for one-shot, the bus factor
otherwise) with its latency and size segments kept; oversubscription (more ranks than cores) is not
modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Mapping

from transports.settings import DERIVED
from transports.shm import ONE_SHOT_UNBOUNDED

log = logging.getLogger("collectives")

# The calibration shipped with the package (package data; see pyproject.toml).
DEFAULT_HOST_MODEL = Path(__file__).resolve().parent / "model" / "calibrations" / "host-2vcpu.json"

# GPU architecture (torch's major.minor) -> the preset whose NVLink/NVSwitch fabric it comes in.
_PRESET_BY_ARCH = {(8, 0): "dgx-a100", (9, 0): "dgx-h100", (10, 0): "b200-8"}



@dataclasses.dataclass(frozen=True)
class Predicted:
    """Predicted times of a call: the chosen plan's and the runner-up's (us; None: not modelled)."""

    chosen_us: float | None
    runner_up: str | None
    runner_up_us: float | None


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Any:
    from .model import load_system_file

    return load_system_file(path)


def host_model(settings: Mapping[str, Any]) -> Any:
    """The calibrated System for host tensors: ``settings["model_file"]`` or the shipped one.

    Raises ValueError naming the file when it cannot be read or is not calibrated.
    """
    path = settings.get("model_file") or str(DEFAULT_HOST_MODEL)
    try:
        system = _load(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"MOECOMM_MODEL_FILE={path}: cannot load the performance model ({e}); write one with "
                         "`moecomm predict --system local --calibrate RUN.json --save-system F.json`") from None
    if not system.calibration:
        raise ValueError(f"MOECOMM_MODEL_FILE={path}: system {system.name!r} is not calibrated (no fitted terms); "
                         "write one with `moecomm predict --system local --calibrate RUN.json --save-system F.json`")
    return system


def at_ranks(system: Any, ranks: int) -> Any:
    """``system`` with fitted terms for ``ranks`` ranks (rescaled from the nearest fitted count if needed).

    Args:
        system: a calibrated System; ranks: the communicator's size (>= 2).
    Returns:
        A System whose calibration holds, per op, terms for exactly ``ranks`` ranks.
    """
    from .model.calibrate import traffic_factor

    terms: dict[str, list[dict[str, Any]]] = {}
    for op, fitted in system.calibration.items():
        counts = sorted({int(t["ranks"]) for t in fitted})
        if not counts:
            continue
        nearest = min(counts, key=lambda k: (abs(k - ranks), -k))
        for t in fitted:
            if int(t["ranks"]) != nearest:
                continue
            bare = str(t["algorithm"]).rsplit("/", 1)[-1]
            was, now = traffic_factor(op, bare, nearest), traffic_factor(op, bare, ranks)
            scale = now / was if was > 0 else 1.0
            terms.setdefault(op, []).append({**t, "ranks": ranks, "beta_us_per_byte": t["beta_us_per_byte"] * scale,
                                             **({"rescaled_from_ranks": nearest} if nearest != ranks else {})})
    return dataclasses.replace(system, gpus_per_node=max(ranks, 1), calibration=terms)


def shm_one_shot_limit(system: Any, ranks: int) -> int | None:
    """Largest all_reduce (bytes of one rank's buffer) the shm transport should run one-shot.

    Args:
        system: a calibrated System with shm one_shot and two_shot all_reduce fits (one line each
            or piecewise, several size segments per algorithm).
        ranks: ranks in the shm group.
    Returns:
        One byte below the first size where one-shot, faster at small sizes, stops being faster
        (:func:`collectives.model.calibrate.crossover_bytes` on the piecewise predictions);
        unbounded when one-shot is never slower (or for one rank), 0 when two-shot is faster at
        small sizes; None when the model has no fit for the two algorithms (the transport then
        keeps its own default).
    """
    from .model.calibrate import comparison_start, crossover_bytes, fitted_time_us

    if ranks <= 1:
        return ONE_SHOT_UNBOUNDED
    scaled = at_ranks(system, ranks)
    names = ("shm/one_shot", "shm/two_shot")
    try:
        cross = crossover_bytes(scaled, "all_reduce", *names, ranks=ranks)
        small = comparison_start(scaled, "all_reduce", *names, ranks=ranks)  # where crossover_bytes starts
        one_us, two_us = (fitted_time_us(scaled, "all_reduce", name, small, ranks=ranks) for name in names)
    except ValueError as e:
        log.debug("no shm one-shot/two-shot fit in model %s: %s", system.name, e)
        return None
    if cross is not None and one_us <= two_us:
        return max(cross - 1, 0)  # one-shot (fewer rounds) wins below the crossing
    if cross is not None:  # two-shot faster at small sizes, one-shot at large: fits that make no sense
        log.warning("performance model %s: shm two-shot fits faster than one-shot below %d B on %d ranks; "
                    "running two-shot at every size", system.name, cross, ranks)
        return 0
    return ONE_SHOT_UNBOUNDED if one_us <= two_us else 0


def transport_settings(settings: Mapping[str, Any], *, ranks: int, single_node: bool) -> dict[str, Any]:
    """The settings the transports get: ``settings`` with the model's switch points filled in.

    Only settings left at None (their default) are derived; what a user set is kept. Raises
    ValueError when the model file cannot be used (a creation error every rank hears of).
    """
    out = dict(settings)
    if single_node and out.get("shm_one_shot_max") is None:
        limit = shm_one_shot_limit(host_model(settings), ranks)
        if limit is not None:
            out["shm_one_shot_max"] = limit
            out[DERIVED] = [*out.get(DERIVED, ()), "shm_one_shot_max"]  # for the agreement's message
            log.debug("shm one-shot limit for %d ranks: %d B (performance model)", ranks, limit)
    return out


def _gpu_model(settings: Mapping[str, Any], device: Any) -> Any:
    if settings.get("model_file"):
        system = host_model(settings)
        if system.arch != "host":
            return system
    try:
        import torch

        preset = _PRESET_BY_ARCH.get(tuple(torch.cuda.get_device_capability(device)))
    except Exception:  # noqa: BLE001 - no usable CUDA here: no GPU prediction
        return None
    if preset is None:
        return None
    from .model import get_system

    return get_system(preset)


def _nccl_tests_size(op: str, nbytes: int, ranks: int) -> int:
    """nccl-tests' size column for a call whose one rank's input is ``nbytes``."""
    return nbytes * ranks if op == "all_gather" else nbytes


def predict_plan(settings: Mapping[str, Any], *, op: str, transport: str, algorithm: str, nbytes: int,
                 ranks: int, nodes: int, device: Any, available: set[str]) -> Predicted:
    """Predicted time of one plan and of the best other plan among the communicator's transports.

    Args:
        settings: the communicator's settings (``model_file``); op: the collective's name;
        transport, algorithm: the chosen plan; nbytes: bytes of this rank's input; ranks, nodes:
        the group's size and node count; device: the tensors' device (torch.device);
        available: the communicator's transports.
    Returns:
        :class:`Predicted` (fields None where the model has nothing for this call: barrier, ops or
        transports without a fit, several nodes of host ranks).
    """
    from .model import OPS, predict_collective

    if op not in OPS or ranks < 2:
        return Predicted(None, None, None)
    size = _nccl_tests_size(op, nbytes, ranks)
    try:
        if getattr(device, "type", "cpu") == "cuda":
            system = _gpu_model(settings, device)
            if system is None or ranks % nodes or ranks // nodes > system.gpus_per_node:
                return Predicted(None, None, None)
            p = predict_collective(system, op, size, nodes=nodes, gpus_per_node=ranks // nodes)
            # The model's algorithms by the transport that runs them here.
            plans = [(("ipc" if c.algorithm in ("one_shot", "two_shot") else "nccl"), c.algorithm, c.time_us)
                     for c in p.candidates]
        else:
            if nodes != 1:
                return Predicted(None, None, None)
            p = predict_collective(at_ranks(host_model(settings), ranks), op, size, nodes=1, gpus_per_node=ranks)
            plans = [(*c.algorithm.split("/", 1), c.time_us) for c in p.candidates if "/" in c.algorithm]
    except ValueError as e:
        log.debug("no prediction for %s of %d B on %d ranks: %s", op, nbytes, ranks, e)
        return Predicted(None, None, None)
    best: dict[tuple[str, str], float] = {}  # (transport, algorithm) -> fastest protocol's time
    for t, a, us in plans:
        if t in available:
            best[(t, a)] = min(us, best.get((t, a), us))
    mine = (transport, algorithm) if (transport, algorithm) in best else \
        min((k for k in best if k[0] == transport), key=best.__getitem__, default=None)  # NCCL picks its own
    rest = sorted((us, f"{t}/{a}") for (t, a), us in best.items() if (t, a) != mine)
    return Predicted(best[mine] if mine else None, rest[0][1] if rest else None, rest[0][0] if rest else None)
