"""Megatron GPTModel vs the native model on one GPU: per-token log-prob parity, padded and THD.

Run: `pytest -q -s tests/gpu/test_megatron_gpu.py` (prints max / mean |diff| per case).
The padded [B, S] cases run with the local spec and, when installed, Transformer Engine;
the packed THD case (PackedSeqParams) needs TE: megatron-core 0.16's local DotProductAttention
asserts "Packed sequence is not supported by DotProductAttention".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

from slipstream.engine.distributed import destroy_distributed  # noqa: E402
from slipstream.engine.megatron import provider  # noqa: E402
from slipstream.models.hf import to_hf_state_dict  # noqa: E402
from slipstream.models.presets import get_preset  # noqa: E402
from slipstream.models.transformer import Transformer  # noqa: E402

QWEN2_SMALL = dataclasses.replace(get_preset("tiny"), family="qwen2", qk_norm=False, attention_bias=True)
CONFIGS = {"tiny": get_preset("tiny"), "tiny-llama": get_preset("tiny-llama"), "qwen2-bias": QWEN2_SMALL}
# (max, mean) |diff| bounds on per-token log-probs. fp32: same math, different kernels.
# bf16: both sides round activations to bf16 at different points (norms, attention kernels).
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (0.25, 0.03)}
SPECS = [False, pytest.param(True, marks=pytest.mark.skipif(not provider.te_available(), reason="no TE"))]


@pytest.fixture(scope="module")
def megatron_gpu():
    created_pg = not dist.is_initialized()
    torch.cuda.set_device(0)
    provider.init_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # attention forks this RNG state even with dropout 0
    yield
    parallel_state.destroy_model_parallel()
    if created_pg:
        destroy_distributed()


def models(cfg, dtype: torch.dtype, use_te: bool):
    """(native, megatron) on cuda in `dtype`, same random weights (norms random too)."""
    torch.manual_seed(0)
    native = Transformer(cfg)
    with torch.no_grad():
        for name, p in native.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf = to_hf_state_dict(native.state_dict())
    native = native.to("cuda", dtype).eval()
    mg = provider.build_gpt_model(cfg, dtype=dtype, use_te=use_te).cuda().eval()
    provider.load_hf_weights(mg, hf, cfg)
    return native, mg


def native_logprobs(native, ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """Packed (T,) -> (T, V) fp32 log-probs."""
    return native.logits(native(ids, pos, cu, max_len)).float().log_softmax(-1)


def report(tag: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    diff = (got - ref).abs()
    print(f"{tag}: max|diff|={diff.max().item():.3e} mean|diff|={diff.mean().item():.3e}")
    max_tol, mean_tol = TOLERANCE[dtype]
    assert diff.max() < max_tol and diff.mean() < mean_tol, tag


@pytest.mark.parametrize("use_te", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_logprob_parity(megatron_gpu, name: str, dtype: torch.dtype, use_te: bool) -> None:
    cfg = CONFIGS[name]
    native, mg = models(cfg, dtype, use_te)
    bsz, seq = 2, 64
    ids = torch.randint(3, cfg.vocab_size, (bsz, seq), device="cuda")
    with torch.no_grad():
        pos = torch.arange(seq, device="cuda")[None].expand(bsz, -1)
        # attention_mask=None: the causal mask of the layer spec (no padding in these rows).
        logits = mg(input_ids=ids, position_ids=pos, attention_mask=None)
        got = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        cu = torch.arange(0, bsz * seq + 1, seq, dtype=torch.int32, device="cuda")
        ref = native_logprobs(native, ids.reshape(-1), pos.reshape(-1), cu, seq).reshape(bsz, seq, -1)
        ref = ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    report(f"padded {name} {dtype} te={use_te}", got, ref, dtype)


@pytest.mark.skipif(not provider.te_available(), reason="THD packed attention needs Transformer Engine")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_thd_packed_logprob_parity(megatron_gpu, name: str) -> None:
    # bf16 only: TE's THD attention runs on its fused / flash kernels, which take no fp32.
    cfg, dtype = CONFIGS[name], torch.bfloat16
    native, mg = models(cfg, dtype, use_te=True)
    lens = [5, 23, 16, 9]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    total, max_len = int(cu[-1]), max(lens)
    ids = torch.randint(3, cfg.vocab_size, (total,), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    with torch.no_grad():
        logits = mg(input_ids=ids[None], position_ids=pos[None], attention_mask=None, packed_seq_params=params)
        got_all = logits[0].float().log_softmax(-1)
        ref_all = native_logprobs(native, ids, pos, cu, max_len)
    # Compare next-token log-probs within each sequence (the last position has no target).
    targets = torch.roll(ids, -1)
    within = torch.ones(total, dtype=torch.bool, device="cuda")
    within[cu[1:] - 1] = False
    got = got_all.gather(-1, targets[:, None]).squeeze(-1)[within]
    ref = ref_all.gather(-1, targets[:, None]).squeeze(-1)[within]
    report(f"thd {name} {dtype}", got, ref, dtype)
