"""A Hugging Face MoE model, expert-parallel over moecomm, on 2 ranks.

What it shows: a small random Qwen3-MoE (built from a ``Qwen3MoeConfig`` and saved to a temporary
directory, so nothing is downloaded) made expert-parallel both ways moecomm offers, each checked
against the same model run whole in one process:

(a) ``moe.hf.expert_parallel(model, comm)``: a model already in memory. Each rank keeps its
    ``num_experts / P`` experts, and every experts module sends its tokens to their experts' ranks
    and back through moecomm's ``ExpertDispatcher``. ``moe.hf.gather_experts_state_dict`` gives the
    full checkpoint back.
(b) transformers' own expert parallelism: ``from_pretrained(path, distributed_config=DistributedConfig(
    fsdp_size=2, ep_size=2, ep_implementation="moecomm"))`` over torch.distributed (gloo on CPUs).
    transformers shards the model (FSDP, and whole experts per rank); ``import moe.hf`` registered
    "moecomm" as its expert exchange.

Rank 0 prints, per entry point and per rank: the largest difference of the logits to the
one-process model, relative to the largest logit (float32: expect about 1e-7, and not more than
1e-5: only the order of the float sums differs), the parameters the rank holds against the full
model's ((a) its half of the experts and all the rest; (b) FSDP shards the rest too), and a few
greedily generated tokens with whether they equal the one-process model's. Each rank runs its own
prompt, of its own length, but its tokens meet the experts of every rank, so every forward is
collective: every rank must generate the same number of tokens (``min_new_tokens=max_new_tokens``).

Run it as it is; ``collectives.launch`` starts the 2 ranks (about 15 s on 2 CPU cores, most of it
importing transformers)::

    pip install "moecomm[hf]"
    python examples/hf_expert_parallel.py

On GPUs the same code puts each rank on its own GPU (``comm.device``: ``collectives.launch`` binds
rank r to ``cuda:r``) and torch.distributed on NCCL; moecomm then moves the experts' tokens over
NCCL or its ipc transport, whichever it picks for the call. (So far this example has run on CPUs only.)
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist

import collectives

RANKS, NEW_TOKENS, VOCAB = 2, 6, 128


def save_tiny_qwen3_moe(path: str) -> None:
    """A 2-layer Qwen3-MoE with 8 experts (top-2) and random weights, saved like any checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)


def local_numel(model: torch.nn.Module) -> int:
    """Parameters this rank holds (a DTensor, as FSDP makes them, counts only its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def check(comm, title: str, model, ref, prompt: torch.Tensor) -> None:
    """Compare ``model`` (expert-parallel) with ``ref`` (the whole model) on this rank's prompt; rank 0 prints."""
    with torch.no_grad():
        logits, want = model(prompt).logits, ref(prompt).logits
        diff = float((logits - want).abs().max() / want.abs().max())
        # greedy; every forward is collective, so every rank takes exactly NEW_TOKENS steps
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        want_tokens = ref.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    new = tokens[0, prompt.shape[1]:].tolist()
    row = torch.tensor([[diff, local_numel(model), torch.equal(tokens, want_tokens), *new]], dtype=torch.float64)
    rows = comm.all_gather(row)  # [RANKS, 3 + NEW_TOKENS]: every rank's numbers, gathered by moecomm
    if comm.rank == 0:
        full = local_numel(ref)
        print(f"\n{title}")
        for r, (d, n, same, *toks) in enumerate(rows.tolist()):
            print(f"  rank {r}: logits max rel diff {d:.1e} | params {int(n):,} of {full:,} ({n / full:.0%}) | "
                  f"generated {[int(t) for t in toks]}, equal to one process: {bool(same)}", flush=True)


def main(comm: collectives.Communicator, tmp: str) -> None:
    # transformers is imported here, in the ranks: the launching process needs only collectives
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # importing moe.hf registers ep_implementation="moecomm" with transformers
    from moe.hf import expert_parallel, gather_experts_state_dict

    transformers.utils.logging.disable_progress_bar()
    path = os.path.join(tmp, "tiny-qwen3-moe")
    if comm.rank == 0:
        save_tiny_qwen3_moe(path)  # a checkpoint on disk, as a real model's would be
    comm.barrier()
    device = comm.device  # cpu here; cuda:<rank> on GPUs
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()  # whole, every rank
    # this rank's prompt: its own tokens and length (4 on rank 0, 7 on rank 1)
    gen = torch.Generator().manual_seed(comm.rank)
    prompt = torch.randint(0, VOCAB, (1, 4 + 3 * comm.rank), generator=gen).to(device)

    # (a) a model in memory: keep this rank's experts, route the tokens through moecomm (collective)
    model = expert_parallel(copy.deepcopy(ref), comm)
    check(comm, "(a) moe.hf.expert_parallel(model, comm)", model, ref, prompt)
    state = gather_experts_state_dict(model)  # the full checkpoint again, e.g. for save_pretrained
    same = all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    if comm.rank == 0:
        print(f"  gather_experts_state_dict equals the original checkpoint: {same}", flush=True)

    # (b) transformers' own expert parallelism over torch.distributed, with moecomm as the exchange
    os.environ["LOCAL_RANK"] = str(device.index or 0)  # transformers binds this GPU (torchrun sets it)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/dist-init", rank=comm.rank, world_size=comm.size)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        distributed_config=DistributedConfig(fsdp_size=comm.size, ep_size=comm.size, ep_implementation="moecomm"))
    check(comm, '(b) from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2, '
                'ep_implementation="moecomm"))', model.eval(), ref, prompt)
    dist.destroy_process_group()


if __name__ == "__main__":  # required: launch's ranks import this module, and must not launch again
    # it takes no options: --help shows the docstring above, anything else is refused, not ignored
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        collectives.launch(main, RANKS, tmp)  # main(comm, tmp) on 2 local ranks
