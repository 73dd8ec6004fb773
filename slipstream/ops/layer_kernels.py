"""Triton kernels for the element-wise work between a rollout decoder layer's GEMMs, one launch each.

In a decode step each kernel moves little data (a few MB), so its cost is mostly the launch and the
tail: under torch.compile the work after the q/k/v projection ran as three kernels per layer (q norm
+ RoPE, k norm + RoPE + the cache write, the v cache write) and `silu(gate) * up` as one slow one.

- `qkv_heads`: the projection's output (T, (Hq + 2 Hkv) D) -> q (T, Hq, D) with the per-head RMSNorm
  (qwen3's q_norm) and RoPE; k (normed, rotated) and v written into the cache rows `write_index`.
  What `Attention.heads` and two `index_copy_` do, in one kernel: one program per token.
- `silu_mul`: the gate/up projection's output (T, 2I) -> silu(gate) * up (T, I).

Arithmetic in fp32, rounded to the activations' dtype on the store; the norm rounds its normalised
value before the weight as `RMSNorm` does. The compiled path fuses the same work without the
intermediate roundings of the eager modules, so both agree with the modules up to bf16 rounding.
The rollout's model runner uses them on CUDA with `rollout.layer_kernels` (the default: +1.7 points of
the bandwidth bound on nano-vllm's workload, first call, docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from slipstream.ops.decode_attention import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotated(base, rows, mask, d, D: tl.constexpr, w_ptr, eps, NORM: tl.constexpr, DTYPE: tl.constexpr):
        """x * cos-part and its rotate-half partner (-x[d + D/2] | x[d - D/2]) of `rows` heads at `base`, each
        normed first when NORM (fp32, the normalised value rounded to DTYPE before the weight)."""
        partner = (d + D // 2) % D
        x = tl.load(base + rows * D + d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + rows * D + partner, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
            x = (x * r).to(DTYPE).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)
            xp = (xp * r).to(DTYPE).to(tl.float32) * tl.load(w_ptr + partner).to(tl.float32)
        return x, tl.where(d < D // 2, -xp, xp)

    @triton.jit
    def _qkv_heads_kernel(
        QKV, QW, KW, Cos, Sin, WriteIndex, Q, KCache, VCache,
        stride_t, stride_ct, stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, eps,
        HQ: tl.constexpr, HKV: tl.constexpr, HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, D: tl.constexpr,
        NORM: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)[None, :]
        cos = tl.load(Cos + t * stride_ct + d).to(tl.float32)
        sin = tl.load(Sin + t * stride_ct + d).to(tl.float32)
        dtype = Q.dtype.element_ty
        base = QKV + t * stride_t
        hq = tl.arange(0, HQ_P2)[:, None]
        x, rot = _rotated(base, hq, hq < HQ, d, D, QW, eps, NORM, dtype)
        tl.store(Q + t * stride_qt + hq * stride_qh + d, (x * cos + rot * sin).to(dtype), mask=hq < HQ)
        row = tl.load(WriteIndex + t).to(tl.int64)  # cache offsets pass 2**31 on big caches
        hk = tl.arange(0, HKV_P2)[:, None]
        x, rot = _rotated(base + HQ * D, hk, hk < HKV, d, D, KW, eps, NORM, dtype)
        k_out = KCache + row * stride_kn + hk * stride_kh + d
        tl.store(k_out, (x * cos + rot * sin).to(KCache.dtype.element_ty), mask=hk < HKV)
        v = tl.load(base + (HQ + HKV) * D + hk * D + d, mask=hk < HKV, other=0.0)
        tl.store(VCache + row * stride_vn + hk * stride_vh + d, v, mask=hk < HKV)

    @triton.jit
    def _silu_mul_kernel(X, Out, stride_x, stride_o, I, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < I
        gate = tl.load(X + t * stride_x + j, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(X + t * stride_x + I + j, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + t * stride_o + j, (gate * tl.sigmoid(gate) * up).to(Out.dtype.element_ty), mask=ok)


def qkv_heads(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_index: torch.Tensor,
) -> torch.Tensor:
    """q (T, Hq, D) from the fused projection output qkv (T, (Hq + 2 Hkv) D): per-head q/k norms (weights (D,),
    or None for models without them) and RoPE (cos / sin (T, D)); k and v go to k_cache / v_cache (N, Hkv, D)
    at rows write_index (T,)."""
    if not available():
        raise RuntimeError("qkv_heads needs triton")
    tokens = qkv.shape[0]
    d = cos.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1 or d & (d - 1):
        raise ValueError(f"qkv_heads needs contiguous rows of (Hq + 2 Hkv) x D with a power-of-two D, got {tuple(qkv.shape)}")
    if cos.stride(-1) != 1 or cos.stride() != sin.stride() or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qkv_heads needs contiguous cos / sin rows and cache rows")
    norm = q_norm is not None
    q = torch.empty((tokens, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _qkv_heads_kernel[(tokens,)](
        qkv, q_norm if norm else cos, k_norm if norm else cos, cos, sin, write_index, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), eps,
        HQ=num_heads, HKV=num_kv_heads, HQ_P2=triton.next_power_of_2(num_heads),
        HKV_P2=triton.next_power_of_2(num_kv_heads), D=d, NORM=norm, num_warps=4,
    )  # fmt: skip
    return q


SILU_BLOCK = 1024
"""Entries of one row per program in `silu_mul`."""


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused gate/up projection output (T, 2I) -> (T, I)."""
    if not available():
        raise RuntimeError("silu_mul needs triton")
    tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul needs contiguous rows of an even width, got {tuple(gate_up.shape)}")
    out = torch.empty((tokens, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(width // 2, SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=SILU_BLOCK, num_warps=4
        )
    return out
