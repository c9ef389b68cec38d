"""Hugging Face MoE models expert-parallel over moecomm (moe.hf), against the one-process model.

Six families through transformers' experts interface (Mixtral; Qwen3-MoE; Qwen2-MoE with its gated
shared expert; OLMoE; DeepSeek-V3 with group-limited sigmoid routing, a correction bias and shared
experts; GPT-OSS with router and expert biases and the clamped SwiGLU), tiny random models in
float64, 2 and 4 ranks with a different sequence length on each rank, through both entry points:
``expert_parallel(model, comm)`` and ``from_pretrained(..., distributed_config=DistributedConfig(
fsdp_size=P, ep_size=P, ep_implementation="moecomm"))`` (torch.distributed over gloo, whose EP group
gets a moecomm communicator made over its ranks; at 2 ranks also over the "moecomm" backend).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import collectives

VOCAB = 61
# name -> (config class, causal-LM class, config arguments): hidden 32, 8 experts, top-2 unless said
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 2, "eos_token_id": 1,
           "pad_token_id": 0}
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       head_dim=8, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                         num_experts_per_tok=2, num_key_value_heads=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, num_hidden_layers=3, kv_lora_rank=16, q_lora_rank=24,
                         qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                     sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
}


def _tiny(name: str):
    """The family's tiny model, float64, every parameter and buffer random (same on every rank)."""
    cfg_cls, model_cls, kwargs = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg._experts_implementation = "eager"  # grouped_mm has no float64
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in pname:
                noise = torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.2
                t.copy_(noise + (1.0 if "norm" in pname else 0.0))
    return model


def _inputs(rank: int) -> torch.Tensor:
    """[1, 4 + 3 * rank] token ids: a different length on every rank."""
    return torch.randint(0, VOCAB, (1, 4 + 3 * rank), generator=torch.Generator().manual_seed(100 + rank))


def _compare(model, ref, rank: int) -> dict:
    """Logits (relative), input-embedding gradients and greedy tokens of ``model`` against ``ref``."""
    ids = _inputs(rank)
    emb = ref.get_input_embeddings()(ids).detach()
    mine, theirs = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    out = model(inputs_embeds=mine).logits
    want = ref(inputs_embeds=theirs).logits
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=want.dtype)
    (out * w).sum().backward()
    (want * w).sum().backward()
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        want_tokens = ref.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    return {"logits": float((out - want).abs().max() / want.abs().max()),
            "grad": float((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max()),
            "tokens": torch.equal(tokens, want_tokens)}


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _expert_numel(model) -> int:
    from moe.hf import experts_modules

    return sum(p.numel() for _, m in experts_modules(model) for p in m.parameters(recurse=False))


def _in_memory(comm, families: list) -> dict:
    """expert_parallel on ``families``: the comparison, parameter counts, and the gathered checkpoint."""
    from moe.hf import expert_parallel, gather_experts_state_dict

    res = {}
    for name in families:
        ref = _tiny(name)
        model = copy.deepcopy(ref)
        full, experts = _numel(ref), _expert_numel(ref)
        assert expert_parallel(model, comm) is model
        res[name] = _compare(model, ref, comm.rank)
        res[name]["shrunk"] = full - _numel(model) == experts - experts // comm.size
        state = gather_experts_state_dict(model)
        res[name]["state_dict"] = state.keys() == ref.state_dict().keys() and all(
            torch.equal(state[k], v) for k, v in ref.state_dict().items())
    return res


def _from_pretrained(comm, paths: dict, init_file: str, backend: str, families: list) -> dict:
    """DistributedConfig(fsdp_size=P, ep_size=P, ep_implementation="moecomm") on the saved families."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # DeepSeek-V3 makes its router weight float32 whatever the model's dtype, and FSDP2 refuses a float32
    # parameter next to float64 ones: transformers' own "all_to_all" fails the same way. Here (this rank's
    # process only) the router weight takes the dtype the model is built in; its forward computes in float32.
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    import moe.hf  # noqa: F401 - registers "moecomm"

    router_init = deepseek.DeepseekV3TopkRouter.__init__

    def router_in_model_dtype(self, config):
        router_init(self, config)
        self.weight.data = self.weight.data.to(torch.get_default_dtype())

    deepseek.DeepseekV3TopkRouter.__init__ = router_in_model_dtype
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=comm.rank, world_size=comm.size)
    try:
        res = {}
        for name in families:
            ref = _tiny(name)
            model = AutoModelForCausalLM.from_pretrained(
                paths[name], dtype=torch.float64, experts_implementation="eager",
                distributed_config=DistributedConfig(fsdp_size=comm.size, ep_size=comm.size,
                                                     ep_implementation="moecomm"))
            res[name] = _compare(model, ref, comm.rank)
            # whole experts per rank: each experts module holds E / P of them
            res[name]["local_experts"] = sorted({m.num_experts for _, m in _experts_of(model)})
        return res
    finally:
        dist.destroy_process_group()


def _experts_of(model):
    from moe.hf import experts_modules

    return experts_modules(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for name in FAMILIES:
        paths[name] = str(root / name)
        _tiny(name).save_pretrained(paths[name])
    return paths


def _check(results: dict, families, size: int) -> None:
    for rank, res in enumerate(results):
        for name in families:
            r = res[name]
            assert r["logits"] <= 1e-7, (rank, name, r)
            assert r["grad"] <= 1e-6, (rank, name, r)
            assert r["tokens"], (rank, name, r)
            if "shrunk" in r:
                assert r["shrunk"] and r["state_dict"], (rank, name, r)
            if "local_experts" in r:
                assert r["local_experts"] == [8 // size], (rank, name, r)


# Every family at 2 ranks; at 4 ranks (2 experts a rank) the default run takes the two whose
# experts split least plainly: DeepSeek-V3 (group-limited routing, 4 groups of 2 experts: one group
# a rank; shared experts, a dense first layer) and GPT-OSS (expert biases, the clamped SwiGLU). Every
# family at 4 ranks, both entry points: the slow tier's [4-every] cases (tests/conftest.py SLOW).
AT_4 = ["deepseek_v3", "gpt_oss"]
FAMILY_SETS = {"every": list(FAMILIES), "two": AT_4, "deepseek_v3": ["deepseek_v3"]}


@pytest.mark.parametrize("size,families", [(2, "every"), (4, "two"), (4, "every")], ids=["2", "4", "4-every"])
def test_expert_parallel_in_memory_equals_one_process(size, families):
    families = FAMILY_SETS[families]
    results = collectives.launch(_in_memory, size, families, transport="shm", timeout=120.0)
    _check(results, families, size)


@pytest.mark.parametrize("size,backend,families", [(2, "gloo", "every"), (4, "gloo", "two"),
                                                   (2, "moecomm", "deepseek_v3"), (4, "gloo", "every")],
                         ids=["2-gloo", "4-gloo", "2-moecomm", "4-gloo-every"])
def test_distributed_config_ep_implementation_moecomm(size, backend, families, saved, tmp_path):
    families = FAMILY_SETS[families]
    results = collectives.launch(_from_pretrained, size, saved, str(tmp_path / "init"), backend, families,
                                 transport="shm", timeout=180.0)
    _check(results, families, size)


def _edges(comm, tmp: str) -> dict:
    """A rank with no tokens, the errors every rank must raise, and save_pretrained of the expert-parallel model."""
    from moe.hf import expert_parallel, gather_experts_state_dict

    out = {}
    ref = _tiny("qwen3_moe")
    model = expert_parallel(copy.deepcopy(ref), comm)
    experts, want_experts = model.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
    tokens = 0 if comm.rank == 1 else 5
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(tokens, 32, generator=gen, dtype=torch.float64)
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, 2, dtype=torch.int64)
    w = torch.rand(tokens, 2, generator=gen, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, want = experts(xa, idx, w), want_experts(xb, idx, w)
    y.sum().backward()  # collective: every rank, the one without tokens too
    if want.requires_grad:  # the one-process experts return a constant for no tokens
        want.sum().backward()
    want_grad = torch.zeros_like(xb) if xb.grad is None else xb.grad
    out["empty rank"] = bool(torch.allclose(y, want, rtol=1e-12, atol=1e-12) and torch.allclose(xa.grad, want_grad))
    for label, bad in (("no experts", torch.nn.Sequential(torch.nn.Linear(4, 4))),
                       ("uneven", _tiny("mixtral") if comm.rank == 0 else _mixtral_with(6)),
                       ("twice", model)):
        try:
            expert_parallel(bad, comm)
            out[label] = "no error"
        except (TypeError, ValueError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    # without state_dict= it would write this rank's half of the experts: refused, nothing written
    half = os.path.join(tmp, f"half{comm.rank}")
    try:
        model.save_pretrained(half)
        out["save"] = "no error"
    except ValueError as e:
        out["save"] = f"ValueError: {e}"
    out["save wrote"] = os.path.exists(os.path.join(half, "config.json"))
    state = gather_experts_state_dict(model)  # collective
    full = os.path.join(tmp, f"full{comm.rank}")
    model.save_pretrained(full, state_dict=state)
    saved = type(ref).from_pretrained(full, dtype=torch.float64).state_dict()
    out["saved whole"] = all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())
    return out


def _mixtral_with(experts: int):
    cfg_cls, model_cls, kwargs = FAMILIES["mixtral"]
    cfg = getattr(transformers, cfg_cls)(**dict(kwargs, num_local_experts=experts))
    return getattr(transformers, model_cls)(cfg)


def test_empty_rank_and_errors_on_every_rank(tmp_path):
    results = collectives.launch(_edges, 2, str(tmp_path), transport="shm", timeout=120.0)
    for rank, out in enumerate(results):
        assert out["empty rank"] is True, (rank, out)
        assert out["no experts"].startswith("TypeError") and "Sequential" in out["no experts"], out
        assert out["uneven"].startswith("ValueError") and "num_experts" in out["uneven"], out
        assert out["twice"].startswith("ValueError") and "already" in out["twice"], out
        for label in ("no experts", "twice"):  # said once, not "expert_parallel on rank 0: expert_parallel on ..."
            assert out[label].count("expert_parallel on") == 1, out[label]
        assert out["save"].startswith(f"ValueError: save_pretrained on rank {rank}"), out["save"]
        assert "gather_experts_state_dict" in out["save"] and not out["save wrote"], out
        assert out["saved whole"], out


def test_registered_with_transformers():
    from transformers.distributed.expert_parallel import EPImplementationInterface

    import moe.hf

    assert EPImplementationInterface()["moecomm"] is moe.hf.MoecommEP
    assert os.path.basename(moe.hf.__file__) == "hf.py"
