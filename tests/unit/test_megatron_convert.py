"""HF <-> Megatron GPTModel weight conversion and TP sharding (pure torch; no megatron-core needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.engine.megatron.convert import (
    detect_layout,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    merge_tp,
    shard_for_tp,
    split_qkv,
)
from slipstream.models.config import ModelConfig
from slipstream.models.hf import to_hf_state_dict
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer

QWEN2_TINY = dataclasses.replace(get_preset("tiny"), family="qwen2", qk_norm=False, attention_bias=True)
CONFIGS = {"tiny": get_preset("tiny"), "tiny-llama": get_preset("tiny-llama"), "qwen2-bias": QWEN2_TINY}


def random_hf_sd(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named state dict of a native model with every tensor random (norms and biases too)."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in to_hf_state_dict(model.state_dict()).items()}


@pytest.mark.parametrize("layout", ["local", "te"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_bit_exact(name: str, layout: str) -> None:
    cfg = CONFIGS[name]
    hf = random_hf_sd(cfg)
    mg = hf_to_megatron(hf, cfg, layout=layout)
    assert detect_layout(mg) == layout
    assert ("output_layer.weight" in mg) == (not cfg.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == cfg.attention_bias
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mg) == cfg.qk_norm
    back = megatron_to_hf(mg, cfg)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_tied_head_in_hf_input_is_dropped() -> None:
    cfg = get_preset("tiny")
    hf = random_hf_sd(cfg)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    assert "output_layer.weight" not in hf_to_megatron(hf, cfg)


def test_qkv_layout_is_grouped_per_kv_head() -> None:
    """Hand-built: tiny has 4 q heads, 2 kv groups, head_dim 16 -> rows q0 q1 k0 v0 | q2 q3 k1 v1."""
    cfg = get_preset("tiny")
    d, h = cfg.head_dim, cfg.hidden_size
    # Every row of head j of projection p is filled with a code identifying (p, j).
    q = torch.arange(cfg.num_heads).repeat_interleave(d)[:, None].expand(-1, h).float()
    k = 100 + torch.arange(cfg.num_kv_heads).repeat_interleave(d)[:, None].expand(-1, h).float()
    v = 200 + torch.arange(cfg.num_kv_heads).repeat_interleave(d)[:, None].expand(-1, h).float()
    qkv = fuse_qkv(q, k, v, cfg)
    head_codes = qkv[::d, 0].tolist()
    assert head_codes == [0, 1, 100, 200, 2, 3, 101, 201]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, cfg), (q, k, v)))


def test_fc1_is_gate_then_up() -> None:
    cfg = get_preset("tiny-llama")
    hf = random_hf_sd(cfg)
    mg = hf_to_megatron(hf, cfg)
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    i = cfg.intermediate_size
    assert torch.equal(fc1[:i], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[i:], hf["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_shard_merge_bit_exact(name: str) -> None:
    cfg = CONFIGS[name]
    mg = hf_to_megatron(random_hf_sd(cfg), cfg)
    shards = [shard_for_tp(mg, 2, r, cfg) for r in range(2)]
    for shard in shards:
        fc2 = shard["decoder.layers.0.mlp.linear_fc2.weight"]
        assert fc2.shape == (cfg.hidden_size, cfg.intermediate_size // 2)
        assert shard["embedding.word_embeddings.weight"].shape == (cfg.vocab_size // 2, cfg.hidden_size)
    merged = merge_tp(shards)
    assert merged.keys() == mg.keys()
    for k in mg:
        assert torch.equal(merged[k], mg[k]), k


@pytest.mark.parametrize("name", ["tiny", "qwen2-bias"])
def test_tp_shard_holds_its_query_groups(name: str) -> None:
    """Rank r's linear_qkv is [q heads of its groups, k, v] per group, checked against HF q/k/v."""
    cfg = CONFIGS[name]
    hf = random_hf_sd(cfg)
    mg = hf_to_megatron(hf, cfg)
    tp, d = 2, cfg.head_dim
    groups_per_rank = cfg.num_kv_heads // tp
    q_per_group = cfg.num_heads // cfg.num_kv_heads
    for suffix in ["weight"] + (["bias"] if cfg.attention_bias else []):
        q = hf[f"model.layers.0.self_attn.q_proj.{suffix}"]
        k = hf[f"model.layers.0.self_attn.k_proj.{suffix}"]
        v = hf[f"model.layers.0.self_attn.v_proj.{suffix}"]
        for r in range(tp):
            shard = shard_for_tp(mg, tp, r, cfg)[f"decoder.layers.0.self_attention.linear_qkv.{suffix}"]
            expected = []
            for g in range(r * groups_per_rank, (r + 1) * groups_per_rank):
                q_rows = slice(g * q_per_group * d, (g + 1) * q_per_group * d)
                expected += [q[q_rows], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
            assert torch.equal(shard, torch.cat(expected)), (suffix, r)
    # Row-parallel linear_proj: rank r holds the o_proj input columns of its own query heads.
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    cols = cfg.num_heads * d // tp
    for r in range(tp):
        shard = shard_for_tp(mg, tp, r, cfg)["decoder.layers.0.self_attention.linear_proj.weight"]
        assert torch.equal(shard, o[:, r * cols : (r + 1) * cols])
    # Gated fc1: rank r holds [gate_r; up_r].
    i = cfg.intermediate_size // tp
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    for r in range(tp):
        fc1 = shard_for_tp(mg, tp, r, cfg)["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate[r * i : (r + 1) * i], up[r * i : (r + 1) * i]]))


def test_bad_inputs_raise() -> None:
    cfg = get_preset("tiny")
    mg = hf_to_megatron(random_hf_sd(cfg), cfg)
    with pytest.raises(ValueError, match="num_kv_heads"):
        shard_for_tp(mg, 4, 0, cfg)  # 2 kv heads over 4 ranks
    with pytest.raises(ValueError, match="tp_rank"):
        shard_for_tp(mg, 2, 2, cfg)
    with pytest.raises(ValueError, match="missing"):
        hf_to_megatron({k: v for k, v in random_hf_sd(cfg).items() if "q_norm" not in k}, cfg)
    with pytest.raises(ValueError, match="unconverted"):
        hf_to_megatron(random_hf_sd(cfg), dataclasses.replace(cfg, num_layers=1))
    with pytest.raises(ValueError, match="attention_bias"):
        hf_to_megatron({}, dataclasses.replace(get_preset("tiny-llama"), attention_bias=True))
    with pytest.raises(ValueError, match="layout"):
        hf_to_megatron(random_hf_sd(cfg), cfg, layout="nemo")
