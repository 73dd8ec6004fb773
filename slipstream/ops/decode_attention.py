"""Decode attention over the slot cache in Triton: one query token per sequence, GQA-packed, split-K.

Decoding is memory-bound: a step must read every live sequence's keys and values once. The
kernel reads each kv head's cache rows exactly once for all the query heads that share it (the
GQA group, padded to a 16-row matrix tile), and splits each sequence's context into
`num_splits` ranges handled by separate programs, so that a small batch still spreads over every
SM. Each program keeps an online softmax (running max m, sum l, weighted values acc) over its
range; a second kernel merges the splits:

    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,    M = max_s m_s

Inputs (the same layout as `ops/attention.py:cache_attention`): q (B, Hq, D); k_cache, v_cache
(N, Hkv, D) with sequence b's keys at rows starts[b] .. starts[b] + lengths[b]. Output (B, Hq, D)
in q's dtype. The split count is a compile-time constant and the split length is computed from
each sequence's own length inside the kernel, so a captured CUDA graph stays valid as the
lengths grow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from slipstream.ops.decode_launch import LAUNCH, LAUNCH_FORMAT, launch_text, parse_launch  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: cache_attention falls back to SDPA
    triton = None

def available() -> bool:
    return triton is not None


PROGRAMS_PER_SM = 8
"""Default split programs per SM that `choose_splits` aims for (a batch with more (sequence, kv head) pairs than
that runs one split). 8 rather than 2: nano-vllm's workload on the H200 ran 1.5% faster (its shrinking batches
below ~130 rows get more splits; docs/benchmarks.md). An engine's own value is `rollout.decode_programs_per_sm`
(`bench_decode_attention.py` sweeps the split count)."""


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H100/H200's 132 elsewhere (the interpreter, CPU tests)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def launch_order(lengths: torch.Tensor, launch: Mapping[str, int] = LAUNCH) -> torch.Tensor | None:
    """The sequences by decreasing length (B,) int32 when `launch` asks for longest first, else None (launch
    order). One per decode step: every layer's launch reads it."""
    if not launch["longest_first"]:
        return None
    return torch.argsort(lengths, descending=True).to(torch.int32)


def choose_splits(batch: int, kv_heads: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Enough programs to give every SM about `programs_per_sm`, at most 16 splits of a sequence."""
    sms = sm_count(device)
    return max(1, min(16, math.ceil(programs_per_sm * sms / max(1, batch * kv_heads))))


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q, K, V, Starts, Lengths, Order, Acc, ML, Out,
        stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
        stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
        scale,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr, ORDERED: tl.constexpr,
    ):  # fmt: skip
        if HEADS_FIRST:
            h = tl.program_id(0)
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            h = tl.program_id(1)
        if ORDERED:  # the b-th program of the launch order works on sequence Order[b]
            b = tl.load(Order + b)
        s = tl.program_id(2)
        start = tl.load(Starts + b).to(tl.int64)
        length = tl.load(Lengths + b)
        # this split's rows: a multiple of BLOCK_N, from the sequence's own length
        per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = s * per_split
        hi = tl.minimum(lo + per_split, length)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        heads = h * GROUP + g
        in_group = g < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < hi
            rows = start + n
            k = tl.load(K + rows[:, None] * stride_kn + h * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_G, BLOCK_N), fp32 accumulation
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + rows[:, None] * stride_vn + h * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if NUM_SPLITS == 1:  # the whole sequence in this program: normalise and write the output directly
            out = acc / l_i[:, None]
            out_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=in_group[:, None])
            return
        # an empty split (short sequence) leaves m = -inf, l = 0, acc = 0: weight 0 in the merge
        acc_ptr = Acc + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + d[None, :]
        tl.store(acc_ptr, acc, mask=in_group[:, None])
        ml_ptr = ML + b * stride_mb + heads * stride_mh + s * 2
        tl.store(ml_ptr, m_i, mask=in_group)
        tl.store(ml_ptr + 1, l_i, mask=in_group)

    @triton.jit
    def _merge_kernel(
        Acc, ML, Out, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
        D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, D)
        used = s < NUM_SPLITS
        ml = ML + b * stride_mb + h * stride_mh + s * 2
        m = tl.load(ml, mask=used, other=float("-inf"))
        l = tl.load(ml + 1, mask=used, other=0.0)  # noqa: E741
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        acc = tl.load(Acc + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    num_splits: int,
    scale: float | None = None,
    order: torch.Tensor | None = None,
    launch: Mapping[str, int] = LAUNCH,
) -> torch.Tensor:
    """Attention of one query per sequence over its cache rows: q (B, Hq, D) -> (B, Hq, D). `order` (B,) int32 is
    `launch_order(lengths, launch)`, computed here when `launch` asks for it and the caller has none."""
    if triton is None:
        raise RuntimeError("decode_attention needs triton")
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv or d & (d - 1) or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"decode_attention needs Hq % Hkv == 0, a power-of-two head dim and contiguous rows (got {q.shape})")
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    # one split: the split kernel writes `out` itself and the workspaces are never touched
    acc = torch.empty((bsz, hq, num_splits, d) if num_splits > 1 else (1, 1, 1, 1), dtype=torch.float32, device=q.device)
    ml = torch.empty((bsz, hq, num_splits, 2) if num_splits > 1 else (1, 1, 1, 2), dtype=torch.float32, device=q.device)
    heads_first = bool(launch["heads_first"])
    if order is None:
        order = launch_order(lengths, launch)
    elif order.shape != (bsz,):
        raise ValueError(f"order must hold one index per sequence ({bsz}), got {tuple(order.shape)}")
    _split_kernel[(hkv, bsz, num_splits) if heads_first else (bsz, hkv, num_splits)](
        q, k_cache, v_cache, starts, lengths, lengths if order is None else order, acc, ml, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), out.stride(0), out.stride(1),
        scale,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=launch["block_n"], D=d,
        NUM_SPLITS=num_splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEADS_FIRST=heads_first,
        ORDERED=order is not None,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )  # fmt: skip
    if num_splits == 1:
        return out
    _merge_kernel[(bsz, hq)](
        acc, ml, out, acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
        out.stride(0), out.stride(1), D=d, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out
