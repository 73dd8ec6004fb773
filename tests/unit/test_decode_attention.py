"""The Triton decode-attention kernel against per-sequence SDPA over the same cache rows.

Runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1 with triton installed), and on
CUDA without it; skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slipstream.ops.attention import cache_attention

_TRITON = importlib.util.find_spec("triton") is not None
_RUNS = _TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())
pytestmark = pytest.mark.skipif(not _RUNS, reason="needs triton, and CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("heads_first,longest_first", [(0, 0), (1, 0), (1, 1), (0, 1)])
@pytest.mark.parametrize("group,head_dim,splits", [(2, 128, 1), (2, 128, 3), (3, 64, 4), (1, 64, 2)])
def test_decode_attention_matches_sdpa(group, head_dim, splits, heads_first, longest_first):
    from slipstream.ops.decode_attention import LAUNCH, decode_attention

    # both grid orders and both sequence orders
    launch = {**LAUNCH, "heads_first": heads_first, "longest_first": longest_first}

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    g = torch.Generator().manual_seed(group * 100 + splits)
    slot_len, hkv, num_slots = 160, 2, 5
    hq = hkv * group
    k = torch.randn(num_slots * slot_len, hkv, head_dim, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(4, hq, head_dim, generator=g)
    slots, lengths = [3, 0, 4, 1], [1, 97, 160, 64]  # slots out of order; one 1-token sequence
    starts = torch.tensor([s * slot_len for s in slots], dtype=torch.int32)
    used = torch.tensor(lengths, dtype=torch.int32)
    cu_q = torch.arange(5, dtype=torch.int32)
    ref = cache_attention(q, k, v, cu_q, torch.cat([starts, torch.tensor([0], dtype=torch.int32)]), used, 1, slot_len,
                          causal=False)  # fmt: skip
    # the interpreter computes in fp32; on CUDA the kernel runs as in the rollout, in bf16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    to = lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device)  # noqa: E731
    out = decode_attention(to(q), to(k), to(v), to(starts), to(used), num_splits=splits, launch=launch)
    # interpreter (fp32): measured max |err| 3e-7; CUDA bf16 inputs and output: ~1e-2 expected (as FlashAttention)
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2 if device == "cuda" else 1e-5, rtol=0)
    if device == "cuda":  # fp32 on CUDA (a float32 rollout): exact products (no TF32), as tight as the interpreter
        exact = decode_attention(*(t.to(device) for t in (q, k, v, starts, used)), num_splits=splits, launch=launch)
        torch.testing.assert_close(exact.cpu(), ref, atol=1e-5, rtol=0)
