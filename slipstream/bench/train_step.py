"""`slipstream bench train-step`: time the actor update and the log-prob pass on a fixed workload.

Two phases are measured on the same planned micro-batches:
  actor_train  forward_backward over every micro-batch + ONE optim_step (one minibatch update)
  log_probs    forward_logprobs over the same micro-batches (old / ref log-prob recompute)
Each is timed as a whole (CUDA events around the phase; perf_counter on the CPU) over
`repeats` runs after `warmup` discarded ones. FLOPs follow docs/architecture.md#tokens-flops-and-mfu (perf.flops:
model FLOPs on real tokens, forward = train / 3), MFU uses the dense bf16 datasheet peak.
Peak memory is torch.cuda.max_memory_allocated after a reset at the start of each phase.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from slipstream.algo.losses import SpecLoss
from slipstream.batching.planner import quadratic_scale_for
from slipstream.batching.records import PackedBatch
from slipstream.bench.workloads import Workload, batch_from_lengths, get_workload, scaled, synthetic_batch
from slipstream.config.schema import ActorSection, parse_backend
from slipstream.engine.base import OutOfMemory
from slipstream.engine.distributed import rank as dist_rank
from slipstream.engine.distributed import world_size
from slipstream.batching.shard import local_micro_batches
from slipstream.engine.factory import build_engine
from slipstream.models.config import ModelConfig
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.perf.flops import forward_flops, train_flops
from slipstream.perf.mfu import device_peak_flops
from slipstream.perf.timers import repeat_timed, time_once

_GIB = float(2**30)
AC_MODES = ("none", "selective", "full")


# ---------------------------------------------------------------- environment and timing


def resolve_device(device: torch.device | str | None, backend: str = "local") -> torch.device:
    """None picks CUDA when present, else the CPU; under torchrun fsdp / megatron use GPU LOCAL_RANK."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        # Build the model on this rank's GPU, not on GPU 0 of every rank.
        distributed = parse_backend(backend)[0] in ("fsdp", "megatron")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if distributed else torch.cuda.current_device())
    return device


def git_commit() -> str | None:
    """HEAD of the checkout this package runs from, with "+modified" where its slipstream/ sources differ
    from HEAD (a copy whose git metadata is stale, as on the GPU machine, says so instead of naming a
    commit that did not run; SLIPSTREAM_GIT_COMMIT names the right one there). None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=here)

    try:
        head = git("rev-parse", "HEAD").stdout.strip()
        if not head:
            return None
        modified = git("diff", "--quiet", "HEAD", "--", os.path.dirname(here)).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+modified" if modified else "")


def env_info() -> dict:
    """Where and how a result was produced: device, library versions, git commit, command line."""
    import transformers  # imported here: only result writers need its version

    commit = os.environ.get("SLIPSTREAM_GIT_COMMIT") or git_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": commit,
        "command": command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def command_line() -> str:
    """This process's command; `python -m slipstream.cli ...` is recorded as the same `slipstream ...`."""
    cli = os.path.basename(sys.argv[0]) == "slipstream" or sys.argv[0].endswith(os.path.join("slipstream", "cli.py"))
    return " ".join(["slipstream", *sys.argv[1:]]) if cli else " ".join(sys.argv)


def peak_for(device: torch.device, override: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of the device (None on the CPU unless overridden)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return device_peak_flops(name, override)


def phase_stats(
    times: Sequence[float], flops: float, tokens: int, peak_bytes: int | None, peak_flops: float | None,
    num_gpus: int = 1,
) -> dict:
    """Median / min / max time, real tokens/s, TFLOP/s and MFU per GPU, peak memory (GiB)."""
    median = statistics.median(times)
    per_gpu_flops = flops / num_gpus / median
    return {
        "time_s": median,
        "time_min_s": min(times),
        "time_max_s": max(times),
        "times_s": list(times),
        "tokens": tokens,
        "flops": flops,
        "tok_per_s": tokens / num_gpus / median,
        "tflops": per_gpu_flops / 1e12,
        "mfu": per_gpu_flops / peak_flops if peak_flops else None,
        "peak_memory_gib": peak_bytes / _GIB if peak_bytes is not None else None,
    }


def perf_metrics(phases: dict[str, dict]) -> dict[str, float]:
    """The `perf/` names (docs/architecture.md#metrics) of the measured phases."""
    out = {}
    for name, p in phases.items():
        out[f"perf/{name}_time"] = p["time_s"]
        out[f"perf/{name}_tflops"] = p["tflops"]
        out[f"perf/{name}_tok_per_s"] = p["tok_per_s"]
        if p["mfu"] is not None:
            out[f"perf/{name}_mfu"] = p["mfu"]
        if p["peak_memory_gib"] is not None:
            out[f"perf/max_memory_allocated_gb/{name}"] = p["peak_memory_gib"]
    return out


def workload_info(w: Workload, lens: Sequence[int]) -> dict:
    """Workload fields plus its realised lengths."""
    return {**dataclasses.asdict(w), "num_seqs": len(lens), "num_tokens": sum(lens), "seq_lens": list(lens)}


# ---------------------------------------------------------------- engine and micro-batches


def build_engine_for_bench(
    model: Transformer,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    max_tokens_per_mb: int = 16384,
    activation_checkpointing: str = "none",
    compile: bool = False,
    master_dtype: str = "float32",
):
    """A trainable engine (AdamW, lr 1e-6) around `model`, built by the shared factory."""
    parse_backend(backend)  # ValueError naming the accepted forms
    if activation_checkpointing not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {activation_checkpointing!r}")
    actor = ActorSection(
        backend=backend, activation_checkpointing=activation_checkpointing, compile=compile,
        max_tokens_per_mb=max_tokens_per_mb, lr=1e-6, master_dtype=master_dtype,
    )  # fmt: skip
    return build_engine(model, device, dtype, temperature=1.0, actor=actor)


def plan_and_select(
    batch: PackedBatch, cfg: ModelConfig, max_tokens_per_mb: int, algorithm: str = "kk", engine=None
) -> list[PackedBatch]:
    """This rank's micro-batches under the shared planner, balanced over every data-parallel rank.

    Ranks of one tensor-parallel group (megatron t>1) must see the same data, so the plan is
    split over the engine's data-parallel ranks when it has them (`dp_rank` / `dp_size`).
    """
    rank, world = getattr(engine, "dp_rank", dist_rank()), getattr(engine, "dp_size", world_size())
    mbs, _ = local_micro_batches(
        batch, max_tokens_per_mb, planner=algorithm, rank=rank, world=world, quadratic_scale=quadratic_scale_for(cfg),
    )  # fmt: skip
    return mbs


def _build_model(cfg: ModelConfig, device: torch.device, seed: int) -> Transformer:
    # Built and initialised on the target device: an 8B fp32 model never visits host memory.
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(seed)
    return model


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the benchmarks


def bench_train_step(
    workload: Workload | str,
    backend: str = "local",
    max_tokens_per_mb: int = 16384,
    dtype: torch.dtype = torch.bfloat16,
    activation_checkpointing: str = "none",
    compile: bool = False,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    preset: str | None = None,
    planner: str = "kk",
    peak_flops: float | None = None,
    with_entropy: bool = False,
    seed: int = 0,
    master_dtype: str = "float32",
    scale: int = 1,
) -> dict:
    """Time one actor update and one log-prob pass of the workload; returns a JSON-ready dict.

    `scale=k` runs k times the workload's prompts (same length distribution), so that k ranks
    each get the work of one (weak scaling under torchrun).

    `master_dtype="bfloat16"` holds parameters, gradients and AdamW state in bf16 (8 B/param,
    stochastically rounded updates; engine/optim.py) instead of fp32 (16 B/param).
    """
    w = get_workload(workload, preset) if isinstance(workload, str) else workload
    if preset is not None and preset != w.preset:
        w = w.with_preset(preset)
    w = scaled(w, scale)
    device = resolve_device(device, backend)
    cfg = get_preset(w.preset)
    model = _build_model(cfg, device, seed)
    engine = build_engine_for_bench(
        model, backend, device, dtype, max_tokens_per_mb, activation_checkpointing, compile, master_dtype
    )
    device = engine.device  # the fsdp backend pins this rank's GPU
    batch = synthetic_batch(w, cfg.vocab_size)
    mbs = plan_and_select(batch, cfg, max_tokens_per_mb, planner, engine)
    # Pinned host memory lets the per-micro-batch copies overlap compute, as in training.
    if device.type == "cuda":
        mbs = [_pin(mb) for mb in mbs]
    loss_fn = SpecLoss(needs_entropy=with_entropy)
    max_response_len = w.response_len[1]
    last_metrics: dict[str, float] = {}

    def actor_update() -> None:
        last_metrics.update(engine.forward_backward(mbs, loss_fn, max_response_len=max_response_len))
        last_metrics.update(engine.optim_step())

    def log_probs() -> None:
        engine.forward_logprobs(mbs)

    lens = batch.seq_lens()
    tokens = sum(lens)
    peak = peak_for(device, peak_flops)
    train_times, train_peak = repeat_timed(actor_update, device, repeats, warmup)
    fwd_times, fwd_peak = repeat_timed(log_probs, device, repeats, warmup)
    # FLOPs and tokens of the whole minibatch, divided over the ranks: per-GPU rates.
    ranks = world_size()
    phases = {
        "actor_train": phase_stats(train_times, train_flops(cfg, lens), tokens, train_peak, peak, ranks),
        "log_probs": phase_stats(fwd_times, forward_flops(cfg, lens), tokens, fwd_peak, peak, ranks),
    }
    result = {
        "kind": "train_step",
        "workload": workload_info(w, lens),
        "config": {
            "impl": "slipstream", "backend": backend, "max_tokens_per_mb": max_tokens_per_mb,
            "dtype": str(dtype).removeprefix("torch."), "activation_checkpointing": activation_checkpointing,
            "compile": compile, "master_dtype": master_dtype, "planner": planner, "repeats": repeats, "warmup": warmup,
            "device": str(device), "num_ranks": ranks, "with_entropy": with_entropy, "peak_flops": peak,
        },  # fmt: skip
        "micro_batches": {
            "count": len(mbs),
            "tokens": [mb.num_tokens for mb in mbs],
            "num_seqs": [mb.num_seqs for mb in mbs],
        },
        "phases": phases,
        "train_metrics": {k: v for k, v in last_metrics.items() if k.startswith("actor/")},
        "env": env_info(),
    }
    result["metrics"] = perf_metrics(phases)
    engine = model = None  # free before _free(); closures above read these names
    _free(device)
    return result


def _pin(mb: PackedBatch) -> PackedBatch:
    pinned = {
        f.name: getattr(mb, f.name).pin_memory()
        for f in dataclasses.fields(mb)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return mb.with_(**pinned)


def memory_curve(
    preset: str,
    tokens_per_mb_list: Sequence[int],
    seq_len: int = 4096,
    backend: str = "local",
    dtype: torch.dtype = torch.bfloat16,
    activation_checkpointing: str = "none",
    compile: bool = False,
    device: torch.device | str | None = None,
    seed: int = 0,
    master_dtype: str = "float32",
) -> dict:
    """Peak memory of one fwd+bwd micro-batch of N tokens (sequences of `seq_len`) for each N.

    One optimizer step runs first so AdamW state exists, as in steady-state training; the
    peak therefore includes parameters, gradients and optimizer state. An N that runs out of
    memory is recorded as "oom" and larger N are skipped.
    """
    device = resolve_device(device, backend)
    cfg = get_preset(preset)
    model = _build_model(cfg, device, seed)
    max_n = max(tokens_per_mb_list)
    engine = build_engine_for_bench(model, backend, device, dtype, max_n, activation_checkpointing, compile, master_dtype)
    device = engine.device
    loss_fn = SpecLoss(needs_entropy=False)

    def one_micro_batch(n: int) -> PackedBatch:
        full, rest = divmod(n, seq_len)
        lens = [seq_len] * full + ([rest] if rest else [])
        # Half prompt, half response per sequence (prompt >= 1 token).
        return batch_from_lengths([(max(1, s // 2), s - max(1, s // 2)) for s in lens], cfg.vocab_size, seed=seed)

    # Warm-up step: allocates gradients and AdamW state.
    engine.forward_backward([one_micro_batch(min(seq_len, max_n))], loss_fn, max_response_len=seq_len)
    engine.optim_step()
    points = []
    failed = False
    for n in tokens_per_mb_list:
        if failed:
            points.append({"tokens": n, "status": "skipped", "peak_memory_gib": None})
            continue
        mb = one_micro_batch(n)
        try:
            seconds, peak = time_once(lambda: engine.forward_backward([mb], loss_fn, max_response_len=seq_len), device)
            points.append({"tokens": n, "status": "ok", "time_s": seconds,
                           "peak_memory_gib": peak / _GIB if peak is not None else None})  # fmt: skip
        except (torch.OutOfMemoryError, OutOfMemory):
            failed = True
            points.append({"tokens": n, "status": "oom", "peak_memory_gib": None})
        engine.optim_step()  # clears gradients (a step on random weights is harmless)
        _free(device)
    fits = [p["tokens"] for p in points if p["status"] == "ok"]
    result = {
        "kind": "memory_curve", "preset": preset, "seq_len": seq_len, "backend": backend,
        "dtype": str(dtype).removeprefix("torch."), "activation_checkpointing": activation_checkpointing,
        "master_dtype": master_dtype, "points": points, "largest_fitting_tokens": max(fits) if fits else None, "env": env_info(),
    }  # fmt: skip
    engine = model = None  # free before _free(); closures above read these names
    _free(device)
    return result


def logprob_memory_check(
    num_tokens: int = 65536,
    vocab_size: int = 151936,
    hidden_size: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    check_rows: int = 256,
    seed: int = 0,
    with_entropy: bool = False,
) -> dict:
    """Peak extra memory and time of fused linear -> log-prob (+ entropy) fwd+bwd at (num_tokens x vocab_size),
    after one untimed call at the same shapes.

    The naive path would hold (T, V) fp32 logits (plus their log_softmax); the fused op should
    need a small fraction of one such copy. `with_entropy` also returns the per-token entropy and
    puts it in the loss (what an entropy bonus or logging costs). The first `check_rows` log-probs
    (and entropies) are compared with a float64 reference so a fast but wrong kernel cannot pass.
    """
    from slipstream.ops.logprobs import linear_logprobs

    device = resolve_device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (0.02 * torch.randn(vocab_size, hidden_size, generator=gen, device=device)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen, device=device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    out: dict = {}

    def fwd_bwd() -> None:
        hidden.grad = weight.grad = None  # each call allocates its gradients, as the first one does
        logprobs, entropy = linear_logprobs(hidden, weight, targets, with_entropy=with_entropy)
        (logprobs.sum() + (entropy.sum() if with_entropy else 0.0)).backward()
        out["logprobs"], out["entropy"] = logprobs.detach(), entropy.detach() if with_entropy else None

    # the first call compiles the Triton kernels (seconds on a GPU): timed is the second, at the same shapes
    (seconds,), peak = repeat_timed(fwd_bwd, device, repeats=1, warmup=1)
    rows = min(check_rows, num_tokens)
    ref_logp = torch.log_softmax(hidden[:rows].detach().double() @ weight.detach().double().T, dim=-1)
    ref = ref_logp.gather(1, targets[:rows, None]).squeeze(1)
    max_err = float((out["logprobs"][:rows].double() - ref).abs().max())
    if with_entropy:
        ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
        max_err = max(max_err, float((out["entropy"][:rows].double() - ref_ent).abs().max()))
    logits_fp32 = num_tokens * vocab_size * 4
    result = {
        "kind": "logprob_memory", "num_tokens": num_tokens, "vocab_size": vocab_size, "hidden_size": hidden_size,
        "dtype": str(dtype).removeprefix("torch."), "with_entropy": with_entropy, "time_s": seconds,
        "max_abs_err_vs_fp64": max_err,
        "naive_logits_fp32_gib": logits_fp32 / _GIB,
        "extra_peak_gib": (peak - base) / _GIB if peak is not None else None,
    }  # fmt: skip
    hidden = weight = targets = out = None  # free before _free()
    _free(device)
    return result
