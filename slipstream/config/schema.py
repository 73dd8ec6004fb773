"""The one typed config tree of slipstream. Defaults live here and only here.

Every field carries a one-line docstring (the string right below it); `slipstream.config.docs`
turns them into docs/config.md, and a test keeps the two in sync.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelSection:
    """Which policy model to train and how to tokenize for it."""

    path: str | None = None
    """HF checkpoint directory (config.json + safetensors) or a .gguf file; None uses `preset` with random init."""
    preset: str = "tiny"
    """Named architecture with random weights, used when `path` is None (tiny, qwen3-0.6b, qwen3-1.7b, ...)."""
    tokenizer: str | None = None
    """Tokenizer directory or .gguf file; "char" builds the built-in character tokenizer; "ids:<V>" reads text as space-separated token ids (benchmarks); None: from `path`, else "char"."""
    use_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the actor; master weights and optimizer state are actor.master_dtype (float32 by default)."""
    init_seed: int = 0
    """Seed of the random initialisation of a preset."""


@dataclass
class DataSection:
    """Where prompts come from."""

    source: str = "task:sum-mod10"
    """"task:<name>" (built-in procedural task), "rg:<dataset>" or "rg:mix:<a>=<w>,<b>=<w>" (reasoning-gym), or a .jsonl / .parquet file or a `datasets` save_to_disk dir."""
    task_params: dict = field(default_factory=dict)
    """Keyword arguments of the procedural task (e.g. {digits: 2} for arithmetic; for rg:mix, one mapping per dataset name)."""
    num_task_prompts: int = 4096
    """How many prompts a procedural task generates per epoch."""
    prompt_key: str = "prompt"
    """Dotted path of the prompt field in a dataset row."""
    answer_key: str = "answer"
    """Dotted path of the ground-truth field in a dataset row."""
    split: str = "train"
    """Split to read from a `datasets` DatasetDict."""
    prompt_template: str | None = None
    """Template for text prompts: "{prompt}" is replaced by the prompt (other braces stay literal); None leaves them as they are."""
    on_error: Literal["skip", "raise"] = "skip"
    """What to do with a malformed row: report it with file and line, then skip it or stop."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the prompts."""
    max_prompt_length: int | None = None
    """Drop prompts longer than this many tokens (counted as data/filtered_prompts, eval sets: eval/<set>/filtered_prompts); prompts leaving no room for max_new_tokens in the model's context are dropped even when None."""


@dataclass
class RolloutSection:
    """Generation of completions."""

    engine: Literal["builtin"] = "builtin"
    """Rollout engine; "builtin" samples with the native model and a KV cache in the trainer's process."""
    prompts_per_step: int = 8
    """Prompts per RL step; each gets `group_size` completions."""
    group_size: int = 8
    """Completions per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by the same value when it computes log-probs."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables it)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 disables it)."""
    max_new_tokens: int = 16
    """Generation budget per completion."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (each must encode to a single token); the tokenizer's EOS always stops."""
    max_batch_size: int = 256
    """Most sequences decoded at once by the builtin engine (its KV cache slots; fewer when gpu_memory_fraction is reached)."""
    seed: int = 0
    """Seed of the sampler; with a prompt's position in the data stream and the sample index it decides every draw."""
    gpu_memory_fraction: float = 0.5
    """Share of the GPU memory free when the rollout sizes its KV cache (plus the cache it replaces) that the cache may take (CUDA)."""
    prefill_tokens: int = 16384
    """Most prompt tokens per prefill forward; longer prompts are prefilled in chunks."""
    decode_steps_per_sync: int = 16
    """Decode steps between two looks of the host at the sampled tokens (stop checks, slot reuse)."""
    overlap_decode: bool = True
    """Queue the next decode_steps_per_sync steps before the host looks at the last ones, so the device does not wait for the host (rows that stopped run on until the look after; a request admitted then is prefilled behind the queued steps)."""
    compile: bool = True
    """torch.compile the rollout's layer halves and sampler (CUDA only; the CPU runs eagerly)."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs, one per batch-size bucket (CUDA only)."""
    on_weight_update: Literal["keep", "reprefill"] = "keep"
    """async: samples in flight at a weight sync continue with their cached keys / values (keep) or with the prefix prefilled again by the new weights (reprefill)."""
    decode_attention: Literal["triton", "flash"] = "triton"
    """Decode attention kernel on CUDA: Triton split-K with GQA packing (needs triton), or FlashAttention's varlen forward."""
    decode_launch: str = "64,4,4,1,1"
    """Launch of the Triton decode-attention kernel as "block_n,num_warps,num_stages[,heads_first[,longest_first]]" (cache rows per iteration, a power of two; warps; pipeline stages; the kv heads of a sequence neighbours in the grid, 0/1; the longest sequences launched first, 0/1); omitted trailing keys keep these defaults (ops/decode_attention.py:LAUNCH)."""
    decode_programs_per_sm: int = 8
    """Split programs per SM the Triton decode kernel aims for: a sequence's context is split across programs until the batch fills the SMs this many times over (at most 16 splits)."""
    layer_kernels: bool = True
    """The element-wise work between each layer's GEMMs (q/k norm + RoPE + cache write, SiLU * up) in Triton kernels (CUDA, needs triton); false: the torch code of the layer halves, compiled with rollout.compile."""
    fused_lm_head: bool = False
    """Sample with the LM-head matmul inside the sampling kernel, never writing the logits (CUDA, no top-k / top-p); off by default: slower than the matmul and the one-pass sampler on the measured workload."""
    sleep_during_train: bool = True
    """Free the rollout's KV cache and weights while the trainer works (colocated): the weights are dropped, not moved to the host, and come back with the weight sync after the update; false keeps cache, weights and decode graphs (more memory, no re-allocation or graph capture each step)."""

    def __post_init__(self) -> None:
        from slipstream.ops.decode_launch import parse_launch  # torch-free: loading a config imports no torch

        try:
            parse_launch(self.decode_launch)
        except ValueError as err:
            raise ValueError(f"rollout.decode_launch: {err}") from None
        if self.decode_programs_per_sm < 1:
            raise ValueError(f"rollout.decode_programs_per_sm must be >= 1, got {self.decode_programs_per_sm}")


@dataclass
class RewardSection:
    """Scoring of completions."""

    functions: list[str] = field(default_factory=list)
    """Reward names (math, exact, format, countdown, rg) or custom "module:function" / "file.py:function"; empty: the task's own reward, or math for datasets."""
    weights: list[float] = field(default_factory=list)
    """One weight per function; empty means all 1.0."""
    num_workers: int = 1
    """Worker processes that run reward functions (0 runs them inline, without a timeout)."""
    timeout_s: float = 10.0
    """Per-call limit; a call that takes longer is stopped and scored `error_score`, and that function's other calls of the step are not run (a hanging function costs one timeout per step)."""
    on_error: Literal["zero", "raise"] = "zero"
    """A reward that raises or hangs: score `error_score` and log one line per step ("zero"), or stop the run ("raise")."""
    error_score: float = 0.0
    """Score given to a completion whose reward raised or timed out."""
    extract: Literal["auto", "tag", "boxed", "last_line", "last_number"] = "auto"
    """Where math, countdown and rg read the answer: the last <answer> tag, \\boxed{}, last line or last number; auto: tag, else boxed, else last line."""
    disable_after: int = 3
    """Disable a function that timed out on every call for this many steps in a row (it drops out of the sum, with a message; 0: never)."""


GROUP_ADVANTAGES = ("grpo", "rloo")
"""Estimators that compare the completions of one prompt: a group of one always gets advantage 0."""


@dataclass
class AlgoSection:
    """The RL objective: advantages and the policy loss."""

    advantage: Literal["grpo", "rloo", "reinforce"] = "grpo"
    """Advantage estimator."""
    std_normalize: bool = True
    """GRPO only: divide group-centred rewards by the group std (False = Dr.GRPO); other estimators ignore it with a warning."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (ratio <= 1 + clip_high); DAPO uses 0.28."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages; None disables it."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 builds no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator."""
    kl_clamp: float | None = 10.0
    """k3 only: clamp each token's KL value to [-kl_clamp, kl_clamp], zero gradient beyond (as verl does); without it a token with ref - logp = 23.5 adds e^20 - 21 = 4.85e8 and dominates the loss. None: no clamp."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (entropy is computed only when this is > 0 or it is logged)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced; always with the minibatch's global denominators."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per rollout batch (the batch is split into this many minibatches, groups kept whole)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    decoupled: bool | None = None
    """Decoupled PPO: the clip is anchored at the proximal policy (the current weights, old log-probs recomputed before each update) and the behaviour policy enters only through the capped weight pi_prox / pi_behav; None: on in async mode with trainer.max_staleness > 0, off otherwise (so async at max_staleness 0 is sync exactly)."""
    behav_is_cap: float | None = None
    """Cap of the importance weight pi_prox / pi_behaviour; None: 5.0 when decoupled, unused otherwise."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no advantage) and generate more prompts until the step's batch is full."""
    dynamic_sampling_max_prompts: int = 64
    """Most extra prompts drawn per step (and rank) for dynamic sampling; past it the step trains what it has."""


BACKENDS = ("local", "fsdp", "megatron")
_LAYOUT_RE = re.compile(r"(?:d(\d+))?(?:t(\d+))?(?:p(\d+))?(?:c(\d+))?")


@dataclass(frozen=True)
class MegatronLayout:
    """Parallel sizes of the megatron backend; `dp=None` means world size / (tp * pp * cp)."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def data_parallel_size(self, world_size: int) -> int:
        """D for this world size; ValueError when the sizes do not multiply to it."""
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"actor.backend asks for d{self.dp} but world size {world_size} / (tp*pp*cp = {model_parallel}) = {dp}"
            )
        return dp


def parse_backend(text: str) -> tuple[str, MegatronLayout | None]:
    """("local" | "fsdp" | "megatron", layout) from an actor.backend string such as "megatron:d2t4".

    The layout is None for local / fsdp. After "megatron:" each of d, t, p, c may appear once, in
    that order, followed by a positive integer.
    """
    name, sep, spec = text.partition(":")
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, BACKENDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"actor.backend must be local, fsdp, megatron or megatron:d<D>t<T>p<P>c<C>, got {text!r}{hint}")
    if name != "megatron":
        if sep:
            raise ValueError(f"actor.backend {name!r} takes no parallel sizes, got {text!r}")
        return name, None
    match = _LAYOUT_RE.fullmatch(spec)
    if sep and (not spec or match is None):
        raise ValueError(
            f"actor.backend {text!r}: expected megatron:d<D>t<T>p<P>c<C> (letters in that order, each optional, "
            f"each followed by a positive integer), e.g. megatron:t2 or megatron:d1t1p1c1"
        )
    sizes = [None if g is None else int(g) for g in (match.groups() if match else (None,) * 4)]
    if any(v is not None and v < 1 for v in sizes):
        raise ValueError(f"actor.backend {text!r}: parallel sizes must be >= 1")
    dp, tp, pp, cp = sizes
    return name, MegatronLayout(dp=dp, tp=tp or 1, pp=pp or 1, cp=cp or 1)


@dataclass
class ActorSection:
    """The policy update: backend, optimizer, micro-batching."""

    backend: str = "local"
    """Training backend: "local" (one process, CPU or one GPU), "fsdp" (FSDP2; N GPUs with torchrun) or "megatron[:d<D>t<T>]" (megatron-core; D data- and T tensor-parallel ranks, T defaults to 1, D to world / T; `slipstream train` runs D only, T runs under `slipstream bench train-step`). Pipeline / context sizes (p, c) are not wired yet and are rejected."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (attention / MLP inner ops) or full (every block)."""
    compile: bool = False
    """torch.compile each transformer block (fsdp backend)."""
    offload_params: bool = False
    """Keep actor parameters and optimizer state on the CPU between uses (FSDP2 CPUOffloadPolicy)."""
    offload_ref: bool = False
    """Keep the reference model on the CPU (by default it stays on the GPU when it fits)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the actor's parameters, gradients and AdamW state: float32 (16 B/param) or bfloat16 (8 B/param, updates stochastically rounded; needs model.dtype=bfloat16, local or fsdp backend)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up in optimizer steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch; a longer single sequence gets a micro-batch of its own."""
    planner: Literal["kk", "ffd"] = "kk"
    """Balanced partition used to cut minibatches into micro-batches."""
    logprob_chunk_size: int | None = None
    """Rows per chunk of the fused log-prob op; None picks it from a memory budget."""


@dataclass
class TrainerSection:
    """The run: length, seeds, device, checkpoints."""

    total_steps: int = 20
    """RL steps to run."""
    seed: int = 0
    """Global seed (torch, python, data order)."""
    device: str = "auto"
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda"."""
    run_dir: str = "runs/default"
    """Where the resolved config, metrics, checkpoints and the final HF export go."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end and on interruption)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    resume: bool = True
    """Continue from the newest checkpoint in run_dir when one exists (false refuses a run_dir that has checkpoints)."""
    export_hf: bool = True
    """Write the final policy as an HF checkpoint to run_dir/hf."""
    peak_flops: float | None = None
    """Override the device's dense bf16 peak FLOP/s used for MFU."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, then train, then sync weights; async: the rollout generates future steps' batches in a background thread while the trainer trains."""
    max_staleness: int = 1
    """async: a trained token was sampled at most this many policy versions (weight syncs) before the trainer's; 0 reproduces sync."""
    async_stream: bool = True
    """async on a GPU: the producer thread generates on a CUDA stream of its own, so decode and the trainer's passes can share the device; false queues both on the default stream."""
    stop_on_nan: bool = True
    """Stop when the loss or gradient norm is not finite (that optimizer step is skipped; the last checkpoint is the resume point)."""
    stall_dump_s: float = 600.0
    """When a step, an eval, a checkpoint or the HF export has run this many seconds, write the Python stack of every thread to run_dir/stacks.txt (stacks-rank<r>.txt on other trainer ranks) and warn, again every as many seconds while it lasts; the run goes on (0: off). `kill -USR1 <pid>` prints the stacks at any time (under torchrun: a rank's pid, not the launcher's)."""


@dataclass
class PlacementSection:
    """Where rollout and training run when several processes are launched (torchrun)."""

    rollout_ranks: int = 0
    """0: every rank generates its share and trains (colocated); R > 0: the last R ranks only generate and the others only train (disaggregated), weights broadcast after each step."""


@dataclass
class WandbSection:
    """Weights & Biases (`pip install wandb`); off unless enabled."""

    enabled: bool = False
    """Log every step's metrics to a W&B run (a resumed run continues the same W&B run)."""
    project: str = "slipstream"
    """W&B project."""
    name: str | None = None
    """W&B run name; None: the name of trainer.run_dir."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online (sync as the run goes), offline (files under run_dir/wandb, `wandb sync` later) or disabled."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass
class LoggingSection:
    """Where metrics go: run_dir/metrics.jsonl always, plus the console, TensorBoard and W&B."""

    log_every: int = 1
    """Print a console line every N steps."""
    tensorboard: bool = True
    """Also log to TensorBoard (run_dir/tb) when it is installed."""
    wandb: WandbSection = field(default_factory=WandbSection)
    """Weights & Biases."""


@dataclass
class EvalSetSection:
    """One eval set, `eval.sets.<name>`; its metrics are eval/<name>/..."""

    source: str | None = None
    """Data source as in data.source (task:..., rg:..., a file); None: data.source."""
    task_params: dict | None = None
    """Parameters of a procedural source; None: data.task_params when the source is data.source, else none."""
    size: int = 200
    """Distinct problems in the set; a procedural source with fewer distinct problems gives all it has (not held out)."""
    seed: int = 1
    """Seed of the set's draws: procedural sources draw from their own seed range, files take `size` rows in this seeded order."""
    prompt_template: str | None = None
    """Template of the set's prompts; None: data.prompt_template."""
    reward: list[str] = field(default_factory=list)
    """Reward that decides correctness; empty: the source task's own (rg, math, exact, countdown), math for files."""
    extract: Literal["auto", "tag", "boxed", "last_line", "last_number"] | None = None
    """Where the set's reward reads the answer; None: reward.extract (two sets of one seed score the same problems two ways)."""


@dataclass
class EvalSection:
    """Held-out evaluation on the rollout engine: before training, every N steps and at the end."""

    sets: dict[str, EvalSetSection] = field(default_factory=dict)
    """Eval sets by name; each problem is also kept out of the training stream (by a hash of its prompt)."""
    every_steps: int = 0
    """Evaluate after every N training steps (0: only before training and after the last step)."""
    before_training: bool = True
    """Evaluate the initial policy before the first step (the baseline)."""
    greedy: bool = True
    """One greedy completion per problem: eval/<set>/accuracy."""
    n: int = 0
    """Sampled completions per problem (0: none): eval/<set>/mean@n, pass@k, maj@n."""
    pass_k: list[int] = field(default_factory=list)
    """k of eval/<set>/pass@k (unbiased estimator, each 1 <= k <= n); empty: 1 and n."""
    temperature: float | None = None
    """Temperature of the n sampled completions; None: rollout.temperature."""
    max_new_tokens: int | None = None
    """Generation budget of eval completions; None: rollout.max_new_tokens."""
    correct_threshold: float = 1.0
    """A completion counts as correct when its eval reward is at least this."""


@dataclass
class Config:
    """A whole slipstream run."""

    model: ModelSection = field(default_factory=ModelSection)
    """The policy model."""
    data: DataSection = field(default_factory=DataSection)
    """The prompts."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Generation."""
    reward: RewardSection = field(default_factory=RewardSection)
    """Scoring."""
    algo: AlgoSection = field(default_factory=AlgoSection)
    """The RL objective."""
    actor: ActorSection = field(default_factory=ActorSection)
    """The policy update."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """The run."""
    placement: PlacementSection = field(default_factory=PlacementSection)
    """Rollout / trainer placement over processes."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    """Metric sinks."""
    eval: EvalSection = field(default_factory=EvalSection)
    """Held-out evaluation."""

    def __post_init__(self) -> None:
        check_config(self)


def check_config(cfg: Config) -> None:
    """Cross-field checks; raise ValueError naming the keys involved."""
    r, a, rw = cfg.rollout, cfg.algo, cfg.reward
    # Range checks by bound; None means "not set" for the optional fields and is skipped.
    bounds = {
        ">= 1": (lambda v: v >= 1, {
            "rollout.prompts_per_step": r.prompts_per_step,
            "rollout.group_size": r.group_size,
            "rollout.max_new_tokens": r.max_new_tokens,
            "rollout.max_batch_size": r.max_batch_size,
            "rollout.prefill_tokens": r.prefill_tokens,
            "rollout.decode_steps_per_sync": r.decode_steps_per_sync,
            "algo.ppo_n_minibatches": a.ppo_n_minibatches,
            "algo.ppo_epochs": a.ppo_epochs,
            "actor.max_tokens_per_mb": cfg.actor.max_tokens_per_mb,
            "actor.logprob_chunk_size": cfg.actor.logprob_chunk_size,
            "trainer.total_steps": cfg.trainer.total_steps,
            "trainer.keep_last": cfg.trainer.keep_last,
            "logging.log_every": cfg.logging.log_every,
            "data.num_task_prompts": cfg.data.num_task_prompts,
            "data.max_prompt_length": cfg.data.max_prompt_length,
            "eval.max_new_tokens": cfg.eval.max_new_tokens,
        }),
        ">= 0": (lambda v: v >= 0, {
            "reward.num_workers": rw.num_workers,
            "reward.disable_after": rw.disable_after,
            "rollout.top_k": r.top_k,
            "algo.kl_coef": a.kl_coef,
            "algo.entropy_coef": a.entropy_coef,
            "actor.weight_decay": cfg.actor.weight_decay,
            "actor.warmup_steps": cfg.actor.warmup_steps,
            "actor.grad_clip": cfg.actor.grad_clip,
            "trainer.save_every": cfg.trainer.save_every,
            "trainer.max_staleness": cfg.trainer.max_staleness,
            "trainer.stall_dump_s": cfg.trainer.stall_dump_s,
            "placement.rollout_ranks": cfg.placement.rollout_ranks,
            "algo.dynamic_sampling_max_prompts": a.dynamic_sampling_max_prompts,
            "eval.every_steps": cfg.eval.every_steps,
            "eval.n": cfg.eval.n,
        }),
        "> 0": (lambda v: v > 0, {
            "actor.lr": cfg.actor.lr,
            "actor.eps": cfg.actor.eps,
            "algo.behav_is_cap": a.behav_is_cap,
            "algo.kl_clamp": a.kl_clamp,
            "trainer.peak_flops": cfg.trainer.peak_flops,
        }),
    }  # fmt: skip
    for bound, (ok, values) in bounds.items():
        for key, value in values.items():
            if value is not None and not ok(value):
                raise ValueError(f"{key} must be {bound}, got {value}")
    if r.temperature <= 0:
        raise ValueError(f"rollout.temperature must be > 0, got {r.temperature}")
    if not 0 < r.gpu_memory_fraction < 1:
        raise ValueError(f"rollout.gpu_memory_fraction must be in (0, 1), got {r.gpu_memory_fraction}")
    if not 0 < r.top_p <= 1:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if r.group_size < 2 and a.advantage in GROUP_ADVANTAGES:
        raise ValueError(
            f"rollout.group_size={r.group_size} with algo.advantage={a.advantage}: its advantages compare the "
            "completions of one prompt, so a group of one always gets 0 and nothing is learned; set "
            "rollout.group_size >= 2, or algo.advantage=reinforce (a batch-mean baseline, no groups needed)"
        )
    if r.prompts_per_step % a.ppo_n_minibatches:
        raise ValueError(
            f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by "
            f"algo.ppo_n_minibatches={a.ppo_n_minibatches} (groups are never split across minibatches)"
        )
    if not 0 <= a.clip_low < 1 or a.clip_high < 0:
        raise ValueError(f"algo.clip_low must be in [0, 1) and algo.clip_high >= 0, got {a.clip_low}, {a.clip_high}")
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        raise ValueError(f"algo.dual_clip_c must be > 1 when set, got {a.dual_clip_c}")
    if rw.weights and len(rw.weights) != len(rw.functions):
        raise ValueError(
            f"reward.weights has {len(rw.weights)} entries for {len(rw.functions)} reward.functions"
        )
    if rw.timeout_s <= 0:
        raise ValueError(f"reward.timeout_s must be > 0, got {rw.timeout_s}")
    layout = parse_backend(cfg.actor.backend)[1]
    if layout is not None and (layout.pp > 1 or layout.cp > 1):
        raise ValueError(
            f"actor.backend={cfg.actor.backend!r}: pipeline (p) and context (c) parallelism are not wired into the "
            "megatron engine yet; use megatron:d<D>t<T>"
        )
    if cfg.actor.master_dtype == "bfloat16":
        if cfg.model.dtype != "bfloat16":
            raise ValueError("actor.master_dtype=bfloat16 needs model.dtype=bfloat16 (bf16 weights cannot compute in float32)")
        if parse_backend(cfg.actor.backend)[0] == "megatron":
            raise ValueError(
                "actor.master_dtype=bfloat16 is not available on the megatron backend (its distributed optimizer keeps "
                "fp32 master weights); use actor.backend=fsdp or local, or master_dtype=float32"
            )
    if len(cfg.actor.betas) != 2:
        raise ValueError(f"actor.betas must have two values, got {cfg.actor.betas}")
    check_eval(cfg)
    if cfg.trainer.device not in ("auto", "cpu", "cuda") and not cfg.trainer.device.startswith("cuda:"):
        raise ValueError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {cfg.trainer.device!r}")


def check_eval(cfg: Config) -> None:
    """The eval section's cross-field checks."""
    ev = cfg.eval
    for name, spec in ev.sets.items():
        if not name or "/" in name:
            raise ValueError(f"eval.sets: a set's name becomes a metric key eval/<name>/...; {name!r} must be non-empty without '/'")
        if spec.size < 1:
            raise ValueError(f"eval.sets.{name}.size must be >= 1, got {spec.size}")
    if ev.sets and not ev.greedy and ev.n == 0:
        raise ValueError("eval.greedy=false and eval.n=0 leave nothing to evaluate: set eval.greedy=true or eval.n > 0")
    if ev.pass_k and ev.n == 0:
        raise ValueError(f"eval.pass_k={ev.pass_k} needs sampled completions: set eval.n >= {max(ev.pass_k)}")
    bad = [k for k in ev.pass_k if not 1 <= k <= ev.n]
    if bad:
        raise ValueError(f"eval.pass_k entries must be in 1..eval.n={ev.n}, got {bad}")
    if ev.temperature is not None and ev.temperature <= 0:
        raise ValueError(f"eval.temperature must be > 0 (greedy is eval.greedy), got {ev.temperature}")
