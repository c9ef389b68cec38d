"""moecomm's analytical performance model: predict collectives and MoE all-to-all before running them.

Pure math and data (no torch, no communication). ``systems`` describes machines, ``collective``
the alpha-beta cost of every algorithm x protocol and the choice by minimum time, ``moe`` the
expert-parallel dispatch/combine, ``calibrate`` fits a System from a ``moecomm bench --json`` run
(its alpha-beta lines: ``piecewise``; which fitted term predicts a size: ``segments``)::

    from collectives.model import get_system, predict_collective
    p = predict_collective(get_system("dgx-h100"), "all_reduce", 1 << 30, nodes=4)
    p.time_us, p.busbw, p.algorithm, p.protocol, p.bottleneck
"""

from .calibrate import calibrate, crossover_bytes, fitted_time_us
from .collective import (
    ALGORITHMS,
    NCCL_ALGORITHMS,
    OPS,
    PROTOCOLS,
    Candidate,
    Prediction,
    bus_factor,
    dtype_bytes,
    predict_collective,
)
from .moe import DISPATCH_DTYPES, MODES, MOE_OPS, MoEPrediction, expected_distinct, predict_moe
from .systems import Link, System, get_system, list_systems, load_system_file

__all__ = ["ALGORITHMS", "NCCL_ALGORITHMS", "OPS", "PROTOCOLS", "Candidate", "Prediction", "bus_factor",
           "dtype_bytes", "predict_collective", "Link", "System", "get_system", "list_systems", "load_system_file",
           "MOE_OPS", "MODES", "DISPATCH_DTYPES", "MoEPrediction", "expected_distinct", "predict_moe",
           "calibrate", "crossover_bytes", "fitted_time_us"]
