"""Build a megatron-core GPTModel from a `ModelConfig` and load HF weights into it.

megatron-core is imported inside the functions, so `import slipstream.engine.megatron` works
without it. Every function here assumes `megatron.core.parallel_state` is initialised
(`init_model_parallel` does that, also for a single CPU/GPU process).

Layer spec: Transformer Engine's when it is installed and CUDA is available (fused norms,
THD packed attention), otherwise megatron-core's local spec (plain torch modules). The two
name their norm weights differently; `convert.detect_layout` tells them apart. The training
engine builds with `packed=True`: THD packed sequences through slipstream's varlen attention
(`layers.py`) on the local spec, so packing works without TE.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from slipstream.engine.megatron.convert import detect_layout, hf_to_megatron, megatron_to_hf, shard_for_tp
from slipstream.models.config import ModelConfig
from slipstream.models.transformer import rope_inv_freq

# Megatron's built-in llama3 RoPE scaling has these constants fixed; only `factor` is free.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def te_available() -> bool:
    """True when Transformer Engine is importable and a GPU is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def init_model_parallel(tp_size: int = 1, pp_size: int = 1, cp_size: int = 1, device_type: str | None = None) -> None:
    """Initialise megatron's parallel_state over the default process group (created if absent).

    Uses slipstream's `init_distributed` (torchrun variables, or a 1-process group), so the
    Megatron and FSDP backends share one way of joining a job. `device_type=None` picks CUDA
    when present. Calling it again is a no-op.
    """
    from megatron.core import parallel_state

    from slipstream.engine.distributed import init_distributed

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    _, world, _ = init_distributed(device_type)
    if world % (tp_size * pp_size * cp_size):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp_size}*{pp_size}*{cp_size}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            context_parallel_size=cp_size,
        )


def transformer_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32, **overrides):
    """megatron.core TransformerConfig matching `cfg` (no dropout: RL log-probs must be deterministic)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    if cfg.attention_bias and cfg.family != "qwen2":
        raise ValueError(f"attention_bias=True is only supported for qwen2 on megatron (family={cfg.family!r})")
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.attention_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _rope_kwargs(cfg: ModelConfig) -> tuple[dict, bool]:
    """GPTModel RoPE arguments, and whether inv_freq must be overwritten after construction."""
    kwargs = dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=cfg.rope_theta)
    rs = cfg.rope_scaling
    if rs is None:
        return kwargs, False
    standard = all(rs.get(k) == v for k, v in _MEGATRON_LLAMA3.items())
    if rs.get("rope_type", rs.get("type")) == "llama3" and standard:
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": rs["factor"]}, False
    # Any other scaling (linear, llama3 with other constants) is installed by hand below.
    return kwargs, True


def build_gpt_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    packed: bool = False,
    **config_overrides,
):
    """megatron.core GPTModel for `cfg` (whole model on this pipeline stage; TP from parallel_state).

    use_te=None picks Transformer Engine when `te_available()`. `packed=True` builds the
    training engine's model: THD packed input without TE (the local spec's core attention is
    replaced by `layers.VarlenCoreAttention`) and a forward that returns final-normed hidden
    states instead of logits (`layers.HiddenStatesGPTModel`). Extra keyword arguments go to
    TransformerConfig (e.g. recompute settings).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = te_available() if use_te is None else use_te
    if use_te and not te_available():
        raise ValueError("use_te=True but Transformer Engine (or CUDA) is not available")
    tcfg = transformer_config(cfg, dtype, **config_overrides)
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_norm)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    model_cls = GPTModel
    if packed:
        from slipstream.engine.megatron.layers import HiddenStatesGPTModel, VarlenCoreAttention

        model_cls = HiddenStatesGPTModel
        if not use_te:  # TE's own core attention takes THD input already
            spec.submodules.self_attention.submodules.core_attention = VarlenCoreAttention
    rope, override_inv_freq = _rope_kwargs(cfg)
    model = model_cls(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        **rope,
    )
    if override_inv_freq:
        # RotaryEmbedding keeps inv_freq as a plain attribute (fp32) and builds its tables from
        # it lazily, so replacing it before the first forward gives our exact frequencies.
        assert isinstance(model.rotary_pos_emb.inv_freq, torch.Tensor)
        model.rotary_pos_emb.inv_freq = rope_inv_freq(cfg, model.rotary_pos_emb.inv_freq.device)
    return model


def load_megatron_state_dict(model: torch.nn.Module, mg_sd: Mapping[str, torch.Tensor]) -> None:
    """Copy a (this-rank) Megatron-named state dict into `model`; only `_extra_state` may be absent."""
    result = model.load_state_dict(dict(mg_sd), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        unexpected = result.unexpected_keys[:8]
        raise ValueError(f"weights do not match the model: missing {missing[:8]}, unexpected {unexpected}")


def megatron_shard(
    model: torch.nn.Module, hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron-named tensors of an HF-named full state dict (dtype kept, views)."""
    from megatron.core import parallel_state

    mg = hf_to_megatron(hf_sd, cfg, layout=detect_layout(model.state_dict()))
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        mg = shard_for_tp(mg, tp_size, parallel_state.get_tensor_model_parallel_rank(), cfg)
    return mg


def load_hf_weights(model: torch.nn.Module, hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Convert an HF-named full state dict, take this TP rank's shard, and load it into `model`."""
    params = next(model.parameters())
    mg = megatron_shard(model, hf_sd, cfg)
    load_megatron_state_dict(model, {k: v.to(params.device, params.dtype) for k, v in mg.items()})


def hf_state_dict(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named full weights of a TP=1 GPTModel (TP>1 needs an all-gather into `merge_tp` first)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ValueError("hf_state_dict handles TP=1; gather the TP shards and use convert.merge_tp")
    return megatron_to_hf(model.state_dict(), cfg)


__all__ = [
    "te_available",
    "init_model_parallel",
    "transformer_config",
    "build_gpt_model",
    "load_megatron_state_dict",
    "megatron_shard",
    "load_hf_weights",
    "hf_state_dict",
]
