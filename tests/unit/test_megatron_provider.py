"""megatron-core GPTModel provider: names match the converter, and log-probs match the native model.

megatron-core 0.16.1's local spec is written for CUDA; on a CPU-only torch its forward hits
three hard-coded CUDA calls. The CPU fixture below routes around them for the test only
(the GPU test in tests/gpu/test_megatron_gpu.py runs unpatched). Models are built with
use_cpu_initialization=True so the tests stay on the CPU on GPU machines too:
  1. RotaryEmbedding.get_emb moves inv_freq to `torch.cuda.current_device()`
     -> patched to return "cpu".
  2. get_default_causal_mask builds its mask with device="cuda"
     -> we pass an explicit causal `attention_mask` instead.
  3. DotProductAttention forks the CUDA RNG tracker around attention dropout
     ("cuda rng state model-parallel-rng is not added") -> a no-op tracker (dropout is 0).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from slipstream.engine.distributed import destroy_distributed  # noqa: E402
from slipstream.engine.megatron import provider  # noqa: E402
from slipstream.engine.megatron.convert import hf_to_megatron  # noqa: E402
from slipstream.models.hf import to_hf_state_dict  # noqa: E402
from slipstream.models.presets import get_preset  # noqa: E402
from slipstream.models.transformer import Transformer, rope_inv_freq  # noqa: E402

QWEN2_TINY = dataclasses.replace(get_preset("tiny"), family="qwen2", qk_norm=False, attention_bias=True)
CONFIGS = {"tiny": get_preset("tiny"), "tiny-llama": get_preset("tiny-llama"), "qwen2-bias": QWEN2_TINY}


class _NoForkTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def megatron_cpu():
    """1-process model parallel state, plus the CPU shims described in the module docstring."""
    created_pg = not dist.is_initialized()
    provider.init_model_parallel()  # before the patches: on a GPU machine this creates an NCCL group
    with pytest.MonkeyPatch.context() as mp:
        # Applied on GPU machines too: these tests keep everything on the CPU.
        import megatron.core.tensor_parallel as tensor_parallel

        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoForkTracker())
        yield
    parallel_state.destroy_model_parallel()
    if created_pg:
        destroy_distributed()


def build(cfg):
    """Local-spec fp32 GPTModel with its parameters on the CPU."""
    return provider.build_gpt_model(cfg, use_te=False, use_cpu_initialization=True)


def native_model(cfg, seed: int = 0) -> Transformer:
    """Native model with weights large enough that attention is far from uniform."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def per_token_logprobs(model, cfg, ids: torch.Tensor, megatron: bool) -> torch.Tensor:
    """(B, S) tokens, every row one full sequence -> (B, S-1) log-probs of the next token."""
    bsz, seq = ids.shape
    with torch.no_grad():
        if megatron:
            causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]  # True = masked
            pos = torch.arange(seq)[None].expand(bsz, -1)
            logits = model(ids, pos, attention_mask=causal)  # (B, S, V), TP=1 so the full vocab
        else:
            cu = torch.arange(0, bsz * seq + 1, seq, dtype=torch.int32)
            pos = torch.arange(seq).repeat(bsz)
            logits = model.logits(model(ids.reshape(-1), pos, cu, seq)).reshape(bsz, seq, -1)
    logp = logits.float().log_softmax(-1)[:, :-1]
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_names_match_converter(megatron_cpu, name: str) -> None:
    cfg = CONFIGS[name]
    model = build(cfg)
    names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    converted = hf_to_megatron(to_hf_state_dict(native_model(cfg).state_dict()), cfg, layout="local")
    assert names == set(converted)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k in names}
    assert shapes == {k: tuple(v.shape) for k, v in converted.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logprob_parity_fp32(megatron_cpu, name: str) -> None:
    cfg = CONFIGS[name]
    native = native_model(cfg)
    hf = to_hf_state_dict(native.state_dict())
    mg = build(cfg).eval()
    provider.load_hf_weights(mg, hf, cfg)
    back = provider.hf_state_dict(mg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)

    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = per_token_logprobs(native, cfg, ids, megatron=False)
    got = per_token_logprobs(mg, cfg, ids, megatron=True)
    diff = (got - ref).abs()
    assert diff.max() < 1e-5, f"max |diff| {diff.max():.3e}, mean {diff.mean():.3e}"

    # Negative control: swapping two query heads of layer 0 must change the log-probs,
    # otherwise the comparison above could not detect a wrong QKV layout.
    q = hf["model.layers.0.self_attn.q_proj.weight"].clone()
    d = cfg.head_dim
    q[:d], q[d : 2 * d] = q[d : 2 * d].clone(), q[:d].clone()
    provider.load_hf_weights(mg, {**hf, "model.layers.0.self_attn.q_proj.weight": q}, cfg)
    assert (per_token_logprobs(mg, cfg, ids, megatron=True) - ref).abs().max() > 1e-3


def test_rope_scaling_is_ours(megatron_cpu) -> None:
    """tiny-llama's llama3 scaling has non-Megatron constants; inv_freq must equal the native one."""
    cfg = get_preset("tiny-llama")
    mg = build(cfg)
    ours = rope_inv_freq(cfg)
    assert torch.equal(mg.rotary_pos_emb.inv_freq.cpu(), ours)
    assert not torch.equal(ours, rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)))
    # The published llama3.2 constants go through Megatron's own rope_scaling: same frequencies.
    real = dataclasses.replace(cfg, rope_scaling=dict(get_preset("llama3.2-1b").rope_scaling))
    mg_real = build(real)
    torch.testing.assert_close(
        # exact: measured 0 (the same float64 formula)
        mg_real.rotary_pos_emb.inv_freq.double().cpu(), rope_inv_freq(real).double(), rtol=0, atol=0
    )


def test_bad_config_raises(megatron_cpu) -> None:
    with pytest.raises(ValueError, match="attention_bias"):
        build(dataclasses.replace(get_preset("tiny-llama"), attention_bias=True))


@pytest.mark.parametrize("marked_by_megatron", [False, True])
def test_tensor_parallel_flags_are_set_once(megatron_cpu, marked_by_megatron: bool) -> None:
    """Without megatron's weight init, megatron-core 0.16 leaves the sharded weights unflagged and 0.19 flags
    them at construction (its setter then asserts that nothing was set before): the engine flags only what
    is unflagged, so it builds under both."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from slipstream.engine.megatron.engine import _mark_tensor_parallel

    gpt = provider.build_gpt_model(CONFIGS["tiny"], use_te=False, use_cpu_initialization=True,
                                   perform_initialization=False)  # fmt: skip
    sharded = {m.weight: 1 if isinstance(m, RowParallelLinear) else 0 for m in gpt.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and m.weight is not None}  # fmt: skip
    assert sharded
    for weight, dim in sharded.items():
        if marked_by_megatron and not hasattr(weight, "tensor_model_parallel"):  # what 0.19 does at construction
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
    _mark_tensor_parallel(gpt)
    for weight, dim in sharded.items():
        assert weight.tensor_model_parallel and weight.partition_dim == dim  # (0.19 gives the fused fc1 stride 2)
