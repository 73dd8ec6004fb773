"""The naive baseline: what a typical Hugging Face GRPO loop does with the same workload.

That loop (TRL-style) keeps bf16 parameters with AdamW, turns gradient checkpointing on,
groups a fixed number of sequences per micro-batch and right-pads them to the longest one,
materialises full (B, S, V) logits, upcasts them to float32 and takes log_softmax + gather.
Its real-token throughput (padding excluded) is the baseline slipstream's ">= 1.8x" goal is
measured against. The PPO-clip / token-mean loss below is written independently of
`slipstream.algo.losses`, so the tests' loss cross-check compares two implementations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.algo.losses import SpecLoss
from slipstream.batching.records import PackedBatch
from slipstream.bench import train_step as ts
from slipstream.bench.settings import CellSettings, NaiveSettings
from slipstream.bench.workloads import Workload, get_workload, synthetic_batch
from slipstream.models.config import ModelConfig
from slipstream.models.hf import config_to_hf, to_hf_state_dict
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.perf.flops import train_flops


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded (B, S) tensors of a few sequences, aligned like `PackedBatch` (t predicts targets[t])."""

    input_ids: torch.Tensor  # (B, S) int64, pad id after each sequence's end
    attention_mask: torch.Tensor  # (B, S) int64, 1 on real tokens
    targets: torch.Tensor  # (B, S) int64
    loss_mask: torch.Tensor  # (B, S) bool
    advantages: torch.Tensor  # (B, S) float32
    old_logprobs: torch.Tensor  # (B, S) float32

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> "PaddedBatch":
        return PaddedBatch(*(t.to(device, non_blocking=True) for t in (
            self.input_ids, self.attention_mask, self.targets, self.loss_mask, self.advantages, self.old_logprobs)))


def pad_sequences(batch: PackedBatch, seq_ids: Sequence[int], pad_id: int = 0) -> PaddedBatch:
    """Gather sequences `seq_ids` of a packed batch into right-padded rows (padding to the longest)."""
    if batch.old_logprobs is None:
        raise ValueError("the naive baseline needs batch.old_logprobs (use synthetic_batch)")
    cu = batch.cu_seqlens.tolist()
    lens = [cu[i + 1] - cu[i] for i in seq_ids]
    rows, width = len(seq_ids), max(lens)

    def gather(src: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((rows, width), fill, dtype=src.dtype)
        for r, i in enumerate(seq_ids):
            out[r, : lens[r]] = src[cu[i] : cu[i + 1]]
        return out

    attention_mask = gather(torch.ones_like(batch.input_ids), 0)
    return PaddedBatch(
        input_ids=gather(batch.input_ids, pad_id),
        attention_mask=attention_mask,
        targets=gather(batch.targets, 0),
        loss_mask=gather(batch.loss_mask, False),
        advantages=gather(batch.advantages, 0.0),
        old_logprobs=gather(batch.old_logprobs, 0.0),
    )


def build_hf_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, attn: str = "sdpa"):
    """An HF *ForCausalLM with the preset's architecture and random weights, built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy import, only when the baseline runs

    d = config_to_hf(cfg)
    d.pop("architectures")
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn, dtype=dtype)
    return model


def copy_native_weights(hf_model, native: Transformer) -> None:
    """Load a native model's weights into an HF model (through the hf adapter's names)."""
    sd = to_hf_state_dict(native.state_dict())
    missing, unexpected = hf_model.load_state_dict(sd, strict=False)
    # A tied head is one tensor in HF too; the native state dict simply does not list it.
    allowed_missing = {"lm_head.weight"} if native.cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"weights do not match: missing {missing}, unexpected {unexpected}")


def naive_loss(model, mb: PaddedBatch, num_loss_tokens: int, clip: float = 0.2) -> torch.Tensor:
    """PPO-clip loss of one padded micro-batch, token-mean over the whole minibatch's loss tokens."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    # The typical path: a full (B, S, V) float32 copy of the logits, then a second for log_softmax.
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - mb.old_logprobs)
    per_token = torch.maximum(-mb.advantages * ratio, -mb.advantages * ratio.clamp(1 - clip, 1 + clip))
    # Dividing by the global count (not this micro-batch's) makes the summed gradient a token mean.
    return torch.where(mb.loss_mask, per_token, 0.0).sum() / num_loss_tokens


def naive_micro_batches(batch: PackedBatch, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` sequences, in workload order (as a dataloader yields them)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    n = batch.num_seqs
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def bench_naive(
    workload: Workload | str,
    preset: str | None = None,
    micro_batch_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    gradient_checkpointing: bool = True,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    peak_flops: float | None = None,
    lr: float = 1e-6,
) -> dict:
    """Time the naive actor update (padded micro-batches + one AdamW step) on a workload; JSON-ready dict."""
    w = get_workload(workload, preset) if isinstance(workload, str) else workload
    if preset is not None and preset != w.preset:
        w = w.with_preset(preset)
    device = ts.resolve_device(device)
    cfg = get_preset(w.preset)
    torch.manual_seed(w.seed)
    model = build_hf_model(cfg, dtype, device)
    model.config.use_cache = False
    if gradient_checkpointing:
        # transformers 5.24 renamed gradient_checkpointing_enable (kept as a deprecated alias);
        # 5.17 only has the old name.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")

    batch = synthetic_batch(w, cfg.vocab_size)
    groups = naive_micro_batches(batch, micro_batch_size)
    padded = [pad_sequences(batch, g) for g in groups]
    num_loss_tokens = max(int(batch.loss_mask.sum()), 1)

    def actor_update() -> None:
        for mb in padded:
            naive_loss(model, mb.to(device), num_loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, peak = ts.repeat_timed(actor_update, device, repeats, warmup)
    lens = batch.seq_lens()
    padded_tokens = sum(mb.input_ids.numel() for mb in padded)
    result = {
        "kind": "naive_train_step",
        "workload": ts.workload_info(w, lens),
        "config": {
            "impl": "hf-naive", "micro_batch_size": micro_batch_size, "dtype": str(dtype).removeprefix("torch."),
            "params_dtype": str(dtype).removeprefix("torch."), "gradient_checkpointing": gradient_checkpointing,
            "attn_implementation": "sdpa", "repeats": repeats, "warmup": warmup, "device": str(device),
        },
        "micro_batches": {
            "count": len(padded),
            "num_seqs": [len(g) for g in groups],
            "real_tokens": [mb.num_real_tokens for mb in padded],
            "padded_tokens": [mb.input_ids.numel() for mb in padded],
            "padding_fraction": 1.0 - sum(lens) / padded_tokens,
        },
        "phases": {
            "actor_train": ts.phase_stats(times, train_flops(cfg, lens), sum(lens), peak, ts.peak_for(device, peak_flops)),
        },
        "env": ts.env_info(),
    }
    result["metrics"] = ts.perf_metrics(result["phases"])
    return result


def run_naive_cell(w: Workload, settings: CellSettings, naive: NaiveSettings) -> dict:
    """The naive loop as a matrix cell: gradient checkpointing follows the row's recompute setting."""
    checkpointing = settings.recompute != "none"
    r = bench_naive(
        w, micro_batch_size=naive.micro_batch_size, dtype=getattr(torch, settings.dtype),
        gradient_checkpointing=checkpointing, repeats=settings.repeats, warmup=settings.warmup,
        device=settings.device, peak_flops=settings.peak_flops,
    )  # fmt: skip
    mb, real = r["micro_batches"], r["workload"]["num_tokens"]
    return {
        "status": "ok",
        "phases": r["phases"],
        "micro_batches": {k: mb[k] for k in ("count", "num_seqs", "padded_tokens")},
        "fairness": {
            "engine": "plain PyTorch loop over an HF *ForCausalLM (no Trainer, no FSDP)",
            "processes": 1,
            "compile": "no",
            "dtype": settings.dtype,
            "params_dtype": f"{settings.dtype} parameters, gradients and AdamW state (no master copy)",
            "attention_kernel": "HF sdpa (padded rows, attention mask)",
            "recompute": "full (HF gradient checkpointing, every layer)" if checkpointing else "none",
            "real_tokens": real,
            "padded_tokens": sum(mb["padded_tokens"]),
            "padding_fraction": mb["padding_fraction"],
            "loss_normalisation": "PPO-clip, token-mean over the minibatch's loss tokens (global denominator)",
            "optimizer": f"torch AdamW lr=1e-6 ({settings.dtype} state), grad clip 1.0",
            "micro_batching": f"{naive.micro_batch_size} sequences per micro-batch in workload order, "
            f"{mb['count']} micro-batches, each padded to its longest sequence",
            "logprob_head": "full (B, S, V) logits, fp32 log_softmax + gather",
        },
        "impl": {"name": "hf-naive", "version": None, "config": r["config"]},
    }


def paired_models(w: Workload, seed: int = 0):
    """(cfg, native model, HF model with the same weights, the workload's batch), fp32 on the CPU."""
    cfg = get_preset(w.preset)
    native = Transformer(cfg)
    native.init_weights(seed)
    hf_model = build_hf_model(cfg, torch.float32, "cpu")
    copy_native_weights(hf_model, native)
    return cfg, native, hf_model, synthetic_batch(w, cfg.vocab_size)


def loss_cross_check(workload: Workload | str = "tiny", micro_batch_size: int = 3, seed: int = 0) -> dict[str, float]:
    """fp32 CPU losses of the naive path and slipstream's engine on the same batch and weights."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    cfg, native, hf_model, batch = paired_models(w, seed)
    num_loss_tokens = int(batch.loss_mask.sum())
    with torch.no_grad():
        naive = sum(
            float(naive_loss(hf_model, pad_sequences(batch, g), num_loss_tokens))
            for g in naive_micro_batches(batch, micro_batch_size)
        )
    engine = ts.build_engine_for_bench(native, "local", torch.device("cpu"), torch.float32)
    mbs = ts.plan_and_select(batch, cfg, max_tokens_per_mb=max(batch.seq_lens()) * 2)
    metrics = engine.forward_backward(mbs, SpecLoss(needs_entropy=False), max_response_len=w.response_len[1])
    assert math.isfinite(naive)
    return {"naive": naive, "slipstream": metrics["actor/pg_loss"], "num_loss_tokens": float(num_loss_tokens)}
