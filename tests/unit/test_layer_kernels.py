"""The rollout's layer kernels (`ops/layer_kernels.py`) against the model's own modules.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1 with triton installed), and on CUDA
without it; skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer, rope_cos_sin, rope_inv_freq

_TRITON = importlib.util.find_spec("triton") is not None
_RUNS = _TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())
pytestmark = pytest.mark.skipif(not _RUNS, reason="needs triton, and CUDA or TRITON_INTERPRET=1")
_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

# GQA with q/k norms like qwen3 (6 query heads: not a power of two), and the same without the norms (llama)
_QWEN = dataclasses.replace(
    get_preset("qwen3-0.6b"), num_layers=1, hidden_size=64, intermediate_size=96, vocab_size=128,
    num_heads=6, num_kv_heads=2, head_dim=32,
)  # fmt: skip


def _tolerances(dtype: torch.dtype) -> dict:
    # fp32: the same arithmetic up to the order of the additions; bf16: the modules round after every op, the
    # kernel once
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
# (query heads, kv heads, head dim): power-of-two and other head counts, head dims 32 / 64 / 128, qwen3-8b's 32:8
@pytest.mark.parametrize("heads", [(6, 2, 32), (6, 3, 128), (12, 3, 64), (32, 8, 128)])
def test_qkv_heads_equals_the_attention_modules_and_the_cache_writes(heads, qk_norm, dtype):
    from slipstream.ops.layer_kernels import qkv_heads

    hq, hkv, d = heads
    cfg = dataclasses.replace(_QWEN, qk_norm=qk_norm, num_heads=hq, num_kv_heads=hkv, head_dim=d)
    model = Transformer(cfg)
    model.init_weights(0)
    attn = model.layers[0].self_attn.to(_DEVICE, dtype)
    if qk_norm:  # weights away from 1, so a wrong weight index shows
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    tokens = 5
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 2).to(_DEVICE, dtype)
    positions = torch.tensor([0, 3, 17, 200, 5], device=_DEVICE)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, _DEVICE), dtype)
    write_index = torch.tensor([9, 2, 30, 11, 0], device=_DEVICE)
    caches = [torch.randn(40, hkv, d, generator=g).to(_DEVICE, dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)

    with torch.no_grad():
        q_ref, k_ref, v_ref = attn.heads(*qkv.split([hq * d, hkv * d, hkv * d], dim=-1), cos, sin)
        want_k.index_copy_(0, write_index, k_ref)
        want_v.index_copy_(0, write_index, v_ref)
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if qk_norm else (None, None, 0.0)
        q = qkv_heads(qkv, hq, hkv, *norms, cos, sin, caches[0], caches[1], write_index)
    torch.testing.assert_close(q.float(), q_ref.float(), **_tolerances(dtype))
    torch.testing.assert_close(caches[0].float(), want_k.float(), **_tolerances(dtype))
    assert torch.equal(caches[1], want_v)  # v is copied, not computed
    untouched = [i for i in range(40) if i not in write_index.tolist()]
    assert torch.equal(caches[0][untouched], want_k[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_mlp_activation(dtype, monkeypatch):
    from slipstream.ops import layer_kernels

    monkeypatch.setattr(layer_kernels, "SILU_BLOCK", 64)  # a row over several programs, the last one partial
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(3, 2 * 150, generator=g) * 3).to(_DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate.float()) * up.float()).to(dtype)  # one rounding, as the kernel
    torch.testing.assert_close(layer_kernels.silu_mul(gate_up), want, **_tolerances(dtype))
    torch.testing.assert_close(layer_kernels.silu_mul(gate_up).float(), (F.silu(gate) * up).float(), atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError):
        layer_kernels.silu_mul(gate_up[:, :-1])


def test_rollout_with_the_layer_kernels_generates_what_the_modules_generate():
    # the model runner's kernel path (the q/k/v matmul + qkv_heads, the compiled halves around silu_mul, here
    # eager) through prefill, chunked prefill and decode, in fp32: the same tokens and log-probs
    import functools

    from slipstream.models.hf import iter_hf_weights
    from slipstream.rollout import model_runner
    from slipstream.rollout.base import SamplingParams
    from slipstream.rollout.builtin import BuiltinRollout

    model = Transformer(_QWEN)
    model.init_weights(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.uniform_(0.5, 1.5)  # peaked logits; norm weights away from 1

    def generate(kernels: bool):
        engine = BuiltinRollout(_QWEN, _DEVICE, torch.float32, max_batch_size=4, seed=0, prefill_tokens=16,
                                compile=False, cuda_graphs=False)  # fmt: skip
        engine.update_weights(iter_hf_weights(model), version=1)
        if kernels:
            runner = engine.runner
            runner._pre = model_runner._pre_attention_kernels
            runner._post = functools.partial(model_runner._post_attention_kernels, model_runner._attention_out,
                                             model_runner._mlp_out)  # fmt: skip
        prompts = [[1, 5, 9, 33, 2, 7, 7, 90, 11, 3, 4, 50, 60, 70, 80, 90, 100, 5, 6], [3, 4], [8, 8, 8]]
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, n=2), keys=[0, 1, 2])
        return [(s.response_ids, s.behav_logprobs) for group in out for s in group]

    want, got = generate(False), generate(True)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    diff = max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y))
    assert diff < 1e-4, diff
