"""verl's remove-padding attention call, run on torch's own varlen attention (the verl cell's fast path).

With `use_remove_padding=True` verl's FSDP engine unpads every micro-batch into one packed row
(input_ids (1, T), position ids restarting at 0 for each sequence, no attention mask) and leaves
the attention to transformers' "flash_attention_2" implementation, which derives cu_seqlens from
the position ids and calls flash-attn's `flash_attn_varlen_func`. flash-attn cannot be built on
the machines this bench runs on, so the verl runner registers this function under transformers'
AttentionInterface as "torch_varlen": the same cu_seqlens from the same position ids, then
slipstream.ops.attention.varlen_causal_attention, which is torch.nn.attention.varlen_attn (the
FlashAttention-2 kernel bundled with torch) on CUDA and per-sequence SDPA on the CPU. verl's own
code runs unchanged; only the kernel under its varlen call is torch's instead of flash-attn's, and
the cell's row says so. Imported only inside the verl subprocess (its transformers is the site's).
"""

from __future__ import annotations

import torch

from slipstream.ops.attention import probe_native_gqa, varlen_causal_attention

NAME = "torch_varlen"
"""The attn_implementation name verl's model config is given."""


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens (n+1,) int32, longest sequence) of one packed row whose positions restart at 0 per sequence.

    The rule transformers' flash-attention path uses for packed inputs without a mask.
    """
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())  # one host sync per call, as in transformers' flash path


def torch_varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None,
    position_ids=None, **kwargs,
):  # fmt: skip
    """An AttentionInterface function: q (1, Hq, T, D), k / v (1, Hkv, T, D) -> ((1, T, Hq, D), None)."""
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation {NAME!r} runs verl's remove-padding layout only (one packed row, position ids, "
            "no attention mask): set use_remove_padding=True"
        )
    if dropout or sliding_window or softcap:
        raise ValueError(f"attn_implementation {NAME!r} has no dropout, sliding window or softcap")
    cu, max_len = cu_seqlens_from_position_ids(position_ids)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D), the packed layout
    return varlen_causal_attention(q, k, v, cu, max_len, scale=scaling).unsqueeze(0), None


def register(device: torch.device) -> None:
    """Make NAME a transformers attention implementation (before verl builds its model)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, torch_varlen_attention)
    # As slipstream's own model does once per device: GQA k / v go to the kernel as they are when it
    # takes them, instead of repeated to the query heads.
    probe_native_gqa(device)
