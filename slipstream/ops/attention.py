"""Attention dispatch: packed variable-length causal attention and padded/cached attention.

Packed layout (training and log-prob passes): q (T, Hq, D), k/v (T, Hkv, D) hold several
sequences back to back; `cu_seqlens` (n+1,) int32 marks where each starts. A token may only
attend to earlier tokens of its own sequence.

Backends, chosen per call by `select_backend` (flex only when named):
  "varlen" torch.nn.attention.varlen.varlen_attn (FlashAttention, CUDA, fp16/bf16, torch>=2.10)
  "flex"   flex_attention with a document-causal block mask (CUDA, any float dtype; compiled)
  "sdpa"   F.scaled_dot_product_attention, one call with a document-causal mask per group of
           consecutive sequences (`sdpa_varlen_attention`): the reference path, and float32's
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from functools import lru_cache

import torch
import torch.nn.functional as F

from slipstream.ops import decode_attention

BACKENDS = ("varlen", "flex", "sdpa")


@lru_cache(maxsize=1)
def _varlen_fn():
    """Return (varlen_attn, accepted keyword names) or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@lru_cache(maxsize=1)
def _flex_fns():
    """Return (compiled flex_attention, create_block_mask) or None when unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    # Uncompiled flex attention materialises the full score matrix; compiling is what
    # turns it into a fused kernel that skips masked blocks.
    return torch.compile(flex_attention), create_block_mask


def select_backend(q: torch.Tensor) -> str:
    """FlashAttention varlen for fp16 / bf16 on CUDA; SDPA otherwise (float32 anywhere, the CPU).

    float32 on CUDA takes SDPA rather than flex: flex compiles its kernels at the first call and
    again at the first new length, which cost the first training step 18 s (the demo) and 59 s
    (SmolLM2, 4k tokens) on the H200, and a SmolLM2 run on that path stalled in its first step (not
    isolated: docs/results/2026-12-04-h200-smollm2-rg-stalled.log). flex stays available by name,
    and inside a compiled region (actor.compile), where the SDPA path's host-side sequence bounds
    would break the graph at every layer and recompile for every batch.
    """
    return kernel_for(q.device, q.dtype, compiled=torch.compiler.is_compiling())


def kernel_for(device: torch.device, dtype: torch.dtype, compiled: bool) -> str:
    """The backend `select_backend` picks on `device` for `dtype`, in a compiled region or not (also what
    benchmark rows report as the training attention kernel)."""
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and _varlen_fn() is not None:
            return "varlen"
        if compiled and _flex_fns() is not None:
            return "flex"
    return "sdpa"


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence: (T, Hq, D), (T, Hkv, D) x2 -> (T, Hq, D)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected (T, H, D) tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    backend = backend or select_backend(q)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "varlen":
        return _varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    if backend == "flex":
        return _flex_attention(q, k, v, cu_seqlens, scale)
    return sdpa_varlen_attention(q, k, v, cu_seqlens, scale)


def sdpa_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference path: causal SDPA within each sequence (simple, correct, any device).

    Consecutive sequences are attended in groups of up to MASKED_SDPA_MAX_TOKENS tokens, one SDPA
    call with a document-causal mask per group (a group of one sequence: a plain causal call). One
    call per sequence is launch-bound where sequences are short (the CPU demo packs 128 sequences
    of 4 tokens; an RL batch of short answers, a few thousand calls per pass); one call over the
    whole batch would attend T x T. A group bounds both: its mask holds at most the limit squared.
    On CUDA, grouped-query k / v are repeated to the query heads: the memory-efficient kernel takes
    float32 and masks but not GQA, and SDPA's fallback (math) would keep H x L x L scores for the
    backward.
    """
    bounds = cu_seqlens.tolist()  # one host sync
    groups = _sequence_groups(bounds, MASKED_SDPA_MAX_TOKENS)
    starts = cu_seqlens.to(q.device, torch.int64)
    if q.is_cuda and k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    if len(groups) == 1 and groups[0][0][0] == 0 and groups[0][-1][1] == q.shape[0]:
        return _attend_group(q, k, v, groups[0], starts, scale)
    out = torch.zeros_like(q)  # rows of empty-sequence padding, if any, stay 0
    for group in groups:
        start, end = group[0][0], group[-1][1]
        out[start:end] = _attend_group(q[start:end], k[start:end], v[start:end], group, starts, scale)
    return out


MASKED_SDPA_MAX_TOKENS = 1024
"""Most tokens of consecutive sequences that `sdpa_varlen_attention` attends in one masked SDPA call."""


def _sequence_groups(bounds: list[int], limit: int) -> list[list[tuple[int, int]]]:
    """Consecutive non-empty (start, end) spans, grouped while a group spans at most `limit` tokens;
    a longer sequence is a group of its own."""
    groups: list[list[tuple[int, int]]] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        if groups and end - groups[-1][0][0] <= limit:
            groups[-1].append((start, end))
        else:
            groups.append([(start, end)])
    return groups


def _attend_group(q, k, v, spans: list[tuple[int, int]], starts: torch.Tensor, scale) -> torch.Tensor:
    """Causal attention within each of `spans` (back to back; q / k / v hold rows spans[0][0] to spans[-1][1]
    of the packed batch); `starts`: the batch's cu_seqlens (int64, on q's device)."""
    qs, ks, vs = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # SDPA wants (..., H, L, D)
    gqa = ks.shape[0] != qs.shape[0]  # kv heads shared without a repeat copy
    if len(spans) == 1:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1)
    # the mask from positions on the device: no host-side list to copy over (a sync per group and layer)
    pos = torch.arange(spans[0][0], spans[-1][1], device=q.device)
    doc = torch.searchsorted(starts, pos, right=True)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def _varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    found = _varlen_fn()
    if found is None:
        raise ValueError("backend 'varlen' needs torch>=2.10 (torch.nn.attention.varlen)")
    varlen_attn, params = found
    kwargs = {}
    # torch 2.10 spelled causality `is_causal=True`; 2.11+ uses a sliding window (-1, 0).
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif not _NATIVE_GQA.get(q.device, False):
            # Query head h reads kv head h // group, which is what repeat_interleave on the
            # head dim produces (same as HF repeat_kv).
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:
            # Fold a non-default scale into q: the kernel always multiplies by 1/sqrt(D).
            q = q * (scale * math.sqrt(q.shape[-1]))
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


# device -> whether varlen_attn takes fewer kv heads than query heads as they are (see probe_native_gqa)
_NATIVE_GQA: dict[torch.device, bool] = {}


def probe_native_gqa(device: torch.device) -> bool:
    """Decide once per device whether `varlen_attn` can be given GQA k/v without repeating them.

    FlashAttention handles GQA natively (query head h reads kv head h // group), but torch's
    wrapper differs by version: some reject unequal head counts unless `enable_gqa=True` is
    passed, some lack that argument and pass any head count through. Without the argument we
    run a small GQA input both ways (as given, and with k/v repeated) and use the direct form
    only when it runs and its output and gradients match. Until it has run for a device the
    repeat is used. Call it outside autograd-recorded regions (it runs its own small backward,
    which must not land inside an activation-checkpointed or compiled block):
    `Transformer.forward` calls it before its blocks.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _NATIVE_GQA:
        return _NATIVE_GQA[device]
    found = _varlen_fn()
    ok = False
    if device.type == "cuda" and found is not None and "enable_gqa" not in found[1]:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                gen = torch.Generator(device=device).manual_seed(0)
                shapes = {"q": (96, 4, 64), "k": (96, 2, 64), "v": (96, 2, 64)}
                base = {n: torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) for n, s in shapes.items()}
                cu = torch.tensor([0, 40, 96], device=device, dtype=torch.int32)
                direct, repeated = (_probe_once(device, native, base, cu) for native in (True, False))
            ok = direct is not None and repeated is not None and all(
                torch.allclose(a, b, atol=2e-2, rtol=2e-2) for a, b in zip(direct, repeated)
            )
        finally:
            _NATIVE_GQA[device] = ok  # never left at the probe's intermediate value
    _NATIVE_GQA[device] = ok
    return ok


def _probe_once(device, native: bool, base: dict, cu: torch.Tensor) -> list[torch.Tensor] | None:
    """Output and q/k/v gradients of the probe input with GQA passed natively or repeated."""
    _NATIVE_GQA[device] = native
    leaves = {n: t.clone().requires_grad_(True) for n, t in base.items()}
    try:
        out = _varlen_attention(leaves["q"], leaves["k"], leaves["v"], cu, 56, None)
        out.float().square().sum().backward()
    except (RuntimeError, ValueError):
        return None
    return [out.float()] + [leaves[n].grad.float() for n in ("q", "k", "v")]


def _flex_attention(q, k, v, cu_seqlens, scale):
    found = _flex_fns()
    if found is None:
        raise ValueError("backend 'flex' needs torch.nn.attention.flex_attention")
    flex, create_block_mask = found
    total = q.shape[0]
    # doc_id[t] = index of the sequence that token t belongs to.
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(q.device, torch.int64)
    doc_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    assert doc_id.numel() == total, "cu_seqlens does not cover the packed tokens"

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    # _compile builds the block mask without materialising a (T, T) boolean matrix.
    mask = create_block_mask(document_causal, None, None, total, total, device=q.device, _compile=q.is_cuda)
    out = flex(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def decode_capturable(device: torch.device, dtype: torch.dtype, decode_kernel: str) -> bool:
    """Whether cache_attention decodes without a host sync (so a CUDA graph can capture it): the
    Triton kernel (bf16 / fp16 / fp32) or FlashAttention (bf16 / fp16) on CUDA; not the per-sequence
    SDPA loop, which reads the lengths on the host."""
    if device.type != "cuda":
        return False
    if decode_kernel == "triton" and decode_attention.available():
        return dtype in _TRITON_DTYPES
    return dtype in (torch.float16, torch.bfloat16)


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None = None,
    decode_kernel: str = "triton",
    order: torch.Tensor | None = None,
    launch: Mapping[str, int] = decode_attention.LAUNCH,
    programs_per_sm: int = decode_attention.PROGRAMS_PER_SM,
) -> torch.Tensor:
    """Attention of packed queries over a flattened KV cache with ragged lengths: -> (T, Hq, D).

    q (T, Hq, D) holds the new tokens of B sequences back to back (sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]); k_cache / v_cache (N, Hkv, D) is one layer's cache with
    every sequence in a region of its own: sequence b's keys are rows
    cu_seqlens_k[b] : cu_seqlens_k[b] + seqused_k[b], the new tokens' keys already written at the
    end. The regions need not be in order (only the first B entries of cu_seqlens_k are read).
    With `causal` a query sees the keys up to its own position, aligned to the end of the region
    (the i-th of n new queries sits at key position seqused_k - n + i): chunked prefill and
    decoding (one query per sequence) are the same call. GQA is native: query head h reads kv
    head h // (Hq / Hkv), no repeat.

    CUDA: decoding (one query per sequence, `max_seqlen_q` 1) runs the Triton split-K kernel of
    ops/decode_attention.py (`decode_kernel="triton"`, when triton is installed; bf16, fp16 and
    fp32 with exact fp32 products; `order`: the decode kernel's `launch_order`, shared by a step's layers;
    `launch` / `programs_per_sm`: its launch and split target, `rollout.decode_launch` / `decode_programs_per_sm`); with bf16/fp16, prefill and `decode_kernel="flash"` run FlashAttention's varlen forward with `seqused_k` (no
    (B, L) mask, no per-shape plan, graph-capturable; `max_seqlen_k` is only a bound). Elsewhere:
    one SDPA call per sequence over exactly its keys, so a sequence's result does not depend on
    the others.
    """
    triton_decode = decode_kernel == "triton" and decode_attention.available() and q.dtype in _TRITON_DTYPES
    if q.is_cuda and triton_decode and max_seqlen_q == 1 and not causal:
        # one query row per sequence: rows of q are the sequences
        splits = decode_attention.choose_splits(q.shape[0], k_cache.shape[1], q.device, programs_per_sm)
        starts = cu_seqlens_k[: q.shape[0]]
        return decode_attention.decode_attention(q, k_cache, v_cache, starts, seqused_k, splits, scale, order, launch)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._flash_attention_forward(
            q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
            scale=scale, seqused_k=seqused_k,
        )  # fmt: skip
        return out[0]
    out = torch.empty_like(q)
    q_bounds, k_starts, k_lens = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), seqused_k.tolist()
    group = q.shape[1] != k_cache.shape[1]
    for b, n in enumerate(k_lens):
        q0, q1 = q_bounds[b], q_bounds[b + 1]
        if q1 == q0:
            continue
        k0 = k_starts[b]
        qs = q[q0:q1].transpose(0, 1)  # (H, n, D)
        ks = k_cache[k0 : k0 + n].transpose(0, 1)
        vs = v_cache[k0 : k0 + n].transpose(0, 1)
        mask = None
        if causal and q1 - q0 > 1:  # bottom-right aligned: query i sees keys [0, n - (q1 - q0) + i]
            rows = torch.arange(q1 - q0, device=q.device)[:, None] + (n - (q1 - q0))
            mask = torch.arange(n, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group)
        out[q0:q1] = o.transpose(0, 1)
    return out


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Padded attention for decoding: q (B, Hq, S, D) over k/v (B, Hkv, L, D) -> (B, Hq, S, D).

    `allowed` (B, S, L) bool says which key slots each query may read. Every query row must
    allow at least one slot, otherwise softmax over nothing yields NaN.
    """
    if allowed.shape != (q.shape[0], q.shape[2], k.shape[2]):
        raise ValueError(
            f"allowed mask shape {tuple(allowed.shape)} != (B, S, L) = "
            f"{(q.shape[0], q.shape[2], k.shape[2])}"
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed.unsqueeze(1), scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
