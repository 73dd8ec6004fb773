"""Named model shapes: published Qwen3 / Llama 3.2 configs plus tiny models for tests."""

from __future__ import annotations

import difflib

from slipstream.models.config import ModelConfig

_QWEN3 = dict(
    family="qwen3",
    vocab_size=151936,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Tiny shapes share ids with build_char_tokenizer(): <pad>=0, <bos>=1, <eos>=2.
_TINY = dict(
    vocab_size=96,  # the built-in char tokenizer has 88 tokens: a small head keeps chance-level rewards reachable
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        **_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, tie_word_embeddings=True,
    ),
    "qwen3-1.7b": ModelConfig(
        **_QWEN3, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
        num_kv_heads=8, tie_word_embeddings=True,
    ),
    "qwen3-4b": ModelConfig(
        **_QWEN3, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
        num_kv_heads=8, tie_word_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        **_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, tie_word_embeddings=False,
    ),
    "llama3.2-1b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_scaling=dict(_LLAMA3_ROPE), bos_token_id=128000, eos_token_id=128001,
    ),
    "tiny": ModelConfig(family="qwen3", qk_norm=True, tie_word_embeddings=True, **_TINY),
    # Untied head and llama3 rope scaling (short original context so scaling actually bites).
    "tiny-llama": ModelConfig(
        family="llama", rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={**_LLAMA3_ROPE, "factor": 4.0, "original_max_position_embeddings": 64},
        **_TINY,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Return the named preset; unknown names raise ValueError suggesting the closest one."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown model preset {name!r}{hint} (available: {', '.join(PRESETS)})")
