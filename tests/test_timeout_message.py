"""Timeout messages carry " timeout " as torch's callers expect (PyTorch's distributed tests match
``" (Timed out|closed|timeout) "``), on every transport."""

from __future__ import annotations

import re

import pytest
import torch

import collectives
from transports.base import CollectiveTimeoutError

TORCH_PATTERN = re.compile(" (Timed out|closed|timeout) ")


def _rank_1_stays_away(comm):
    if comm.rank == 1:
        return None
    try:
        comm.all_reduce(torch.arange(7, dtype=torch.float32))
        return "no error"
    except CollectiveTimeoutError as e:
        return str(e)


@pytest.mark.parametrize("transport", ["shm", "gloo", "ipc"])
def test_a_timeout_says_timeout(transport):
    if transport == "ipc":
        pytest.importorskip("triton")
    options = {"ipc_emulate": 1} if transport == "ipc" else {}
    msg = collectives.launch(_rank_1_stays_away, 2, transport=transport, timeout=1.0, options=options)[0]
    assert TORCH_PATTERN.search(msg), msg
    assert "rank 1" in msg, msg
