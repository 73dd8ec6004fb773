"""What a benchmark cell runs with: the settings dataclasses of a matrix spec and their choices.

A spec (spec.py reads one) names workloads, frameworks and backends; `CellSettings` is what every
cell shares, `TrlSettings` / `VerlSettings` how the peer cells drive their own frameworks, and
`RLStepSettings` the recipe of an rl-step matrix. Defaults live here, once; the peer adapters
import this module, never the runner (matrix.py), so the dependencies point one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.bench.workloads import Workload

FRAMEWORKS = ("slipstream", "naive", "trl", "verl")
"""naive: the plain HF training loop (naive.py), the baseline every peer is also measured against."""
BACKENDS = ("fsdp", "megatron")
SINGLE_ENGINE = {"naive": "torch", "trl": "accelerate"}
"""Frameworks with one engine: their one row per workload is labelled with what really runs (the naive
loop is plain PyTorch, TRL is transformers' Trainer on accelerate in one process, without FSDP)."""
RL_BACKENDS = ("local", "fsdp", "megatron")
MODES = ("train-step", "rl-step")  # rl-step: whole GRPO steps from a recipe, see rl_step.py
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bfloat16", "float32")
TRL_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")


@dataclass(frozen=True)
class CellSettings:
    """Everything held constant across the cells of a matrix."""

    mode: str = "train-step"
    """"train-step": the same pre-built batch through each framework's training step; "rl-step": whole
    GRPO steps from `rl_step.recipe` (only `device` and `peak_flops` below apply to it)."""
    dtype: str = "bfloat16"
    """Compute dtype: "bfloat16" or "float32"."""
    recompute: str = "none"
    """Activation recompute: "none", "selective" or "full" (HF peers only have "full")."""
    max_tokens_per_mb: int = 16384
    """slipstream's micro-batch token budget (peers use their own micro-batching, see `peers`)."""
    compile: bool = False
    """torch.compile slipstream's blocks."""
    master_dtype: str = "float32"
    """slipstream's parameters, gradients and AdamW state: "float32" (16 B/param) or "bfloat16" (8 B/param,
    stochastically rounded updates; fsdp cells only, Megatron keeps fp32 master weights). Peers keep their own."""
    repeats: int = 3
    """Timed repeats per phase, after `warmup` discarded ones."""
    warmup: int = 1
    planner: str = "kk"
    """slipstream's micro-batch planner ("kk" or "ffd")."""
    device: str | None = None
    """"cuda" / "cpu"; None picks CUDA when present."""
    peak_flops: float | None = None
    """Override of the dense bf16 peak used for MFU (None: datasheet value of the GPU)."""


@dataclass(frozen=True)
class TrlSettings:
    """How the TRL cell runs GRPOTrainer (its defaults unless the spec says otherwise)."""

    per_device_train_batch_size: int = 8
    """Sequences per TRL micro-batch (TrainingArguments default 8); 64 / this = accumulation steps."""
    loss_type: str = "dapo"
    """TRL loss_type; "dapo" (TRL's default) is a global token mean, like slipstream's token-mean."""
    gradient_checkpointing: str = "follow"
    """"follow" the held-constant recompute (none -> off, selective/full -> on), or "on" / "off"."""
    use_liger_kernel: bool = False
    """GRPOConfig.use_liger_kernel: Liger's Triton layer kernels (RMSNorm, SwiGLU, RoPE) patched into the model.
    TRL 1.16 refuses Liger's fused linear cross-entropy and keeps its own chunked LM head, so the full logits
    never exist either way. Needs `liger-kernel` and a GPU."""
    params_dtype: str | None = None
    """Dtype of TRL's parameters and AdamW state: None follows `dtype` (bf16 weights, as a bf16 checkpoint
    loads), "float32" keeps fp32 weights under bf16 autocast."""


@dataclass(frozen=True)
class NaiveSettings:
    """How the naive HF loop cuts its micro-batches (naive.py)."""

    micro_batch_size: int = 4
    """Sequences per padded micro-batch (padded to the longest of them)."""


@dataclass(frozen=True)
class VerlSettings:
    """How the verl cell runs verl's FSDP actor (peers/verl_adapter.py); verl's defaults unless noted."""

    attn_implementation: str = "sdpa"
    """The HF attention verl's model runs: "sdpa" (padded rows), or "torch_varlen" (peers/verl_varlen.py: verl's
    remove-padding varlen call on torch's bundled FlashAttention-2, where verl would call flash-attn, which
    cannot be built here)."""
    use_remove_padding: bool = False
    """verl's remove-padding path (its users' default): one packed row per micro-batch, varlen attention."""
    use_fused_kernels: bool = False
    """verl's fused LM head + log-prob / entropy kernels (no (B, S, V) logits); off by default in verl."""
    fused_kernels_backend: str = "torch"
    """verl's fused_kernel_options.impl_backend: "torch" (its default) or "triton" (CUDA only)."""
    strategy: str = "fsdp"
    """verl's FSDP engine version: "fsdp" (FSDP1, verl's default) or "fsdp2"."""
    use_dynamic_bsz: bool = True
    """Cut micro-batches by a real-token budget (verl's default is off: a fixed number of sequences)."""
    max_token_len_per_gpu: int | None = None
    """verl's ppo_max_token_len_per_gpu with dynamic bsz; None: the held-constant max_tokens_per_mb."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per micro-batch when use_dynamic_bsz is off."""
    use_torch_compile: bool = True
    """verl's actor / engine use_torch_compile (its default)."""
    site_dir: str | None = None
    """Site directory holding verl and its pinned packages (benchmarks/gpu_setup.sh); None: $SLIPSTREAM_VERL_SITE."""


@dataclass(frozen=True)
class RLStepSettings:
    """The recipe every rl-step cell runs, and how many steps are run and timed."""

    recipe: str
    """Recipe YAML (relative paths are read from the current directory, like `slipstream train`)."""
    steps: int
    """Steps per cell, warm-up included."""
    warmup_steps: int = 1
    """Leading steps left out of the statistics."""
    overrides: tuple[str, ...] = ()
    """Dotted `key=value` overrides applied on top of the recipe (same syntax as `slipstream train`)."""
    name: str = ""
    """Workload name in the results (default: the recipe's file stem)."""
    budgets: str | None = None
    """Per-sample max_new_tokens: "w1" = linspace(256, 3584) over the step's samples (W1's response lengths); None: the recipe's."""
    ignore_stop: bool = False
    """Sample every budget to its end (stop tokens ignored), as a throughput benchmark needs."""

    def sample_budgets(self, num_samples: int) -> list[int] | None:
        if self.budgets is None:
            return None
        if num_samples < 2:
            return [3584] * num_samples
        return [round(256 + i * (3584 - 256) / (num_samples - 1)) for i in range(num_samples)]


@dataclass(frozen=True)
class MatrixSpec:
    """A validated matrix: workloads x frameworks x backends under one `CellSettings`."""

    workloads: tuple[Workload, ...]
    frameworks: tuple[str, ...]
    backends: tuple[str, ...]
    settings: CellSettings = field(default_factory=CellSettings)
    trl: TrlSettings = field(default_factory=TrlSettings)
    verl: VerlSettings = field(default_factory=VerlSettings)
    naive: NaiveSettings = field(default_factory=NaiveSettings)
    on_error: str = "record"
    """"record": a cell that raises becomes an "error" row and the matrix goes on; "raise": stop."""
    rl_step: RLStepSettings | None = None
    """The recipe and step counts of an rl-step matrix (then `workloads` is this one entry); None for train-step."""

    def cells(self) -> list[tuple[Workload, str, str]]:
        """(workload, framework, backend) in run order: workload-major, in the spec's framework order."""
        return [(w, f, b) for w in self.workloads for f in self.frameworks for b in framework_backends(f, self.backends)]


def framework_backends(framework: str, backends: tuple[str, ...]) -> tuple[str, ...]:
    """The backends a framework's rows run on: the spec's, or the one engine it has (SINGLE_ENGINE)."""
    return (SINGLE_ENGINE[framework],) if framework in SINGLE_ENGINE else backends

