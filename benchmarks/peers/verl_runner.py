"""The verl side of the matrix's verl cell: run in a subprocess whose sys.path starts with verl's site.

`python -m benchmarks.peers.verl_runner --request REQ.json --out OUT.json`, started by
verl_adapter.run_verl_cell with PYTHONPATH = <verl site dir>:<stand-ins dir>:<repo root>, so
`transformers` here is the site's 5.10 (verl 0.9.1 pins <5.11) while slipstream's own cells keep
theirs. From slipstream this module imports only torch-level code (workloads, presets, the HF
config dict); verl is imported inside functions, so the layout code below is importable and
testable without verl.

What runs (verl 0.9.1 has no DataParallelPPOActor any more: its trainer drives a TrainingWorker
around an engine):
  - a random-weight HF *ForCausalLM of the preset (seeded like the TRL cell) saved to a temporary
    directory, which verl's FSDP engine loads itself (from_pretrained, fp32 master weights, FSDP
    MixedPrecision bf16 params + autocast, HF gradient checkpointing when recompute != none);
  - the actor the way ActorRolloutRefWorker.init_model builds it: FSDPActorConfig ->
    TrainingWorkerConfig -> TrainingWorker(...).reset() with loss partial(ppo_loss, config=actor);
  - actor_train = RayPPOTrainer._update_actor's body: DataProto (left-padded prompts, right-padded
    responses, as verl's rollout returns them) -> to_tensordict -> left_right_2_no_padding ->
    TrainingWorker.train_mini_batch (one mini-batch of all sequences, one optimizer step);
  - log_probs = RayPPOTrainer._compute_old_log_prob's body: the same conversion ->
    TrainingWorker.infer_batch (with entropy, as verl's trainer asks) -> no_padding_2_padding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
from functools import partial

import torch

from slipstream.batching.records import PackedBatch
from slipstream.bench.workloads import Workload, synthetic_batch
from slipstream.models.config import ModelConfig
from slipstream.models.hf import config_to_hf
from slipstream.models.presets import get_preset
from slipstream.perf.timers import repeat_timed

HIDDEN_MODULES = ("trl", "kernels")
"""Hidden from verl in the subprocess: verl 0.9.1 pins trl==0.27 and, if trl is importable, patches
trl's value-head class (critic only) with an import that trl 1.x (slipstream's TRL cell) lacks; the
site's transformers 5.10 registers hub kernels at import when `kernels` is importable, and
kernels >= 0.19 rejects its registrations (no revision given)."""


# ---------------------------------------------------------------- layout (no verl needed)


def verl_rollout_tensors(batch: PackedBatch, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """The padded tensors verl's rollout hands to the trainer, for the sequences of a packed batch.

    prompts (B, P) left-padded, responses (B, R) right-padded, input_ids = [prompts | responses],
    attention_mask over both, position_ids = cumsum(mask) - 1 clipped at 0 (verl's
    compute_position_id_with_mask), response_mask (B, R), and per response token its old
    log-prob and advantage, read at the packed position that predicts it (position t predicts
    targets[t]). P and R are the longest prompt and response of the batch.
    """
    if batch.old_logprobs is None:
        raise ValueError("verl_rollout_tensors needs batch.old_logprobs (use synthetic_batch)")
    cu = batch.cu_seqlens.tolist()
    spans = []  # (start, prompt length, end) per sequence
    for i in range(batch.num_seqs):
        lo, hi = cu[i], cu[i + 1]
        loss_pos = batch.loss_mask[lo:hi].nonzero().flatten()
        assert loss_pos.numel() > 0, "every sequence of a bench batch has a response"
        spans.append((lo, int(loss_pos[0]) + 1, hi))  # the first loss position is the last prompt token
    num_seqs = len(spans)
    max_prompt = max(p for _, p, _ in spans)
    max_response = max(hi - lo - p for lo, p, hi in spans)
    prompts = torch.full((num_seqs, max_prompt), pad_token_id, dtype=torch.long)
    responses = torch.full((num_seqs, max_response), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(num_seqs, max_prompt, dtype=torch.long)
    response_mask = torch.zeros(num_seqs, max_response, dtype=torch.long)
    old = torch.zeros(num_seqs, max_response, dtype=torch.float32)
    advantages = torch.zeros(num_seqs, max_response, dtype=torch.float32)
    for i, (lo, p, hi) in enumerate(spans):
        r = hi - lo - p
        prompts[i, max_prompt - p :] = batch.input_ids[lo : lo + p]
        prompt_mask[i, max_prompt - p :] = 1
        responses[i, :r] = batch.input_ids[lo + p : hi]
        response_mask[i, :r] = 1
        old[i, :r] = batch.old_logprobs[lo + p - 1 : hi - 1]
        advantages[i, :r] = batch.advantages[lo + p - 1 : hi - 1]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "old_log_probs": old,
        "advantages": advantages,
    }


# ---------------------------------------------------------------- the verl process


def _hide_modules() -> None:
    """Make HIDDEN_MODULES look not installed: `import` raises and importlib.util.find_spec says None.

    A None entry in sys.modules is Python's own "not importable" marker, which both honour.
    """
    for name in HIDDEN_MODULES:
        sys.modules[name] = None  # type: ignore[assignment]


def _init_single_process_group(device: torch.device) -> None:
    """World size 1, as verl's Worker expects it from its launcher (env vars + default group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # verl's own initialize_global_process_group_ray uses the same "cpu:gloo,cuda:nccl" backend.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend, rank=0, world_size=1)


def save_random_model(cfg: ModelConfig, out_dir: str, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """A random-weight HF checkpoint of the preset (weights do not change FLOPs or shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = config_to_hf(cfg)
    d.pop("architectures")
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    model.save_pretrained(out_dir)
    del model


def _mixed_precision(dtype: str) -> dict[str, str] | None:
    # None is verl's default: bf16 params in FSDP's MixedPrecision, fp32 reduce and buffers.
    return None if dtype == "bfloat16" else {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def build_actor(model_dir: str, w: Workload, settings: dict, verl: dict):
    """(TrainingWorker, FSDPActorConfig) built as ActorRolloutRefWorker.init_model builds the actor."""
    from verl.workers.config import (
        FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig,
    )  # fmt: skip
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    model_config = HFModelConfig(
        path=model_dir, load_tokenizer=False, use_remove_padding=verl["use_remove_padding"],
        override_config={"attn_implementation": verl["attn_implementation"]},
        enable_gradient_checkpointing=settings["recompute"] != "none",
        use_fused_kernels=verl["use_fused_kernels"], fused_kernel_options={"impl_backend": verl["fused_kernels_backend"]},
    )  # fmt: skip
    token_budget = verl["max_token_len_per_gpu"] or settings["max_tokens_per_mb"]
    actor = FSDPActorConfig(
        strategy=verl["strategy"], rollout_n=w.group_size,
        ppo_mini_batch_size=w.num_prompts,  # in prompts; the trainer multiplies it by rollout_n
        use_dynamic_bsz=verl["use_dynamic_bsz"], ppo_max_token_len_per_gpu=token_budget,
        ppo_micro_batch_size_per_gpu=None if verl["use_dynamic_bsz"] else verl["micro_batch_size_per_gpu"],
        loss_agg_mode="token-mean", use_torch_compile=verl["use_torch_compile"],
        optim=FSDPOptimizerConfig(lr=1e-6),  # verl's ppo_trainer.yaml actor optimizer (other fields: defaults)
        fsdp_config=FSDPEngineConfig(
            mixed_precision=_mixed_precision(settings["dtype"]), use_torch_compile=verl["use_torch_compile"]
        ),
    )  # fmt: skip
    actor.model_config = model_config
    worker_config = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=actor.engine,
        optimizer_config=actor.optim, checkpoint_config=actor.checkpoint,
    )  # fmt: skip
    engine = worker_config.engine_config
    engine.use_dynamic_bsz = actor.use_dynamic_bsz
    engine.max_token_len_per_gpu = engine.infer_max_token_len_per_gpu = token_budget
    engine.micro_batch_size_per_gpu = engine.infer_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine.use_remove_padding = model_config.use_remove_padding
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker, actor


def rollout_data_proto(batch: PackedBatch):
    """verl's DataProto of the batch, as its rollout returns it (temperature 1 in meta_info)."""
    from verl import DataProto

    return DataProto.from_dict(tensors=verl_rollout_tensors(batch), meta_info={"temperature": 1.0})


def update_actor(worker, data, mini_batch_size: int):
    """RayPPOTrainer._update_actor's body without Ray: one optimizer step over the mini-batch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
        global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size, epochs=1, seed=42,
        dataloader_kwargs={"shuffle": False}, compute_loss=True,
    )  # fmt: skip
    return tu.get(worker.train_mini_batch(td), "metrics")


def compute_log_prob(worker, data) -> tuple[torch.Tensor, dict]:
    """RayPPOTrainer._compute_old_log_prob's body without Ray: ((B, R) log-probs, metrics)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    out = worker.infer_batch(td)
    no_padding_2_padding(tu.get(out, "entropy"), td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float(), tu.get(out, "metrics")


def micro_batch_layout(data, verl: dict, token_budget: int) -> dict:
    """How verl's engine cuts the mini-batch (its own prepare_micro_batches) and pads each piece."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td, use_dynamic_bsz=verl["use_dynamic_bsz"], max_token_len_per_gpu=token_budget,
        micro_batch_size_per_gpu=verl["micro_batch_size_per_gpu"],
    )  # fmt: skip
    micro, _ = prepare_micro_batches(data=td, dp_group=None)
    lens = [m["input_ids"].offsets().diff() for m in micro]
    # use_remove_padding=False: each micro-batch is padded to its longest sequence (prepare_model_inputs);
    # True: it runs as one packed row of real tokens.
    return {
        "count": len(micro),
        "num_seqs": [int(x.numel()) for x in lens],
        "real_tokens": [int(x.sum()) for x in lens],
        "padded_tokens": [int(x.sum() if verl["use_remove_padding"] else x.numel() * x.max()) for x in lens],
    }


def _versions() -> dict[str, str]:
    import tensordict
    import transformers
    import verl

    return {
        "verl": verl.__version__, "transformers": transformers.__version__,
        "tensordict": tensordict.__version__, "torch": torch.__version__,
    }  # fmt: skip


def run(request: dict) -> dict:
    """Build verl's actor on the workload, time its update and log-prob pass; a JSON-ready dict."""
    raw = request["workload"]
    w = Workload(**{**raw, "prompt_len": tuple(raw["prompt_len"]), "response_len": tuple(raw["response_len"])})
    settings, verl = request["settings"], request["verl"]
    device = torch.device(settings["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    _hide_modules()
    if device.type == "cpu":
        from benchmarks.peers.verl_cpu_platform import install_cpu_platform

        install_cpu_platform()
    _init_single_process_group(device)
    if verl["attn_implementation"] == "torch_varlen":
        from benchmarks.peers.verl_varlen import register

        register(device)
    cfg = get_preset(w.preset)
    batch = synthetic_batch(w, cfg.vocab_size)
    token_budget = verl["max_token_len_per_gpu"] or settings["max_tokens_per_mb"]
    with tempfile.TemporaryDirectory(prefix="slipstream-verl-model-") as tmp:
        model_dir = request.get("model_dir") or tmp
        if not request.get("model_dir"):
            save_random_model(cfg, tmp, w.seed, getattr(torch, settings["dtype"]), device)
        worker, actor = build_actor(model_dir, w, settings, verl)
    data = rollout_data_proto(batch)
    layout = micro_batch_layout(data, verl, token_budget)
    out: dict = {"versions": _versions(), "device": str(device), "micro_batches": layout}
    if request.get("return_log_probs"):  # before any update: the log-probs of the weights as loaded
        log_probs, _ = compute_log_prob(worker, data)
        out["log_probs"] = log_probs.tolist()
        out["response_mask"] = data.batch["response_mask"].tolist()
    metrics: list[dict] = []
    train_times, train_peak = repeat_timed(
        lambda: metrics.append(update_actor(worker, data, w.num_seqs)), device, settings["repeats"], settings["warmup"]
    )
    fwd_times, fwd_peak = repeat_timed(
        lambda: compute_log_prob(worker, data), device, settings["repeats"], settings["warmup"]
    )
    width = data.batch["input_ids"].shape[1]
    out.update(
        train_times_s=train_times, train_peak_bytes=train_peak, logprob_times_s=fwd_times, logprob_peak_bytes=fwd_peak,
        rollout_width=width, last_update=_plain(metrics[-1]),
        config=actor_summary(actor, worker),
    )  # fmt: skip
    torch.distributed.destroy_process_group()
    return out


_ACTOR_FIELDS = (
    "strategy", "ppo_mini_batch_size", "rollout_n", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
    "ppo_micro_batch_size_per_gpu", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "entropy_coeff",
    "use_kl_loss", "ppo_epochs", "grad_clip", "use_torch_compile",
)  # fmt: skip


def actor_summary(actor, worker) -> dict:
    """The verl settings that shape the timed work, for the row's impl.config."""
    model = actor.model_config
    return _plain({
        "actor": {k: getattr(actor, k) for k in _ACTOR_FIELDS},
        "optim": dataclasses.asdict(actor.optim),
        "engine": {k: v for k, v in dataclasses.asdict(actor.engine).items() if k not in ("qat", "turbo_config")},
        "model": {
            "attn_implementation": model.hf_config._attn_implementation, "use_remove_padding": model.use_remove_padding,
            "enable_gradient_checkpointing": model.enable_gradient_checkpointing,
            "use_fused_kernels": model.use_fused_kernels, "fused_kernel_options": model.fused_kernel_options,
        },
        "engine_class": f"{type(worker.engine).__module__}.{type(worker.engine).__name__}",
        "autocast_dtype": str(worker.engine._autocast_dtype),
    })  # fmt: skip


def _plain(x):
    """JSON-safe copy of verl's metric / config values (numpy scalars, tensors, tuples)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="JSON file: workload, settings, verl (see run)")
    parser.add_argument("--out", required=True, help="JSON file the result is written to")
    args = parser.parse_args(argv)
    with open(args.request) as f:
        request = json.load(f)
    result = run(request)
    with open(args.out, "w") as f:
        json.dump(result, f)
    median = statistics.median(result["train_times_s"])
    print(f"verl runner: actor_train median {median:.3f}s on {result['device']}", file=sys.stderr)


if __name__ == "__main__":
    main()
