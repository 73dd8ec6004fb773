"""Single-device decoder for the Qwen3 / Qwen2 / Llama families, driven by `ModelConfig`.

Plain PyTorch in the torchtitan style: parallelism (FSDP, activation checkpointing,
compile) is applied from outside, one `Block` per layer being the unit that is sharded
and checkpointed. Parameter names equal the Hugging Face names minus the "model." prefix
(see slipstream/models/hf.py for the explicit adapter).

Two entry points:
  forward         packed sequences (T,) with cu_seqlens, no padding; training / log-probs.
  forward_cached  (B, S) left-padded batches against a preallocated `KVCache`; rollout.
Both return final-normed hidden states, not logits: the loss computes log-probs from
hidden states and `lm_head_weight` in a fused op, so (T, V) logits never need to exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.config import ModelConfig
from slipstream.ops.attention import cached_attention, probe_native_gqa, varlen_causal_attention

_ROPE_TYPES = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (matches HF Llama/Qwen)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,) in fp32, with optional linear / llama3 scaling."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    rs = cfg.rope_scaling
    rope_type = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rs["factor"]
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; expected one of {_ROPE_TYPES}")
    # Llama 3.1 scaling: long wavelengths (low frequencies) are stretched by `factor`,
    # short ones kept, and the band in between interpolated smoothly.
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape position_ids.shape + (head_dim,), computed in fp32 then cast."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (..., D/2)
    # HF "rotate_half" layout: the two halves of head_dim share the same frequencies.
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., N, heads, D) by per-position cos/sin (..., N, D)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Preallocated keys/values for every layer: (layers, B, Hkv, max_len, D).

    All rows share one write position (`length`): prompts are left-padded, so slot j holds
    the j-th column of the batch for every row, and a validity mask says which slots count.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reset(self) -> None:
        """Forget the cached prefix (the buffers are reused, not cleared)."""
        self.length = 0


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm (Qwen3) and qkv bias (Qwen2)."""

    def __init__(self, cfg: ModelConfig, backend: str | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.backend = backend
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        # Qwen2 biases only q/k/v; Llama and Qwen3 put `attention_bias` on o_proj as well.
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias and cfg.family != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (..., N, hidden) -> q (..., N, Hq, D), k/v (..., N, Hkv, D), with RoPE applied."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected q (..., N, Hq*D), k / v (..., N, Hkv*D) -> per-head q, k, v with q/k norm and RoPE."""
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:  # per-head norm over head_dim, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        # the norms and the fp32 rotation upcast q and k under autocast; attention kernels want one dtype
        return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, x, cos, sin, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        out = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, backend=self.backend)
        return self.o_proj(out.flatten(-2))

    def forward_cached(self, x, cos, sin, k_cache, v_cache, start: int, allowed) -> torch.Tensor:
        """x (B, S, hidden); writes this chunk's k/v at slots [start, start+S) of the cache."""
        q, k, v = self._qkv(x, cos, sin)
        end = start + x.shape[1]
        k_cache[:, :, start:end] = k.transpose(1, 2)
        v_cache[:, :, start:end] = v.transpose(1, 2)
        out = cached_attention(q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end], allowed)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.gate_proj(x), self.up_proj(x))

    def combine(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) from the two projections (computed apart or as one fused matmul)."""
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder layer; the unit of FSDP sharding and activation checkpointing."""

    def __init__(self, cfg: ModelConfig, attn_backend: str | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, attn_backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, k_cache, v_cache, start: int, allowed) -> torch.Tensor:
        h = self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, allowed)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only LM; `forward` returns final-normed hidden states (not logits)."""

    def __init__(self, cfg: ModelConfig, attn_backend: str | None = None) -> None:
        super().__init__()
        rope_type = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; expected one of {_ROPE_TYPES}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, attn_backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, H) output projection; the embedding matrix when embeddings are tied."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states (..., H) to vocabulary logits (..., V)."""
        return F.linear(hidden, self.lm_head_weight)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        # Recomputed per call (head_dim/2 values): no buffer to re-initialise after meta init.
        return rope_cos_sin(position_ids, rope_inv_freq(self.cfg, position_ids.device), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """Packed forward: input_ids/position_ids (T,), cu_seqlens (n+1,) int32 -> hidden (T, H)."""
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"expected packed (T,) input_ids and position_ids, got {tuple(input_ids.shape)} "
                f"and {tuple(position_ids.shape)}"
            )
        if input_ids.is_cuda and self.cfg.num_kv_heads != self.cfg.num_heads and not torch.compiler.is_compiling():
            # once per device, here and not inside a (checkpointed / compiled) block: see the probe
            probe_native_gqa(input_ids.device)
        h = self.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, cu_seqlens, max_seqlen)
        return self.norm(h)

    def forward_cached(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Decode step on (B, S) tokens placed at cache slots [cache.length, cache.length+S).

        valid (B, cache.length + S) bool marks real (non-pad) slots, including the new ones.
        Returns hidden (B, S, H) and advances cache.length by S.
        """
        bsz, seq = input_ids.shape
        start, end = cache.length, cache.length + seq
        if bsz != cache.batch_size:
            raise ValueError(f"batch size {bsz} != cache batch size {cache.batch_size}")
        if end > cache.max_len:
            raise ValueError(f"cache overflow: {end} slots needed, cache holds {cache.max_len}")
        if valid.shape != (bsz, end):
            raise ValueError(f"valid mask shape {tuple(valid.shape)} != {(bsz, end)}")
        key_slot = torch.arange(end, device=input_ids.device)
        query_slot = key_slot[start:]
        causal = key_slot[None, :] <= query_slot[:, None]  # (S, end)
        allowed = valid[:, None, :] & causal
        # Pad queries would see no valid key (softmax over nothing = NaN); letting each query
        # read its own slot keeps them finite. Real tokens never read pad slots, so the
        # garbage computed at pad positions cannot leak into them.
        allowed = allowed | (key_slot[None, :] == query_slot[:, None])
        h = self.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.forward_cached(h, cos, sin, cache.k[i], cache.v[i], start, allowed)
        cache.length = end
        return self.norm(h)

    @torch.no_grad()
    def init_weights(self, seed: int | torch.Generator = 0) -> None:
        """Random init: linear/embedding weights ~ N(0, 0.02), biases 0, norm weights 1."""
        gen = seed
        if not isinstance(seed, torch.Generator):
            gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
