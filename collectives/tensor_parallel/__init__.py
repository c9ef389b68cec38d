"""Megatron-style tensor-parallel layers on a :class:`~collectives.Communicator`.

    from collectives.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    fc1 = ColumnParallelLinear(hidden, ffn, comm)            # weight [ffn / tp, hidden]
    fc2 = RowParallelLinear(ffn, hidden, comm)               # weight [hidden, ffn / tp]
    y = fc2(F.gelu(fc1(x)))                                  # x, y: [tokens, hidden], replicated

Every rank of ``comm`` is one tensor-parallel (TP) rank. The column layer splits the output
dim of the weight, the row layer its input dim, the vocab-parallel embedding its vocabulary.
The communication lives in the autograd "region" functions of :mod:`.mappings` (named, as in
Megatron-LM, for what they do in forward; their backward is the mirror); :mod:`.init` draws
each rank's shard of a seeded global initialisation; :mod:`.layers` holds the layers.

Sequence parallelism (``sequence_parallel=True``) keeps activations outside the TP region
sharded along the first (sequence) dim: the column layer all-gathers its input, the row layer
reduce-scatters its output. All ranks must run the same layers in the same order (forward and
backward), as for every collective. Double backward is not supported (it raises).
"""

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (copy_to_tensor_parallel_region, divide, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "divide",
]
