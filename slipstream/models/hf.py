"""Hugging Face interop: config translation, state-dict adapter, checkpoint load/save.

Native parameter names are the HF names without the leading "model." (the LM head keeps
its name). The adapter below is the only place that knows this, so a future rename of
native modules only has to touch `to_hf_name` / `from_hf_name`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from slipstream.models.config import ModelConfig
from slipstream.models.transformer import Transformer

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------- config


def config_from_hf(d: dict) -> ModelConfig:
    """Build a ModelConfig from an HF config.json dict (transformers v4 or v5 rope layout)."""
    family = d.get("model_type")
    if family not in _ARCHITECTURES:
        raise ValueError(f"unsupported model_type {family!r}; expected one of {list(_ARCHITECTURES)}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only silu (SwiGLU) is implemented")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported by the native model")
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
    # transformers v5 nests theta and scaling in `rope_parameters`; v4 keeps them top level.
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    num_heads = d["num_attention_heads"]
    return ModelConfig(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rope_theta=float(theta),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        # HF Qwen2 always has q/k/v biases, whatever its config says.
        attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        rope_scaling=scaling,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """config.json dict that transformers (v4.56+ and v5) loads into the matching *ForCausalLM."""
    if cfg.family == "qwen2" and not cfg.attention_bias:
        raise ValueError("HF Qwen2 always has q/k/v biases; a qwen2 config needs attention_bias=True")
    if cfg.qk_norm != (cfg.family == "qwen3"):
        raise ValueError(f"qk_norm={cfg.qk_norm} cannot be expressed for HF family {cfg.family!r}")
    d = {
        "architectures": [_ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Legacy top-level rope keys: v4 reads them directly, v5 folds them into rope_parameters.
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.family in ("qwen2", "qwen3"):
        d["use_sliding_window"] = False
    if cfg.family in ("qwen3", "llama"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.family == "llama":
        d["mlp_bias"] = False
    if dtype is not None:
        d["torch_dtype"] = _DTYPE_NAMES[dtype]
    return d


# ---------------------------------------------------------------------------- state dict


def to_hf_name(name: str) -> str:
    """Native parameter name -> HF name."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def from_hf_name(name: str) -> str:
    """HF parameter name -> native name."""
    if name.startswith("lm_head."):
        return name
    if not name.startswith("model."):
        raise ValueError(f"unexpected HF parameter name {name!r} (expected 'model.' or 'lm_head.' prefix)")
    return name[len("model."):]


def to_hf_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a native state dict to HF names (tensors are shared, not copied)."""
    return {to_hf_name(k): v for k, v in sd.items()}


def from_hf_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """Rename an HF state dict to native names, dropping rotary buffers (and the tied head if cfg is tied)."""
    out = {from_hf_name(k): v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg is not None and cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # HF state dicts list the tied head as its own entry
    return out


def iter_hf_weights(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs of a native model, as a rollout engine's update_weights expects."""
    for name, tensor in model.state_dict().items():
        yield to_hf_name(name), tensor


def model_from_hf(
    hf_config: dict,
    hf_state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[Transformer, ModelConfig]:
    """Native model from an HF config dict and HF-named state dict (built on meta, then adopted)."""
    cfg = config_from_hf(hf_config)
    sd = from_hf_state_dict(hf_state_dict, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match its config: missing {missing[:8]}, unexpected {unexpected[:8]}")
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    # assign=True adopts the loaded tensors as the parameters: no second copy of the weights.
    model.load_state_dict(sd, strict=True, assign=True)
    return model, cfg


# ---------------------------------------------------------------------------- load


def _find_gguf(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several .gguf files ({[f.name for f in found]}); pass one file")
        return found[0] if found else None
    return None


def load_pretrained(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[Transformer, ModelConfig]:
    """Load a native model from an HF safetensors directory or a .gguf file (dequantised)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    gguf = _find_gguf(path)
    if gguf is not None:
        return model_from_hf(*read_gguf(gguf), dtype=dtype, device=device)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has neither config.json nor a .gguf file")
    hf_config = json.loads((path / "config.json").read_text())
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text())
        shards = sorted(set(index["weight_map"].values()))
    elif (path / SINGLE_FILE).exists():
        shards = [SINGLE_FILE]
    else:
        raise ValueError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}")
    hf_sd: dict[str, torch.Tensor] = {}
    for shard in shards:
        hf_sd.update(load_file(path / shard, device="cpu"))
    return model_from_hf(hf_config, hf_sd, dtype=dtype, device=device)


def read_gguf(file: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """HF config dict and HF-named fp32 state dict of a .gguf file, dequantised by transformers.

    This is the conversion `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs
    internally (metadata -> config, dequantise, undo llama.cpp's q/k row permutation),
    called directly so that neither `accelerate` nor a full HF model in memory is needed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy imports, only on this path
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    file = Path(file)
    _check_gguf(file)
    hf_config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    # The converter maps GGUF tensor names by walking a model's parameter names; a meta
    # skeleton provides them without allocating weights.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=skeleton)
    tensors = {k: torch.as_tensor(v).float() for k, v in parsed["tensors"].items()}
    return hf_config.to_dict(), tensors


def _check_gguf(file: Path) -> None:
    """ValueError naming `file` unless its header, metadata and tensor table read whole.

    A file cut short (an interrupted download or copy) otherwise surfaces as a bare
    `struct.error` or a numpy reshape error from deep inside the reader.
    """
    from gguf import GGUFReader

    try:
        GGUFReader(file)  # memory-maps the tensor data: its size is checked, nothing is copied
    except (struct.error, ValueError) as err:
        raise ValueError(
            f"{file}: not a readable GGUF file (truncated or corrupt: {err}; {file.stat().st_size} bytes on disk)"
        ) from None


# ---------------------------------------------------------------------------- save


def _shard(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_pretrained(
    model: Transformer | dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
    tokenizer=None,
    overwrite: bool = True,
) -> Path:
    """Write config.json + safetensors (sharded with an index past max_shard_bytes), atomically.

    Accepts a model or a native-named (full, unsharded) state dict. Everything is written to
    a temporary sibling directory first and renamed into place, so readers never see a
    half-written checkpoint; an existing out_dir is replaced whole (unless overwrite=False).
    A tokenizer, if given, is saved into the same directory before the swap.
    """
    out_dir = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists; pass overwrite=True to replace it")
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tensors = {}
    for name, t in to_hf_state_dict(sd).items():
        t = t.detach().to("cpu", dtype=dtype or t.dtype)
        tensors[name] = t.contiguous()
    out_dtype = dtype or next(iter(tensors.values())).dtype

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, out_dtype), indent=2))
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_FILE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / fname, metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if out_dir.exists():
            # Move the old copy aside first so the rename below is the only visible switch.
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_hf_weights_into(model: Transformer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors into a native model in place; returns the native names updated."""
    params = model.state_dict()
    updated = set()
    with torch.no_grad():
        for hf_name, tensor in named_tensors:
            name = from_hf_name(hf_name)
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"unknown weight {hf_name!r} for a {model.cfg.family} model")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            updated.add(name)
    return updated


__all__ = [
    "config_from_hf",
    "config_to_hf",
    "to_hf_name",
    "from_hf_name",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "iter_hf_weights",
    "load_pretrained",
    "model_from_hf",
    "read_gguf",
    "save_pretrained",
    "load_hf_weights_into",
]
