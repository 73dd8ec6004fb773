"""Triton kernels for `linear_logprobs` (imported lazily; needs CUDA or TRITON_INTERPRET=1).

Forward: one kernel fuses the LM-head matmul with an online logsumexp. Each program owns a
block of rows and one slice of the vocabulary; it walks that slice tile by tile, computes the
(BLOCK_M x BLOCK_N) logits with `tl.dot` in fp32 registers, folds them into running
(max, sum exp, sum exp * shifted logit, target logit) and drops them. Logits never reach
global memory. Splitting the vocabulary across programs keeps the GPU full when there are
few rows; the (num_splits, T) partial stats are merged on the host (tiny tensors).

Backward: the logits tile is recomputed with cuBLAS, and one elementwise kernel turns it
into the low-precision gradient d loss / d (h W^T) (softmax, entropy term, one-hot, 1/tau),
replacing about eight separate torch passes over the tile; cuBLAS then applies the two
gradient matmuls (see `_backward` in logprobs.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_FP32 = torch.float32
# Finite stand-in for -inf: keeps 0 * (masked - max) at 0 instead of NaN in the online update.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _fwd_stats_kernel(
    h_ptr, w_ptr, y_ptr, part_ptr,
    num_tokens, vocab, hidden_size,
    stride_ht, stride_hk, stride_wv, stride_wk,
    inv_temp, cols_per_split,
    WITH_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)

    # running stats per row, relative to the running max m (see _torch_forward_stats)
    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    a = tl.zeros([BLOCK_M], tl.float32)
    zy = tl.full([BLOCK_M], float("-inf"), tl.float32)

    v_start = split * cols_per_split
    v_end = tl.minimum(v_start + cols_per_split, vocab)
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_ht
    for n0 in range(v_start, v_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < v_end
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wv
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            ks = k0 + offs_k
            k_ok = ks < hidden_size
            hb = tl.load(h_rows + ks[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wb = tl.load(w_rows + ks[None, :] * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter cannot tl.dot bf16 (stored as uint16 there)
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            acc = tl.dot(hb, tl.trans(wb), acc, input_precision=DOT_PRECISION)
        z = tl.where(col_ok[None, :], acc * inv_temp, _NEG_BIG)

        hit = cols[None, :] == y[:, None]
        found = tl.sum(hit.to(tl.int32), axis=1) > 0
        zy = tl.where(found, tl.sum(tl.where(hit, z, 0.0), axis=1), zy)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        zs = z - m_new[:, None]
        e = tl.exp(zs)
        if WITH_ENTROPY:
            a = scale * (a + s * (m - m_new)) + tl.sum(e * zs, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new

    # partials laid out as (4, num_splits, T): m, s, a, target logit
    out = split.to(tl.int64) * num_tokens + rows
    plane = tl.num_programs(1).to(tl.int64) * num_tokens
    tl.store(part_ptr + out, m, mask=row_ok)
    tl.store(part_ptr + plane + out, s, mask=row_ok)
    tl.store(part_ptr + 2 * plane + out, a, mask=row_ok)
    tl.store(part_ptr + 3 * plane + out, zy, mask=row_ok)


@triton.jit
def _grad_logits_kernel(
    z_ptr, g_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, y_ptr,
    num_cols, v0, inv_temp,
    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < num_cols
    offs = row.to(tl.int64) * num_cols + cols
    z = tl.load(z_ptr + offs, mask=ok, other=0.0)
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    # g_z = g_lp * (onehot - p) - g_ent * p * (logp + entropy)   [z - sum(p z) = logp + entropy]
    coef = tl.zeros([BLOCK], tl.float32)
    if HAS_ENT:
        coef += tl.load(gent_ptr + row) * (logp + tl.load(ent_ptr + row))
    if HAS_LP:
        g_lp = tl.load(glp_ptr + row)
        coef += g_lp
    g = -p * coef
    if HAS_LP:
        g = tl.where(cols + v0 == tl.load(y_ptr + row), g + g_lp, g)
    tl.store(g_ptr + offs, (g * inv_temp).to(g_ptr.dtype.element_ty), mask=ok)


# Tile shapes tried once per (hidden size, vocab, entropy) by triton.autotune on the first
# call; the fixed 128 x 128 x 64 launch measured ~345 TFLOP/s on an H200 at 32k tokens x
# 151,936 x 2048 (cuBLAS reaches ~740 on the model's own GEMMs).
_TUNE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm, bn, bk, w, st in (
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 128, 8, 3),
        (64, 256, 64, 4, 4),
        (128, 256, 32, 8, 4),
    )
]
_fwd_stats_tuned = triton.autotune(configs=_TUNE_CONFIGS, key=["hidden_size", "vocab", "WITH_ENTROPY"])(
    _fwd_stats_kernel
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (target logit, lse, entropy-or-None) from the fused matmul + online-softmax kernel.

    `num_splits` (vocab slices per row block) is chosen to fill the GPU when None.
    """
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    interpret = _interpreting()
    # bf16 / fp16 on a GPU with no tile sizes asked for: the autotuned launch (see _TUNE_CONFIGS)
    tuned = not interpret and block_m is None and block_n is None and block_k is None
    if interpret:  # small tiles: the interpreter runs them with numpy
        block_m, block_n, block_k = block_m or 16, block_n or 32, block_k or 16
        target_programs = 1
    else:
        block_m, block_n, block_k = block_m or 128, block_n or 128, block_k or 64
        target_programs = 4 * torch.cuda.get_device_properties(hidden.device).multi_processor_count
    row_blocks = triton.cdiv(max(num_tokens, 1), block_m)
    # Enough vocab splits for ~4 programs per SM; every split gets at least one full tile.
    if num_splits is None:
        num_splits = triton.cdiv(target_programs, row_blocks)
    # split boundaries on multiples of the widest tile any launch may use
    unit = max(block_n, 256) if tuned else block_n
    num_splits = max(1, min(num_splits, triton.cdiv(vocab, unit)))
    cols_per_split = triton.cdiv(triton.cdiv(vocab, num_splits), unit) * unit
    num_splits = triton.cdiv(vocab, cols_per_split)

    part = torch.empty(4, num_splits, num_tokens, dtype=_FP32, device=hidden.device)
    if num_tokens > 0:
        fp32_in = hidden.dtype == _FP32
        args = (
            hidden, weight, targets, part,
            num_tokens, vocab, hidden_size,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            float(inv_temp), cols_per_split,
        )  # fmt: skip
        # fp32 inputs: exact fp32 products, not TF32, to match the torch path
        flags = dict(DOT_PRECISION="ieee" if fp32_in or interpret else "tf32", UPCAST=interpret and not fp32_in)
        if tuned and not fp32_in:
            grid = lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_M"]), num_splits)  # noqa: E731
            _fwd_stats_tuned[grid](*args, WITH_ENTROPY=with_entropy, **flags)
        else:
            _fwd_stats_kernel[(row_blocks, num_splits)](
                *args, WITH_ENTROPY=with_entropy, **flags,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=8, num_stages=2 if fp32_in else 3,
            )  # fmt: skip
    m_p, s_p, a_p, zy_p = part.unbind(0)
    # merge the vocab splits: rescale each split's sums to the global max
    m = m_p.amax(dim=0)
    scale = torch.exp(m_p - m)
    s = (s_p * scale).sum(dim=0)
    log_s = s.log()
    lse = m + log_s
    zy = zy_p.amax(dim=0)
    # a target outside [0, V) was found in no split: NaN, as in the torch path
    zy = torch.where(torch.isneginf(zy), torch.full_like(zy, float("nan")), zy)
    entropy = None
    if with_entropy:
        a = (scale * (a_p + s_p * (m_p - m))).sum(dim=0)
        entropy = log_s - a / s
    return zy, lse, entropy


def triton_grad_logits(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    targets: torch.Tensor,
    v0: int,
    inv_temp: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """d loss / d (h W^T) for one fp32 logits tile z (rows x cols), in `out_dtype`."""
    assert z.dtype == _FP32 and z.is_contiguous()
    rows, cols = z.shape
    grad = torch.empty(rows, cols, dtype=out_dtype, device=z.device)
    if rows == 0:
        return grad
    block = 64 if _interpreting() else 1024
    dummy = lse  # placeholder pointer for inputs a constexpr flag switches off
    _grad_logits_kernel[(rows, triton.cdiv(cols, block))](
        z, grad, lse,
        entropy.contiguous() if entropy is not None else dummy,
        g_lp.contiguous() if g_lp is not None else dummy,
        g_ent.contiguous() if g_ent is not None else dummy,
        targets.contiguous(),
        cols, v0, float(inv_temp),
        HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, BLOCK=block,
        num_warps=4,
    )
    return grad
