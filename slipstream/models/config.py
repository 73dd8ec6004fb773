"""Architecture description shared by native models, FLOPs counting and Megatron providers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer of the Llama / Qwen2 / Qwen3 families."""

    family: str
    """"qwen3", "qwen2" or "llama"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    """Qwen3: RMSNorm over head_dim applied to q and k before RoPE."""
    attention_bias: bool = False
    """Qwen2: bias on the q, k and v projections."""
    max_position_embeddings: int = 32768
    rope_scaling: dict | None = None
    """HF `rope_scaling` dict (e.g. Llama 3 "llama3" frequency scaling); None for plain RoPE."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.family not in ("qwen3", "qwen2", "llama"):
            raise ValueError(f"unknown model family {self.family!r}; expected qwen3, qwen2 or llama")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def num_matmul_params(self) -> int:
        """Parameters of every linear layer including the LM head (not the embedding lookup)."""
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_heads * d
        kv = 2 * h * self.num_kv_heads * d
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (q + kv + o + mlp) + self.vocab_size * h
