"""verl cell of the benchmark matrix: verl 0.9.1's own FSDP actor on the same batch, in a subprocess.

Why a subprocess: verl 0.9.1 pins transformers<5.11 and tensordict<=0.10 (slipstream runs
transformers 5.17 on the GPU machine, 5.24 here), so verl lives in its own site directory
(`benchmarks/gpu_setup.sh` builds it from wheels) named by `peers.verl.site_dir` or the
environment variable SLIPSTREAM_VERL_SITE. verl_runner.py runs with PYTHONPATH =
<site>:<stand-ins>:<slipstream>:<this checkout> and no other PYTHONPATH; slipstream's own cells never see it.

What is timed (verl_runner.py; CUDA events, warm-up discarded, peak memory reset per call):
  actor_train  RayPPOTrainer._update_actor's body without Ray: the rollout-shaped DataProto ->
               to_tensordict -> left_right_2_no_padding -> TrainingWorker.train_mini_batch, i.e.
               verl's engine micro-batching (dynamic bsz by default), per micro-batch padding to
               its longest sequence, forward, ppo_loss (token-mean), backward, then grad clip,
               optimizer and LR-scheduler step: one optimizer step over all sequences
               (ppo_mini_batch_size = num_prompts x rollout_n = the whole batch, ppo_epochs 1).
  log_probs    RayPPOTrainer._compute_old_log_prob's body: the same conversion ->
               TrainingWorker.infer_batch (log-probs and entropy, as verl's trainer asks for the
               old log-probs) -> no_padding_2_padding.
The host-to-device copies of each micro-batch happen inside verl's engine and are timed with it.

Configuration (recorded in the row's impl.config): verl's FSDP engine (strategy `fsdp` = FSDP1
by default, `fsdp2` via the spec), world size 1, fp32 master weights with FSDP MixedPrecision
bf16 params and bf16 autocast (verl's defaults), HF gradient checkpointing when recompute is not
"none". Attention, two configurations:
  - padded: attn_implementation=sdpa, use_remove_padding=False (verl's default without flash-attn);
  - remove-padding, as verl's users run it: use_remove_padding=True with attn_implementation
    "torch_varlen" (peers/verl_varlen.py), verl's own varlen call over one packed row served by
    torch's bundled FlashAttention-2 instead of flash-attn (which cannot be built here), and
    optionally use_fused_kernels (verl's fused LM head + log-prob / entropy, "torch" or "triton").
Without fused kernels, log-probs come from full logits (flash-attn's cross-entropy is absent, so
verl's log_softmax + gather fallback runs). AdamW lr 1e-6, wd 0.01, clip 1.0: verl's ppo_trainer.yaml.

Environment workarounds, all listed in the row (impl.workarounds):
  - import-only stand-ins (peers/standin.py, written into a temporary directory per run) for ray,
    uvicorn, fastapi and pydantic: verl imports them at module load (protocol.py, single_controller,
    checkpoint_engine -> rollout utils) but the timed path never calls them; any call or
    instantiation raises StandInUsed;
  - trl hidden from the verl process (verl pins trl==0.27 and only patches a critic-side class);
  - rollout skipped: the pre-built batch stands in for verl's rollout output; RayPPOTrainer's
    bodies are replayed without Ray (they only convert the batch and call the worker).
The Megatron backend is an explained row (MEGATRON_REASON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import slipstream.bench
from benchmarks.peers import PEERS, missing_result
from benchmarks.peers.standin import STANDINS, write_standin_site
from slipstream.bench import train_step as ts
from slipstream.bench.settings import CellSettings, VerlSettings
from slipstream.bench.workloads import Workload, seq_lens
from slipstream.models.presets import get_preset
from slipstream.perf.flops import forward_flops, train_flops

SITE_ENV = "SLIPSTREAM_VERL_SITE"
"""Environment variable naming verl's site directory when the spec's peers.verl.site_dir is unset."""
SLIPSTREAM_ROOT = Path(slipstream.bench.__file__).resolve().parents[2]
"""The directory holding the `slipstream` package (the repository, or site-packages when installed)."""
BENCHMARKS_ROOT = Path(__file__).resolve().parents[2]
"""The repository checkout holding `benchmarks/` (the verl runner and the stand-ins import from it)."""

MEGATRON_REASON = (
    "verl 0.9.1's Megatron engine cannot run on the GPU machine: MegatronEngine asserts use_mbridge=True and "
    "builds the model through Megatron-Bridge (verl.models.mcore.bridge.AutoBridge.to_megatron_provider), whose "
    "GPTModelProvider defaults to transformer_engine_layer_spec (Transformer Engine modules), with "
    "attention_backend=AttnBackend.flash set by verl; Transformer Engine is not installed there and cannot be "
    "carried. verl[megatron] also pins megatron-bridge==0.5.2, which PyPI does not have (0.5.1 needs "
    "transformers<5.9, flashinfer and nvidia-resiliency-ext)"
)
WORKAROUNDS = (
    "import-only stand-ins for ray, uvicorn, fastapi, pydantic (benchmarks/peers/standin.py, written to a "
    "temporary directory): imported at verl module load, never called on the timed path (a call raises)",
    "trl hidden from the verl process (verl 0.9.1 pins trl==0.27; it only patches a critic value-head class)",
    "rollout skipped: the pre-built batch stands in for verl's rollout output (left-padded prompts, right-padded "
    "responses)",
    "RayPPOTrainer._update_actor / _compute_old_log_prob bodies replayed without Ray on one in-process "
    "TrainingWorker (world size 1)",
)
TIMED = (
    "actor_train: DataProto -> left_right_2_no_padding -> TrainingWorker.train_mini_batch (engine micro-batches, "
    "ppo_loss, backward, clip, optimizer + LR step); log_probs: the same conversion -> TrainingWorker.infer_batch "
    "(log-probs + entropy) -> no_padding_2_padding"
)


def verl_configuration(settings: CellSettings, verl: VerlSettings, backend: str) -> dict:
    """The verl configuration the cell asks for, recorded in its row (the runner adds verl's resolved one)."""
    return {
        "engine": "megatron" if backend == "megatron" else "fsdp",
        **dataclasses.asdict(verl),
        "token_budget": verl.max_token_len_per_gpu or settings.max_tokens_per_mb,
        "dtype": settings.dtype,
        "gradient_checkpointing": settings.recompute != "none",
    }


def resolve_site(verl: VerlSettings) -> tuple[Path | None, str | None]:
    """(verl site directory, None) or (None, why there is none usable)."""
    raw = verl.site_dir or os.environ.get(SITE_ENV)
    if not raw:
        return None, f"no verl site directory: set peers.verl.site_dir in the spec or {SITE_ENV}"
    site = Path(raw).expanduser().resolve()
    if not (site / "verl" / "__init__.py").is_file():
        return None, f"verl site directory {site} has no verl package (verl/__init__.py)"
    return site, None


def runner_env(site: Path, standins: Path) -> dict[str, str]:
    """The subprocess environment: verl's site first, then the stand-ins, then slipstream and benchmarks/; no
    inherited PYTHONPATH."""
    env = dict(os.environ)
    roots = dict.fromkeys([str(SLIPSTREAM_ROOT), str(BENCHMARKS_ROOT)])  # one entry when slipstream is the checkout's
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(standins), *roots])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_runner(request: dict, site: Path) -> dict:
    """Run verl_runner in the verl environment; its JSON result. OOM raises torch.OutOfMemoryError."""
    with tempfile.TemporaryDirectory(prefix="slipstream-verl-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        standins = write_standin_site(Path(tmp) / "standins")
        cmd = [sys.executable, "-m", "benchmarks.peers.verl_runner", "--request", str(req), "--out", str(out)]
        proc = subprocess.run(cmd, env=runner_env(site, standins), cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            if "OutOfMemoryError" in proc.stderr:
                raise torch.OutOfMemoryError(f"verl runner ran out of device memory:\n{tail}")
            raise RuntimeError(f"verl runner failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def runner_request(w: Workload, settings: CellSettings, verl: VerlSettings) -> dict:
    """What the runner needs: the workload, the held-constant settings it honours, verl's settings."""
    return {
        "workload": dataclasses.asdict(w),
        "settings": {
            "dtype": settings.dtype, "recompute": settings.recompute, "repeats": settings.repeats,
            "warmup": settings.warmup, "device": settings.device, "max_tokens_per_mb": settings.max_tokens_per_mb,
        },
        "verl": {k: v for k, v in dataclasses.asdict(verl).items() if k != "site_dir"},
    }  # fmt: skip


def cell_result(w: Workload, settings: CellSettings, verl: VerlSettings, r: dict, site: Path) -> dict:
    """The matrix cell result (phases, fairness, impl) from the runner's raw times and layout."""
    cfg = get_preset(w.preset)
    lens = seq_lens(w)
    real = sum(lens)
    peak = ts.peak_for(torch.device(r["device"]), settings.peak_flops)
    mb = r["micro_batches"]
    padded = sum(mb["padded_tokens"])
    engine, optim = r["config"]["engine"], r["config"]["optim"]
    checkpointing = r["config"]["model"]["enable_gradient_checkpointing"]
    budget = r["config"]["actor"]["ppo_max_token_len_per_gpu"]
    cutting = (
        f"dynamic bsz, max_token_len_per_gpu={budget} real tokens" if verl.use_dynamic_bsz
        else f"{verl.micro_batch_size_per_gpu} sequences per micro-batch"
    )  # fmt: skip
    param_dtype = (engine["mixed_precision"] or {}).get("param_dtype", "bf16")
    strategy = r["config"]["actor"]["strategy"]
    engine_name = {"fsdp": "FSDP1", "fsdp2": "FSDP2"}.get(strategy, strategy)
    autocast = r["config"]["autocast_dtype"]  # verl skips autocast when it would be fp32
    return {
        "status": "ok",
        "phases": {
            "actor_train": ts.phase_stats(
                r["train_times_s"], train_flops(cfg, lens), real, r["train_peak_bytes"], peak
            ),
            "log_probs": ts.phase_stats(
                r["logprob_times_s"], forward_flops(cfg, lens), real, r["logprob_peak_bytes"], peak
            ),
        },
        "micro_batches": mb,
        "fairness": {
            "engine": f"verl {r['versions']['verl']} FSDP engine ({engine_name}), TrainingWorker",
            "processes": 1,
            "compile": f"verl use_torch_compile={verl.use_torch_compile} (its log-prob / entropy functions)",
            "dtype": settings.dtype,
            "params_dtype": f"{engine['model_dtype']} master weights, FSDP MixedPrecision {param_dtype} params, "
            + ("no autocast" if autocast == "torch.float32" else f"{autocast} autocast"),
            "attention_kernel": _attention_text(r["config"]["model"]["attn_implementation"], verl),
            "recompute": "full (HF gradient checkpointing, every layer)" if checkpointing else "none",
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_fraction": 1.0 - real / padded,
            "loss_normalisation": "verl ppo_loss token-mean: sum over response tokens / response tokens of the "
            "mini-batch (global batch_num_tokens)",
            "optimizer": f"{optim['optimizer']} lr={optim['lr']} betas=({optim['betas'][0]},{optim['betas'][1]}) "
            f"wd={optim['weight_decay']}, grad clip {optim['clip_grad']}, fp32 state",
            "micro_batching": f"{cutting}: {mb['count']} micro-batches, "
            + ("each one packed row (remove padding)" if verl.use_remove_padding else "each padded to its longest sequence")
            + "; timed with verl's own batch conversion and micro-batch planning (part of its trainer step; "
            "slipstream plans before its timed region, ~10 ms of host time on W1)",
            "logprob_head": (
                f"verl fused kernels ({verl.fused_kernels_backend} backend): log-probs and entropy from hidden states, "
                "no (B, S, V) logits" if verl.use_fused_kernels
                else "full (B, S, V) logits; log_softmax + gather (flash-attn cross-entropy absent); log_probs phase "
                "also computes entropy from the logits"
            ),
        },
        "impl": {
            "name": "verl",
            "version": r["versions"]["verl"],
            "versions": r["versions"],
            "site_dir": str(site),
            "config": {**verl_configuration(settings, verl, "fsdp"), "resolved": r["config"], "device": r["device"],
                       "repeats": settings.repeats, "warmup": settings.warmup},
            "timed": TIMED,
            "standins": list(STANDINS),
            "workarounds": list(WORKAROUNDS),
            "last_loss": r["last_update"]["loss"][-1],
        },
    }  # fmt: skip


def _attention_text(attn: str, verl: VerlSettings) -> str:
    if attn == "torch_varlen":
        return ("verl's remove-padding varlen call (cu_seqlens from position ids) on torch varlen_attn, torch's "
                "bundled FlashAttention-2, standing in for flash-attn (benchmarks/peers/verl_varlen.py)")  # fmt: skip
    layout = "one packed row" if verl.use_remove_padding else "padded rows, attention mask"
    return f"HF {attn} ({layout}; use_remove_padding={verl.use_remove_padding})"


def run_verl_cell(w: Workload, settings: CellSettings, verl: VerlSettings, backend: str) -> dict:
    """The matrix cell for verl: timed on the FSDP engine, explained for Megatron, "missing" without a site."""
    config = verl_configuration(settings, verl, backend)
    if backend == "megatron":
        return {"status": "not-available", "reason": MEGATRON_REASON, "impl": {"name": "verl", "config": config}}
    site, why = resolve_site(verl)
    if site is None:
        result = missing_result("verl", f"verl is not available: {why}. {PEERS['verl'].note}")
        return {**result, "impl": {"name": "verl", "version": None, "config": config, "standins": list(STANDINS)}}
    return cell_result(w, settings, verl, run_runner(runner_request(w, settings, verl), site), site)
