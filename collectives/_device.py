"""Which device a rank binds to: ``device=`` of ``collectives.init``/``launch`` and the Communicator."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

#: what ``device=`` accepts, for messages
DEVICE_FORMS = 'None (cuda:local_rank, or cpu without a GPU), an int N, "cuda", "cuda:N", a torch.device, or "cpu"'


def resolve_device(device: Any, local_rank: int, *, device_count: int | None = None) -> torch.device:
    """The device this rank's communicator binds to (its NCCL communicator, its CUDA tensors).

    Args:
        device: None or "cuda" (a torch.device("cuda") too): ``cuda:(local_rank % device_count)``,
            so the ranks of a node spread over its GPUs (and share them when there are more
            ranks than GPUs), or cpu when this process sees no GPU; an int N, "cuda:N" or
            torch.device("cuda", N): cuda:N; "cpu": no GPU (no NCCL; CUDA tensors are copied
            through host memory).
        local_rank: this rank's index among the ranks of its node.
        device_count: CUDA devices this process sees (default: ``torch.cuda.device_count()``
            when CUDA is available, else 0).
    Returns:
        A ``torch.device``: ``cpu``, or ``cuda`` with an index in [0, device_count).
    Raises:
        TypeError: device of another type (a bool, a float, ...).
        ValueError: an unknown string or device type, a negative index, an index this process
            has no GPU for, or a CUDA device asked for where there is no GPU.
    """
    if device_count is None:
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(device, np.integer):
        device = int(device)
    if device is None:
        return torch.device("cuda", local_rank % device_count) if device_count else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"device must be {DEVICE_FORMS}; got {device!r} ({type(device).__name__})")
    if isinstance(device, int):
        index: int | None = device
    else:
        text = str(device).strip().lower() if isinstance(device, str) else None
        if text is not None and not re.fullmatch(r"cpu|cuda(:\d+)?|cuda:-\d+", text):
            raise ValueError(f"device must be {DEVICE_FORMS}; got {device!r}")
        dev = torch.device(text) if text is not None and not text.startswith("cuda:-") else device
        if isinstance(dev, str):  # "cuda:-1": torch refuses it with a less helpful message
            index = int(dev.split(":")[1])
        elif dev.type == "cpu":
            return torch.device("cpu")
        elif dev.type != "cuda":
            raise ValueError(f"device must be {DEVICE_FORMS}; got {device!r} (collectives move cpu and cuda tensors)")
        else:
            index = dev.index
    if not device_count:
        raise ValueError(f"device={device!r} asks for a CUDA device, but this process sees no GPU; "
                         'pass device="cpu" or leave device out')
    if index is None:
        return torch.device("cuda", local_rank % device_count)
    if not 0 <= index < device_count:
        raise ValueError(f"device={device!r}: no such CUDA device here; this process sees {device_count} GPU(s), "
                         f"cuda:0 to cuda:{device_count - 1}")
    return torch.device("cuda", index)
