"""The NCCL transport: imports everywhere; the collectives themselves need a GPU (skipped without)."""

from __future__ import annotations

import pytest
import torch

import collectives
from transports.nccl import (NCCL_DTYPES, NCCL_OPS, decode_unique_id, encode_unique_id, encode_unique_id_failure,
                             nccl_module, nccl_version)
from transports.base import ReduceOp

HAS_NCCL = nccl_module() is not None
needs_gpu = pytest.mark.skipif(not HAS_NCCL, reason="needs a CUDA GPU with cupy and libnccl "
                                                    "(pip install 'moecomm[cuda12]')")


def test_module_imports_and_maps_every_dtype_and_op():
    assert set(NCCL_OPS) == set(ReduceOp)
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8} <= set(NCCL_DTYPES)
    if not HAS_NCCL:
        assert nccl_version() is None


@pytest.mark.parametrize("uid", [bytes(range(1, 129)), tuple((-1) ** i * (i % 97) for i in range(128))],
                         ids=["cupy14-bytes", "cupy13-tuple"])
def test_unique_id_travels_as_the_type_cupy_gave(uid):
    # cupy-cuda13x 14.2.0 returns bytes (seen on the H100), older cupy a tuple of ints: each must
    # reach NcclCommunicator as it left get_unique_id
    back = decode_unique_id(encode_unique_id(uid), 0)
    assert back == uid and type(back) is type(uid)


def test_root_failing_to_make_the_unique_id_raises_its_error_on_every_rank():
    with pytest.raises(RuntimeError, match=r"rank 3 could not make the NCCL unique id: OSError: no libnccl"):
        decode_unique_id(b"E" + b"OSError: no libnccl", 3)
    with pytest.raises(RuntimeError, match=r"rank 0 could not make the NCCL unique id: OSError: no libnccl"):
        decode_unique_id(encode_unique_id_failure(OSError("no libnccl")), 0)
    with pytest.raises(RuntimeError, match="unreadable"):
        decode_unique_id(b"", 0)


def test_cpu_only_communicator_has_no_nccl_and_stages_cuda_nowhere():
    with collectives.init() as comm:
        assert "nccl" not in comm.transports or HAS_NCCL


def _body_gpu(comm):
    torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    x = torch.randn(1 << 20, device="cuda") + comm.rank
    y = comm.all_reduce(x)
    xs = comm.all_gather(x.cpu().reshape(1, -1)).double()
    torch.testing.assert_close(y.cpu().double(), xs.sum(0), rtol=1e-5, atol=1e-4)
    return comm.plan("all_reduce", x).transport


@needs_gpu
def test_all_reduce_on_gpu_world_size_1():
    assert collectives.launch(_body_gpu, 1) == ["nccl"]
