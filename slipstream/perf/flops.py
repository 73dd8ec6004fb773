"""Model FLOPs of a decoder-only transformer, counted the one way slipstream reports them.

Per sample of length s (prompt + response tokens, no padding), forward + backward:

    6 * N * s  +  6 * L * H * d * s^2

N = `ModelConfig.num_matmul_params`: every linear weight including the LM head, but not the
embedding lookup (a gather, no multiply-adds). The first term is 2 FLOPs per weight per token
forward, 4 backward. The second term is the attention score and value matmuls under a causal
mask: full attention costs 2 (QK^T) + 2 (AV) = 4 * H * d * s^2 forward per layer; causal keeps
half of that, 2 * H * d * s^2, and backward doubles it again, giving 6 * H * d * s^2 per layer.
Forward-only passes (old / ref log-probs) are a third of the total.

These are *model* FLOPs: recomputation from activation checkpointing is not counted, and
padding tokens are not counted, so a padded or recomputing engine scores a lower MFU for the
same wall time - which is the point of the number.

How peers differ (read when comparing their MFU with ours):

- verl `verl/utils/flops_counter.py` (`_estimate_qwen2_flops`, also used for llama/qwen3):
  dense part `6 * N_verl * tokens` with `N_verl = L * (attn_linear + mlp) + 2 * V * h`, i.e. it
  counts the embedding as a matmul *and* the LM head separately, even when they are tied; its
  q/k/v/o and MLP weights are the same as ours. Its attention part was
  `12 * sum(s^2) * d * H * L` (full, non-causal attention; e.g. at commit 02cf355f1,
  2025-12-30) until commit 54582f1f0 (2026-01-18, PR #4959), after which it is
  `6 * sum(s^2) * d * H * L`, the same as ours. So verl's count exceeds ours by exactly
  `6 * V * h` per token always (V*h is about 18% of N for Qwen3-1.7B, 26% for Qwen3-0.6B) and
  by 2x on attention in older versions: verl MFU reads higher than slipstream MFU for the
  same run.
- slime / Miles `slime/utils/flops_utils.py` (`calculate_fwd_flops`, forward only; train is
  `3 * fwd` in `slime/observability/train_metric_utils.py`; read at 55d3e4164, 2026-05-29,
  unchanged through 2026-08-21): excludes the embedding and includes the LM head like us.
  Attention is `H * s^2 * d` for QK^T plus `H * s^2 * d` for AV (both causal halves of
  2 FLOPs per MAC); the sum, `2 * H * d * s^2` forward, equals ours. Q and K/V projections
  use `kv_channels` (= head_dim) and the KV-group count, `h * (H + 2 * n_kv_heads) * d`, equal
  to ours. The one difference is the output projection, `h * h` instead of `H * d * h`: slime
  minus ours is `6 * L * h * (h - H * d)` per token. It is zero when `H * d == h`
  (Qwen3-1.7B, Llama-3.2-1B) and negative when `H * d > h` (about -5% of the dense FLOPs
  for Qwen3-0.6B, -3.5% for Qwen3-4B): on these presets slime MFU reads at or below ours.
  Older slime differed more: its first version (2025-06) used `head_dim = h // H` in every
  term and full (non-causal) attention; 8ef0187b2 (2025-12-12) halved QK^T only; before
  55d3e4164 the MLA branches were chosen by MLA-only fields (q_lora_rank,
  qk_pos_emb_head_dim, ...) being set, not by `multi_latent_attention`.
"""

from __future__ import annotations

from typing import Sequence

from slipstream.models.config import ModelConfig


def _check_seq_lens(seq_lens: Sequence[int]) -> None:
    for s in seq_lens:
        if s < 0:
            raise ValueError(f"sequence lengths must be >= 0, got {s}")


def train_flops(cfg: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward + backward pass over sequences of the given lengths."""
    _check_seq_lens(seq_lens)
    # Sum in Python ints so the count is exact however many samples a step has; convert once.
    num_tokens = sum(int(s) for s in seq_lens)
    sum_sq = sum(int(s) * int(s) for s in seq_lens)
    dense = 6 * cfg.num_matmul_params * num_tokens
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum_sq
    return float(dense + attention)


def forward_flops(cfg: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward pass (log-prob recompute): a third of `train_flops`."""
    return train_flops(cfg, seq_lens) / 3.0


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Average fwd+bwd FLOPs per token of a sequence of length `seq_len` (for quick estimates)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return train_flops(cfg, [seq_len]) / seq_len
