"""HF-named state dicts <-> megatron-core GPTModel state dicts, and tensor-parallel sharding.

Pure tensor shuffling (no megatron import), so it runs and is tested without megatron-core.

Megatron fuses what HF keeps apart:
  * q/k/v -> `self_attention.linear_qkv`, interleaved per query (kv) group: for each of the
    `num_kv_heads` groups, the rows of that group's `num_heads / num_kv_heads` query heads,
    then its key head, then its value head. Contiguous TP chunks of this matrix are therefore
    whole query groups, which is what ColumnParallelLinear expects.
  * gate/up -> `mlp.linear_fc1` = [gate; up] (Megatron's gated linear unit splits its output
    in halves, first half through the activation). Under TP every rank holds [gate_r; up_r].
  * RMSNorm weights: the local spec has `input_layernorm` / `pre_mlp_layernorm` modules; the
    Transformer Engine spec folds them into `linear_qkv.layer_norm_weight` /
    `linear_fc1.layer_norm_weight`. `layout` ("local" or "te") picks the names.
  * Tied embeddings: `output_layer.weight` is absent (Megatron reuses the embedding).

Only full (pipeline stage = whole model) state dicts are handled; layer numbers are global.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from slipstream.models.config import ModelConfig

LAYOUTS = ("local", "te")

# Names (relative to "decoder.layers.{i}.") of the norms that differ between the two specs.
_NORM_NAMES = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}


def _check(cfg: ModelConfig, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown megatron layout {layout!r}; expected one of {LAYOUTS}")
    if cfg.attention_bias and cfg.family != "qwen2":
        # Megatron's add_qkv_bias covers q/k/v only; an o_proj bias would need add_bias_linear,
        # which also adds MLP biases that these families do not have.
        raise ValueError(f"attention_bias=True is only convertible for qwen2 (family={cfg.family!r})")


def detect_layout(names: Iterable[str]) -> str:
    """"te" if the state-dict names carry TE's fused layer-norm weights, else "local"."""
    return "te" if any(n.endswith("linear_qkv.layer_norm_weight") for n in names) else "local"


def _take(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"state dict is missing {name!r}")
    return sd.pop(name)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q (Hq*D, ...), k/v (Hkv*D, ...) -> Megatron linear_qkv rows, grouped per kv head."""
    g, d = cfg.num_kv_heads, cfg.head_dim
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(g, (cfg.num_heads // g) * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: Megatron linear_qkv rows -> HF q, k, v."""
    g, d = cfg.num_kv_heads, cfg.head_dim
    q_rows = (cfg.num_heads // g) * d
    rest = qkv.shape[1:]
    expected = g * (q_rows + 2 * d)
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, config implies {expected}")
    grouped = qkv.reshape(g, q_rows + 2 * d, *rest)
    q, k, v = grouped.split([q_rows, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(
    hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, layout: str = "local"
) -> dict[str, torch.Tensor]:
    """HF-named state dict ("model.layers.0.self_attn.q_proj.weight", ...) -> GPTModel names.

    The result holds parameters only (no `_extra_state`); load it with `strict=False` and
    check that only `_extra_state` keys were missing (see provider.load_megatron_state_dict).
    """
    _check(cfg, layout)
    sd = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # HF lists the tied head as its own entry
    in_norm, mlp_norm = _NORM_NAMES[layout]
    out = {"embedding.word_embeddings.weight": _take(sd, "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + in_norm] = _take(sd, hf + "input_layernorm.weight")
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(_take(sd, f"{attn}{p}_proj.weight") for p in "qkv"), cfg
        )
        if cfg.attention_bias:
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(_take(sd, f"{attn}{p}_proj.bias") for p in "qkv"), cfg
            )
        if cfg.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = _take(sd, attn + "q_norm.weight")
            out[mg + "self_attention.k_layernorm.weight"] = _take(sd, attn + "k_norm.weight")
        out[mg + "self_attention.linear_proj.weight"] = _take(sd, attn + "o_proj.weight")
        out[mg + mlp_norm] = _take(sd, hf + "post_attention_layernorm.weight")
        gate, up = _take(sd, hf + "mlp.gate_proj.weight"), _take(sd, hf + "mlp.up_proj.weight")
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mg + "mlp.linear_fc2.weight"] = _take(sd, hf + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = _take(sd, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _take(sd, "lm_head.weight")
    if sd:
        raise ValueError(f"unconverted HF weights (config mismatch?): {sorted(sd)[:8]}")
    return out


def megatron_to_hf(
    mg_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, layout: str | None = None
) -> dict[str, torch.Tensor]:
    """GPTModel state dict (full, TP-merged) -> HF names; `layout=None` detects local vs TE."""
    layout = layout or detect_layout(mg_sd)
    _check(cfg, layout)
    sd = {k: v for k, v in mg_sd.items() if not k.endswith("_extra_state")}
    in_norm, mlp_norm = _NORM_NAMES[layout]
    out = {"model.embed_tokens.weight": _take(sd, "embedding.word_embeddings.weight")}
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = _take(sd, mg + in_norm)
        q, k, v = split_qkv(_take(sd, mg + "self_attention.linear_qkv.weight"), cfg)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if cfg.attention_bias:
            q, k, v = split_qkv(_take(sd, mg + "self_attention.linear_qkv.bias"), cfg)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = _take(sd, mg + "self_attention.q_layernorm.weight")
            out[attn + "k_norm.weight"] = _take(sd, mg + "self_attention.k_layernorm.weight")
        out[attn + "o_proj.weight"] = _take(sd, mg + "self_attention.linear_proj.weight")
        out[hf + "post_attention_layernorm.weight"] = _take(sd, mg + mlp_norm)
        gate, up = _take(sd, mg + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = _take(sd, mg + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _take(sd, "output_layer.weight")
    if sd:
        raise ValueError(f"unconverted Megatron weights (config mismatch?): {sorted(sd)[:8]}")
    return out


# ---------------------------------------------------------------------------- tensor parallel

# How each parameter is split across TP ranks, by name suffix. Everything else (norm weights)
# is replicated on every rank.
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_GATED_COLUMN = ("mlp.linear_fc1.weight",)
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def _split_kind(name: str) -> str:
    if name.endswith(_COLUMN) or name.endswith(_VOCAB):
        return "rows"
    if name.endswith(_GATED_COLUMN):
        return "gated_rows"
    if name.endswith(_ROW):
        return "cols"
    return "replicated"


def shard_for_tp(
    megatron_sd: Mapping[str, torch.Tensor], tp_size: int, tp_rank: int, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """This TP rank's slice of a full GPTModel state dict (views, not copies).

    Column-parallel (linear_qkv, embedding, output layer) splits rows; because linear_qkv is
    grouped per kv head, rank r gets exactly query groups [r*G/tp, (r+1)*G/tp). linear_fc1
    splits gate and up separately so each rank holds [gate_r; up_r]. Row-parallel
    (linear_proj, linear_fc2) splits columns. `cfg` is needed to validate divisibility.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"invalid tp_rank={tp_rank} for tp_size={tp_size}")
    if cfg.num_kv_heads % tp_size:
        # Megatron can replicate kv groups when tp > num_kv_heads; that layout is not handled here.
        raise ValueError(f"num_kv_heads={cfg.num_kv_heads} must be divisible by tp_size={tp_size}")
    for what, n in (("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size)):
        if n % tp_size:
            raise ValueError(f"{what}={n} must be divisible by tp_size={tp_size} (no vocab padding yet)")
    out = {}
    for name, t in megatron_sd.items():
        if name.endswith("_extra_state"):
            continue
        kind = _split_kind(name)
        if kind == "rows":
            out[name] = t.chunk(tp_size, dim=0)[tp_rank]
        elif kind == "gated_rows":
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
        elif kind == "cols":
            out[name] = t.chunk(tp_size, dim=1)[tp_rank]
        else:
            out[name] = t
    return out


def merge_tp(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `shard_for_tp`: per-rank state dicts (in rank order) -> the full state dict."""
    if not shards:
        raise ValueError("merge_tp needs at least one shard")
    names = list(shards[0])
    for r, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            raise ValueError(f"shard {r} has different parameter names from shard 0")
    out = {}
    for name in names:
        parts = [s[name] for s in shards]
        kind = _split_kind(name)
        if kind == "rows":
            out[name] = torch.cat(parts, dim=0)
        elif kind == "gated_rows":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif kind == "cols":
            out[name] = torch.cat(parts, dim=1)
        else:
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise ValueError(f"replicated parameter {name!r} differs across TP ranks")
            out[name] = parts[0]
    return out


__all__ = [
    "LAYOUTS",
    "detect_layout",
    "fuse_qkv",
    "split_qkv",
    "hf_to_megatron",
    "megatron_to_hf",
    "shard_for_tp",
    "merge_tp",
]
