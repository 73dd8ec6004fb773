"""Fused LM head -> per-token log-prob (and entropy) without a (T, V) fp32 logits tensor.

For hidden states h (T, H), LM-head weight W (V, H) and a temperature tau:

    z       = h @ W.T / tau                      logits, (T, V)
    lse     = logsumexp(z)                       (T,)
    logprob = z[target] - lse                    (T,)
    entropy = lse - sum_v softmax(z)_v * z_v     (T,)

The (T, V) logits of a long packed batch are the largest activation of an RL step
(65k tokens x 152k vocab x 4 bytes = 40 GB), so they are never built. The forward walks
(row chunk x vocab tile) tiles of z, keeping per-row running statistics (max, sum of exp,
and for entropy the softmax-weighted logit sum); only lse and entropy (T,) are saved.
The backward recomputes each tile of z and applies, with p = softmax(z):

    d logprob / d z = onehot(target) - p
    d entropy / d z = -p * (z - sum_v p_v z_v)

then chains through z = h W^T / tau: grad_h = (g_z @ W) / tau, grad_W = (g_z^T @ h) / tau.

Two implementations share the autograd function: "torch" (chunked, any device) and
"triton" (CUDA; a fused matmul + online-logsumexp forward kernel and a fused gradient
kernel in the backward, see `logprobs_triton.py`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_FP32 = torch.float32

# Working memory for one (rows x vocab) tile. About three fp32 copies of the tile are alive
# at once (logits, exp / probabilities, gradient), hence the divisor in `choose_tile_sizes`.
DEFAULT_WORKSPACE_BYTES = 256 * 2**20
_TILE_COPIES = 3
DEFAULT_VOCAB_CHUNK = 16384
_IMPLS = ("auto", "torch", "triton")


def choose_tile_sizes(
    num_tokens: int,
    vocab_size: int,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> tuple[int, int]:
    """Rows per chunk and vocab entries per tile so that one fp32 tile fits `workspace_bytes`."""
    cols = vocab_chunk_size if vocab_chunk_size is not None else min(vocab_size, DEFAULT_VOCAB_CHUNK)
    cols = max(1, min(cols, vocab_size))
    if chunk_size is None:
        rows = workspace_bytes // (cols * 4 * _TILE_COPIES)
        # multiples of 64 keep the matmul tiles aligned on GPUs
        rows = max(64, rows // 64 * 64)
    else:
        rows = chunk_size
    return max(1, min(rows, num_tokens)), cols


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    impl: str = "auto",
    vocab_chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` (and entropy) under softmax(hidden @ weight.T / temperature), chunked.

    hidden (T, H) and weight (V, H) share a float dtype and device; targets (T,) int64 in [0, V)
    (an out-of-range target yields NaN rather than a silent wrong value). Returns fp32
    `logprobs` (T,) and `entropy` (T,) or None. Differentiable w.r.t. hidden and weight.
    `chunk_size` rows and `vocab_chunk_size` vocab entries per tile; None picks them from a
    256 MiB workspace (the triton forward stores no tiles and tiles only its backward).
    impl: "torch", "triton" (CUDA) or "auto" (triton on CUDA when importable).
    """
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be (T, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}"
            " (flatten batch and sequence dims first)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 token ids, got {targets.dtype}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must share a float dtype, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError("hidden, weight and targets must be on the same device")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    if vocab_chunk_size is not None and vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be positive, got {vocab_chunk_size}")
    impl = _resolve_impl(impl, hidden.device)

    rows, cols = choose_tile_sizes(hidden.shape[0], weight.shape[0], chunk_size, vocab_chunk_size)
    logprobs, entropy = _LinearLogprobs.apply(
        hidden, weight, targets, 1.0 / float(temperature), bool(with_entropy), rows, cols, impl
    )
    return logprobs, (entropy if with_entropy else None)


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if impl == "triton":
        if not _triton_available():
            raise ValueError("impl='triton' needs the triton package; use impl='torch'")
        if device.type != "cuda" and not interpret:
            raise ValueError(f"impl='triton' runs on CUDA tensors (or with TRITON_INTERPRET=1), got {device}")
    return impl


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _cuda_mm_out_dtype_ok() -> bool:
    # torch.mm(..., out_dtype=float32) returns the fp32 accumulator of a bf16 GEMM without
    # rounding it to bf16 first. Probed once because backends differ across torch versions.
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=_FP32).dtype == _FP32
    except (RuntimeError, TypeError):
        return False


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32; low-precision inputs multiply in their dtype with fp32 accumulation."""
    if a.dtype == _FP32:
        return a @ b
    if not a.is_cuda:
        # CPUs have no low-precision matmul units to save: upcasting the (small) operands
        # gives the same fp32-accumulated product without rounding it to bf16.
        return a.float() @ b.float()
    if _cuda_mm_out_dtype_ok():
        return torch.mm(a, b, out_dtype=_FP32)
    return (a @ b).float()


@functools.cache
def _cuda_addmm_out_dtype_ok() -> bool:
    # torch.addmm(acc, a, b, out_dtype=float32, out=acc) accumulates a bf16 GEMM into an fp32
    # buffer inside the GEMM epilogue (no product temporary, no separate add pass).
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        acc = torch.ones(16, 16, dtype=_FP32, device="cuda")
        torch.addmm(acc, a, a, out_dtype=_FP32, out=acc)
        return bool((acc == 17.0).all())
    except (RuntimeError, TypeError):
        return False


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32, in place; low-precision a, b accumulate in fp32 inside the GEMM."""
    if a.dtype == _FP32:
        acc.addmm_(a, b)
    elif a.is_cuda and _cuda_addmm_out_dtype_ok():
        torch.addmm(acc, a, b, out_dtype=_FP32, out=acc)
    else:
        acc.add_(mm_fp32(a, b))


def _logits_fp32(h: torch.Tensor, w: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """One fresh fp32 tile of logits h @ w.T / tau (safe to modify in place)."""
    z = mm_fp32(h, w.T)
    # at temperature 1 the scaling would be a full read + write of the fp32 tile for nothing
    return z if inv_temp == 1.0 else z.mul_(inv_temp)


def _torch_forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    rows: int,
    cols: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (target logit, lse, entropy-or-None) via online logsumexp over vocab tiles."""
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    target_logit = hidden.new_full((num_tokens,), float("nan"), dtype=_FP32)
    lse = hidden.new_empty(num_tokens, dtype=_FP32)
    entropy = hidden.new_empty(num_tokens, dtype=_FP32) if with_entropy else None
    for r0 in range(0, num_tokens, rows):
        h_c, y_c = hidden[r0 : r0 + rows], targets[r0 : r0 + rows]
        # Running stats per row, relative to the running max m:
        #   s = sum_v exp(z_v - m),  a = sum_v exp(z_v - m) * (z_v - m)
        # so that lse = m + log s and sum_v p_v z_v = m + a / s. Keeping a relative to m
        # avoids the cancellation of lse - sum(p z) when logits are large.
        m = s = a = None
        zy = target_logit[r0 : r0 + rows]
        for v0 in range(0, vocab, cols):
            z = _logits_fp32(h_c, weight[v0 : v0 + cols], inv_temp)
            in_tile = (y_c >= v0) & (y_c < v0 + z.shape[1])
            idx = (y_c - v0).clamp(0, z.shape[1] - 1).unsqueeze(1)
            zy.copy_(torch.where(in_tile, z.gather(1, idx).squeeze(1), zy))

            tile_max = z.amax(dim=1)
            m_new = tile_max if m is None else torch.maximum(m, tile_max)
            zs = z.sub_(m_new.unsqueeze(1))  # shifted logits, <= 0
            e = zs.exp()
            tile_a = (e * zs).sum(dim=1) if with_entropy else None
            if m is None:
                s, a = e.sum(dim=1), tile_a
            else:
                scale = torch.exp(m - m_new)
                if with_entropy:
                    a = scale * (a + s * (m - m_new)) + tile_a
                s = s * scale + e.sum(dim=1)
            m = m_new
        log_s = s.log()
        lse[r0 : r0 + rows] = m + log_s
        if with_entropy:
            entropy[r0 : r0 + rows] = log_s - a / s
    return target_logit, lse, entropy


def _torch_grad_logits(
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
    """d loss / d (h W^T) for one fp32 logits tile z (rows x cols), consumed in place."""
    logp = z.sub_(lse.unsqueeze(1))
    p = logp.exp()
    # g_z = g_lp * (onehot - p) - g_ent * p * (z - sum p z); with z - sum(p z) = logp + entropy
    # both terms share the factor -p, so build the row coefficient first.
    if g_ent is not None:
        coef = logp.add_(entropy.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
        if g_lp is not None:
            coef.add_(g_lp.unsqueeze(1))
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
    if g_lp is not None:
        in_tile = (targets >= v0) & (targets < v0 + z.shape[1])
        idx = (targets - v0).clamp(0, z.shape[1] - 1).unsqueeze(1)
        grad.scatter_add_(1, idx, torch.where(in_tile, g_lp, 0.0).unsqueeze(1))
    # chain rule through the 1/tau of z = h W^T / tau
    return grad.mul_(inv_temp).to(out_dtype)


def _backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    rows, cols, inv_temp = ctx.rows, ctx.cols, ctx.inv_temp
    if ctx.impl == "triton":
        from slipstream.ops.logprobs_triton import triton_grad_logits as grad_logits
    else:
        grad_logits = _torch_grad_logits
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    g_lp = g_lp.float() if g_lp is not None else None
    g_ent = g_ent.float() if g_ent is not None else None

    def tile_grad(r0: int, v0: int) -> torch.Tensor:
        r1 = r0 + rows
        z = _logits_fp32(hidden[r0:r1], weight[v0 : v0 + cols], inv_temp)
        pick = lambda t: None if t is None else t[r0:r1]  # noqa: E731
        return grad_logits(
            z, lse[r0:r1], pick(entropy), pick(g_lp), pick(g_ent), targets[r0:r1], v0, inv_temp, hidden.dtype
        )

    # One gradient is finished tile by tile (its fp32 accumulator is one tile of rows), the
    # other accumulates over the whole outer loop in a full-size fp32 buffer. Loop so that
    # the full-size buffer is the smaller one: (T, H) when T <= V, else (V, H).
    grad_h = grad_w = None
    if num_tokens <= vocab:
        acc_h = torch.zeros(hidden.shape, dtype=_FP32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for v0 in range(0, vocab, cols):
            w_v = weight[v0 : v0 + cols]
            acc_w = torch.zeros(w_v.shape, dtype=_FP32, device=w_v.device) if need_w else None
            for r0 in range(0, num_tokens, rows):
                g = tile_grad(r0, v0)
                if need_h:
                    addmm_fp32(acc_h[r0 : r0 + rows], g, w_v)
                if need_w:
                    addmm_fp32(acc_w, g.T, hidden[r0 : r0 + rows])
            if need_w:
                grad_w[v0 : v0 + cols] = acc_w
        grad_h = acc_h.to(hidden.dtype) if need_h else None
    else:
        acc_w = torch.zeros(weight.shape, dtype=_FP32, device=weight.device) if need_w else None
        grad_h = torch.empty_like(hidden) if need_h else None
        for r0 in range(0, num_tokens, rows):
            h_c = hidden[r0 : r0 + rows]
            acc_h = torch.zeros(h_c.shape, dtype=_FP32, device=h_c.device) if need_h else None
            for v0 in range(0, vocab, cols):
                g = tile_grad(r0, v0)
                if need_h:
                    addmm_fp32(acc_h, g, weight[v0 : v0 + cols])
                if need_w:
                    addmm_fp32(acc_w[v0 : v0 + cols], g.T, h_c)
            if need_h:
                grad_h[r0 : r0 + rows] = acc_h
        grad_w = acc_w.to(weight.dtype) if need_w else None
    return grad_h, grad_w


class _LinearLogprobs(torch.autograd.Function):
    """Autograd wrapper: saves only inputs and per-row stats, recomputes logits in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, rows, cols, impl):
        if impl == "triton":
            from slipstream.ops.logprobs_triton import triton_forward_stats

            target_logit, lse, entropy = triton_forward_stats(hidden, weight, targets, inv_temp, with_entropy)
        else:
            target_logit, lse, entropy = _torch_forward_stats(
                hidden, weight, targets, inv_temp, with_entropy, rows, cols
            )
        # Mathematically logprob <= 0 and entropy >= 0; clamp away rounding that crosses the
        # bound. The backward uses the unclamped formulas (the bounds are never truly active).
        logprobs = (target_logit - lse).clamp_(max=0.0)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temp, ctx.rows, ctx.cols, ctx.impl = inv_temp, rows, cols, impl
        ctx.set_materialize_grads(False)
        if entropy is None:
            out_entropy = lse.new_empty(0)
            ctx.mark_non_differentiable(out_entropy)
        else:
            out_entropy = entropy.clamp(min=0.0)
        return logprobs, out_entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        if ctx.saved_tensors[4] is None:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None,) * 8
        grad_h, grad_w = _backward(ctx, g_lp, g_ent)
        return grad_h, grad_w, None, None, None, None, None, None
