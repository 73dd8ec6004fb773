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

- verl `verl/utils/flops_counter.py` (`_estimate_qwen2_flops`, also used for llama/qwen3; read
  at commit 02cf355f):
  dense part `6 * N_verl * tokens` with `N_verl = L * (attn_linear + mlp) + 2 * V * h`, i.e. it
  counts the embedding as a matmul *and* the LM head separately, even when they are tied; its
  attention part is `12 * sum(s^2) * d * H * L` (full, non-causal attention). REFERENCES.md notes
  that the attention term was 2x too high "until early 2026", after which verl uses
  `6 * sum(s^2) * d * H * L`, the same as ours. So verl's count exceeds ours by `6 * V * h` per
  token always (about 18% of the dense FLOPs for Qwen3-1.7B) and by 2x on attention in older
  versions: verl MFU reads higher than slipstream MFU for the same run.
- slime / Miles `slime/utils/flops_utils.py` (`calculate_fwd_flops`, forward only; train is
  `3 * fwd`): excludes the embedding and includes the LM head like us. Attention is
  `H * s^2 * d` for QK^T (halved for causality) plus `H * s^2 * d` for AV (not halved); the sum,
  `2 * H * d * s^2` forward, equals ours. Two projection terms differ: the K/V projection uses
  `h * (H // n_kv_heads) * d` (heads per group) instead of `h * 2 * n_kv_heads * d`, and the
  output projection uses `h * h` instead of `H * d * h`. For Qwen3-1.7B (16 heads, 8 KV heads,
  H * d == h) slime undercounts K/V by 8x; its numbers come out slightly below ours.
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
