"""`slipstream bench matrix SPEC.yaml`: {workload} x {framework} x {backend} on identical work.

A spec names workloads, frameworks and backends; every other setting (dtype, recompute,
micro-batch token budget, repeats, ...) is held constant and copied into every result row,
so a row read on its own says exactly what was measured. Each cell produces one JSON row:

  slipstream x fsdp      bench_train_step(..., backend="fsdp") (the `bench train-step` numbers)
  slipstream x megatron  bench_train_step(..., backend="megatron") (megatron-core engine; compile not applied)
  trl x fsdp             TRL's own GRPOTrainer loss path (peers/trl_adapter.py)
  trl x megatron         status "not-applicable": TRL has no Megatron engine
  verl x fsdp            verl 0.9.1's own FSDP actor in a subprocess with its site dir (peers/verl_adapter.py);
                         "missing" without a verl site directory
  verl x megatron        status "not-available": verl's Megatron engine needs Transformer Engine

`mode: rl-step` runs whole GRPO steps from a recipe instead (rl_step.py): slipstream on the
local / fsdp / megatron backend at world size 1, TRL's own GRPOTrainer.train(); verl an explained row.

Row statuses: ok, missing (peer not installed; `install` says how), not-available,
not-applicable, oom, error. Only "ok" rows carry numbers. Timing and statistics follow
train_step.py: warm-up discarded, median / min / max over repeats, real tokens only, model
FLOPs per DESIGN.md; `rel_spread` = (max - min) / median is the run-to-run noise of a phase.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from slipstream.bench.workloads import Workload, get_workload
from slipstream.models.presets import get_preset

if TYPE_CHECKING:
    from slipstream.bench.rl_step import RLStepSettings

SCHEMA = "slipstream.bench.matrix/1"
FRAMEWORKS = ("slipstream", "trl", "verl")
BACKENDS = ("fsdp", "megatron")
MODES = ("train-step", "rl-step")  # rl-step: whole GRPO steps from a recipe, see rl_step.py
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bfloat16", "float32")
TRL_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
STATUSES = ("ok", "missing", "not-available", "not-applicable", "oom", "error")
ROW_KEYS = (
    "schema", "cell", "workload", "framework", "backend", "mode", "status", "reason", "install",
    "held_constant", "phases", "metrics", "micro_batches", "fairness", "impl", "env",
)  # fmt: skip
FAIRNESS_KEYS = (
    "dtype", "params_dtype", "attention_kernel", "recompute", "real_tokens", "padded_tokens",
    "padding_fraction", "loss_normalisation", "optimizer", "micro_batching", "logprob_head",
)  # fmt: skip
_WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))


# ---------------------------------------------------------------- spec


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


@dataclass(frozen=True)
class VerlSettings:
    """How the verl cell runs verl's FSDP actor (peers/verl_adapter.py); verl's defaults unless noted."""

    attn_implementation: str = "sdpa"
    use_remove_padding: bool = False
    """verl's remove-padding fast path needs flash-attn; the padded sdpa path does not."""
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
    """Site directory holding verl and its pinned packages (bench/peers_verl_wheels.sh); None: $SLIPSTREAM_VERL_SITE."""


@dataclass(frozen=True)
class MatrixSpec:
    """A validated matrix: workloads x frameworks x backends under one `CellSettings`."""

    workloads: tuple[Workload, ...]
    frameworks: tuple[str, ...]
    backends: tuple[str, ...]
    settings: CellSettings = field(default_factory=CellSettings)
    trl: TrlSettings = field(default_factory=TrlSettings)
    verl: VerlSettings = field(default_factory=VerlSettings)
    on_error: str = "record"
    """"record": a cell that raises becomes an "error" row and the matrix goes on; "raise": stop."""
    rl_step: RLStepSettings | None = None
    """The recipe and step counts of an rl-step matrix (then `workloads` is this one entry); None for train-step."""

    def cells(self) -> list[tuple[Workload, str, str]]:
        """(workload, framework, backend) in run order: workload-major, slipstream first."""
        return [(w, f, b) for w in self.workloads for f in self.frameworks for b in self.backends]


_TOP_KEYS = ("workloads", "frameworks", "backends", "peers", "on_error", "rl_step") + tuple(
    f.name for f in dataclasses.fields(CellSettings)
)


def _suggest(key: str, allowed: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, [a for a in allowed if isinstance(a, str)], n=1)  # device allows None
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_keys(where: str, given: Mapping, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    for key in given:
        if key not in allowed:
            raise ValueError(
                f"matrix spec: unknown key {where}{key!r}{_suggest(str(key), allowed)} (allowed: {', '.join(allowed)})"
            )


def _choice(where: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"matrix spec: {where} must be one of {allowed}, got {value!r}{_suggest(str(value), allowed)}")
    return value


def _int(where: str, value, minimum: int) -> int:
    # bool is an int subclass in Python; `repeats: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"matrix spec: {where} must be an integer >= {minimum}, got {value!r}")
    return value


def _choice_list(where: str, value, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"matrix spec: {where} must be a non-empty list (choices: {', '.join(allowed)}), got {value!r}"
        )
    items = tuple(_choice(f"{where}[{i}]", v, allowed) for i, v in enumerate(value))
    if len(set(items)) != len(items):
        raise ValueError(f"matrix spec: {where} lists a value twice: {list(items)}")
    return items


def _length_range(where: str, value) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"matrix spec: {where} must be [min, max] (or one integer), got {value!r}")
    return (_int(f"{where}[0]", value[0], 1), _int(f"{where}[1]", value[1], 1))


def _workload(where: str, entry) -> Workload:
    """A workload entry: a name ("W1") or a mapping, optionally `like: <name>` plus overrides."""
    if isinstance(entry, str):
        try:
            return get_workload(entry)
        except ValueError as err:
            raise ValueError(f"matrix spec: {where}: {err}") from None
    if not isinstance(entry, Mapping):
        raise ValueError(f"matrix spec: {where} must be a workload name or a mapping, got {entry!r}")
    _check_keys(f"{where}.", entry, ("like",) + _WORKLOAD_KEYS)
    fields_: dict = {}
    if "like" in entry:
        try:
            fields_ = dataclasses.asdict(get_workload(entry["like"]))
        except ValueError as err:
            raise ValueError(f"matrix spec: {where}.like: {err}") from None
        if set(entry) - {"like", "name"} and "name" not in entry:
            raise ValueError(f"matrix spec: {where} changes workload {entry['like']!r}: give it a new `name`")
    for key in _WORKLOAD_KEYS:
        if key in entry:
            fields_[key] = entry[key]
    required = ("name", "preset", "num_prompts", "group_size", "prompt_len", "response_len")
    missing = [k for k in required if k not in fields_]
    if missing:
        raise ValueError(f"matrix spec: {where} is missing {', '.join(missing)} (or use `like: <workload name>`)")
    for key in ("num_prompts", "group_size", "seed"):
        if key in fields_:
            fields_[key] = _int(f"{where}.{key}", fields_[key], 0 if key == "seed" else 1)
    fields_["prompt_len"] = _length_range(f"{where}.prompt_len", fields_["prompt_len"])
    fields_["response_len"] = _length_range(f"{where}.response_len", fields_["response_len"])
    try:
        get_preset(fields_["preset"])
        return Workload(**fields_)
    except (ValueError, TypeError) as err:
        raise ValueError(f"matrix spec: {where}: {err}") from None


def parse_spec(data: Mapping) -> MatrixSpec:
    """Validate a spec mapping (as loaded from YAML); any problem raises ValueError naming the key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"matrix spec: the top level must be a mapping, got {type(data).__name__}")
    if _choice("mode", data.get("mode", "train-step"), MODES) == "rl-step":
        from slipstream.bench.rl_step import parse_rl_step_spec

        return parse_rl_step_spec(data)
    _check_keys("", data, _TOP_KEYS)
    if "rl_step" in data:
        raise ValueError("matrix spec: key 'rl_step' applies to mode rl-step only (this spec's mode is train-step)")
    for key in ("workloads", "frameworks", "backends"):
        if key not in data:
            raise ValueError(f"matrix spec: missing required key {key!r}")
    raw_workloads = data["workloads"]
    if not isinstance(raw_workloads, list) or not raw_workloads:
        raise ValueError(f"matrix spec: workloads must be a non-empty list, got {raw_workloads!r}")
    workloads = tuple(_workload(f"workloads[{i}]", e) for i, e in enumerate(raw_workloads))
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ValueError(f"matrix spec: workloads must have distinct names, got {names}")

    s = CellSettings()
    settings = CellSettings(
        mode=_choice("mode", data.get("mode", s.mode), MODES),
        dtype=_choice("dtype", data.get("dtype", s.dtype), DTYPES),
        recompute=_choice("recompute", data.get("recompute", s.recompute), RECOMPUTE),
        max_tokens_per_mb=_int("max_tokens_per_mb", data.get("max_tokens_per_mb", s.max_tokens_per_mb), 1),
        compile=_bool("compile", data.get("compile", s.compile)),
        master_dtype=_choice("master_dtype", data.get("master_dtype", s.master_dtype), ("float32", "bfloat16")),
        repeats=_int("repeats", data.get("repeats", s.repeats), 1),
        warmup=_int("warmup", data.get("warmup", s.warmup), 0),
        planner=_choice("planner", data.get("planner", s.planner), ("kk", "ffd")),
        device=_choice("device", data.get("device", s.device), (None, "cuda", "cpu")),
        peak_flops=_peak("peak_flops", data.get("peak_flops", s.peak_flops)),
    )
    if settings.master_dtype == "bfloat16" and settings.dtype != "bfloat16":
        raise ValueError("matrix spec: master_dtype: bfloat16 needs dtype: bfloat16")
    trl, verl = _peers(data.get("peers", {}), workloads)
    return MatrixSpec(
        workloads=workloads,
        frameworks=_choice_list("frameworks", data["frameworks"], FRAMEWORKS),
        backends=_choice_list("backends", data["backends"], BACKENDS),
        settings=settings, trl=trl, verl=verl,
        on_error=_choice("on_error", data.get("on_error", "record"), ("record", "raise")),
    )  # fmt: skip


def _bool(where: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"matrix spec: {where} must be true or false, got {value!r}")
    return value


def _peak(where: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"matrix spec: {where} must be a positive number of FLOP/s, got {value!r}")
    return float(value)


def _peers(raw, workloads: tuple[Workload, ...]) -> tuple[TrlSettings, VerlSettings]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"matrix spec: peers must be a mapping (trl: ..., verl: ...), got {raw!r}")
    _check_keys("peers.", raw, ("trl", "verl"))
    trl_raw, verl_raw = raw.get("trl") or {}, raw.get("verl") or {}
    _check_keys("peers.trl.", trl_raw, [f.name for f in dataclasses.fields(TrlSettings)])
    _check_keys("peers.verl.", verl_raw, [f.name for f in dataclasses.fields(VerlSettings)])
    t, v = TrlSettings(), VerlSettings()
    trl = TrlSettings(
        per_device_train_batch_size=_int(
            "peers.trl.per_device_train_batch_size",
            trl_raw.get("per_device_train_batch_size", t.per_device_train_batch_size), 1,
        ),
        loss_type=_choice("peers.trl.loss_type", trl_raw.get("loss_type", t.loss_type), TRL_LOSS_TYPES),
        gradient_checkpointing=_choice(
            "peers.trl.gradient_checkpointing", trl_raw.get("gradient_checkpointing", t.gradient_checkpointing),
            ("follow", "on", "off"),
        ),
    )  # fmt: skip
    # TRL splits the generation batch into equal micro-batches of whole prompt groups.
    for w in workloads:
        if w.num_seqs % trl.per_device_train_batch_size:
            raise ValueError(
                f"matrix spec: peers.trl.per_device_train_batch_size={trl.per_device_train_batch_size} does not "
                f"divide the {w.num_seqs} sequences of workload {w.name!r}"
            )
    verl = VerlSettings(
        attn_implementation=_choice(
            "peers.verl.attn_implementation", verl_raw.get("attn_implementation", v.attn_implementation),
            ("sdpa", "flash_attention_2", "eager"),
        ),
        use_remove_padding=_bool(
            "peers.verl.use_remove_padding", verl_raw.get("use_remove_padding", v.use_remove_padding)
        ),
        strategy=_choice("peers.verl.strategy", verl_raw.get("strategy", v.strategy), ("fsdp", "fsdp2")),
        use_dynamic_bsz=_bool("peers.verl.use_dynamic_bsz", verl_raw.get("use_dynamic_bsz", v.use_dynamic_bsz)),
        max_token_len_per_gpu=_optional_int(
            "peers.verl.max_token_len_per_gpu", verl_raw.get("max_token_len_per_gpu", v.max_token_len_per_gpu)
        ),
        micro_batch_size_per_gpu=_int(
            "peers.verl.micro_batch_size_per_gpu",
            verl_raw.get("micro_batch_size_per_gpu", v.micro_batch_size_per_gpu), 1,
        ),
        use_torch_compile=_bool(
            "peers.verl.use_torch_compile", verl_raw.get("use_torch_compile", v.use_torch_compile)
        ),
        site_dir=_site_dir("peers.verl.site_dir", verl_raw.get("site_dir", v.site_dir)),
    )  # fmt: skip
    _check_verl_fits(verl, workloads)
    return trl, verl


def _optional_int(where: str, value) -> int | None:
    return None if value is None else _int(where, value, 1)


def _site_dir(where: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"matrix spec: {where} must be a directory path, got {value!r}")
    if not (Path(value).expanduser() / "verl" / "__init__.py").is_file():
        raise ValueError(
            f"matrix spec: {where}={value!r} is not a verl site directory (no verl/__init__.py); "
            "build one with bench/peers_verl_wheels.sh"
        )
    return value


def _check_verl_fits(verl: VerlSettings, workloads: tuple[Workload, ...]) -> None:
    """verl's own asserts, checked before any cell runs (they would fail deep inside its engine)."""
    from slipstream.bench.workloads import seq_lens

    for w in workloads:
        if verl.max_token_len_per_gpu is not None and verl.max_token_len_per_gpu < max(seq_lens(w)):
            raise ValueError(
                f"matrix spec: peers.verl.max_token_len_per_gpu={verl.max_token_len_per_gpu} is below the longest "
                f"sequence ({max(seq_lens(w))} tokens) of workload {w.name!r}"
            )
        if not verl.use_dynamic_bsz and w.num_seqs % verl.micro_batch_size_per_gpu:
            raise ValueError(
                f"matrix spec: peers.verl.micro_batch_size_per_gpu={verl.micro_batch_size_per_gpu} does not divide "
                f"the {w.num_seqs} sequences of workload {w.name!r}"
            )


def load_spec(path: str | Path) -> MatrixSpec:
    """Read and validate a matrix spec YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"matrix spec {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"matrix spec {path} is not valid YAML: {err}") from None
    return parse_spec(data if data is not None else {})


# ---------------------------------------------------------------- runner


def held_constant(spec: MatrixSpec) -> dict:
    """The settings every row shares (not varied by the matrix), peers' settings included."""
    return {
        **dataclasses.asdict(spec.settings),
        "peers": {"trl": dataclasses.asdict(spec.trl), "verl": dataclasses.asdict(spec.verl)},
        "frameworks": list(spec.frameworks),
        "backends": list(spec.backends),
    }


def add_noise(phases: dict[str, dict]) -> dict[str, dict]:
    """Each phase with `rel_spread` = (max - min) / median of its timed repeats."""
    return {name: {**p, "rel_spread": (p["time_max_s"] - p["time_min_s"]) / p["time_s"]} for name, p in phases.items()}


_KERNEL_NAMES = {
    "varlen": "varlen (FlashAttention, torch varlen_attn)",
    "flex": "flex_attention (document-causal mask)",
    "sdpa": "sdpa (one call per sequence)",
}


def _slipstream_cell(w: Workload, s: CellSettings, backend: str) -> dict:
    """slipstream's own training step on `backend` ("fsdp" or "megatron"), via `bench_train_step`."""
    import torch

    from slipstream.bench.train_step import bench_train_step
    from slipstream.ops.attention import select_backend

    dtype = getattr(torch, s.dtype)
    # The megatron engine does not torch.compile its blocks: the row says so instead of implying it.
    compile = s.compile and backend == "fsdp"
    # The same for bf16 master weights: Megatron's distributed optimizer keeps fp32 ones.
    master = s.master_dtype if backend == "fsdp" else "float32"
    r = bench_train_step(
        w, backend=backend, max_tokens_per_mb=s.max_tokens_per_mb, dtype=dtype, activation_checkpointing=s.recompute,
        compile=compile, repeats=s.repeats, warmup=s.warmup, device=s.device, planner=s.planner,
        peak_flops=s.peak_flops, master_dtype=master,
    )  # fmt: skip
    device = torch.device(r["config"]["device"])
    kernel = select_backend(torch.empty(0, device=device, dtype=dtype))
    tokens = r["workload"]["num_tokens"]
    mixed = dtype != torch.float32
    return {
        "status": "ok",
        "phases": r["phases"],
        "micro_batches": r["micro_batches"],
        "fairness": {
            "dtype": s.dtype,
            "params_dtype": (
                ("bf16 params, fp32 main grads + fp32 master weights in the distributed optimizer" if backend == "megatron"
                 else "bf16 parameters, gradients and AdamW state, stochastically rounded updates" if master == "bfloat16"
                 else "float32 master weights, bf16 compute (FSDP2 mixed precision)") if mixed else "float32"
            ),
            "attention_kernel": f"{_KERNEL_NAMES.get(kernel, kernel)} over packed sequences (no padding)",
            "recompute": s.recompute if backend == "fsdp" else f"megatron recompute_granularity {s.recompute}",
            "real_tokens": tokens,
            "padded_tokens": tokens,  # packed: every token run through the model is real
            "padding_fraction": 0.0,
            "loss_normalisation": "PPO-clip, token-mean over the minibatch's loss tokens (global denominator)",
            "optimizer": f"AdamW lr=1e-6 betas=(0.9,0.999) wd=0, {'bf16 state (stochastic rounding)' if master == 'bfloat16' else 'fp32 state'}"
            ", grad clip 1.0",
            "micro_batching": f"token budget {s.max_tokens_per_mb} ({s.planner} planner), "
            f"{r['micro_batches']['count']} micro-batches",
            "logprob_head": "fused chunked linear->log-prob (no (T, V) logits)",
        },
        "impl": {"name": "slipstream", "version": None, "config": r["config"]},
    }


def run_cell(spec: MatrixSpec, w: Workload, framework: str, backend: str) -> dict:
    """The framework-specific part of one cell's row (status, phases, fairness, impl)."""
    s = spec.settings
    if s.mode == "rl-step":
        from slipstream.bench.rl_step import run_rl_step_cell

        return run_rl_step_cell(spec, w, framework, backend)  # type: ignore[arg-type]  # w is the RLStepSettings
    if framework == "slipstream":
        return _slipstream_cell(w, s, backend)
    if framework == "trl":
        if backend == "megatron":
            return {"status": "not-applicable", "reason": "TRL has no Megatron engine (it trains through accelerate)"}
        from slipstream.bench.peers.trl_adapter import run_trl_cell

        return run_trl_cell(w, s, spec.trl)
    from slipstream.bench.peers.verl_adapter import run_verl_cell

    return run_verl_cell(w, s, spec.verl, backend)


def _oom_types() -> tuple[type[BaseException], ...]:
    import torch

    from slipstream.engine.local import OutOfMemory

    return (torch.OutOfMemoryError, OutOfMemory)


def _workload_fields(w: Workload) -> dict:
    """The `workload` field of a train-step row: the definition plus its sequence and token counts."""
    from slipstream.bench.workloads import seq_lens

    lens = seq_lens(w)
    return {**dataclasses.asdict(w), "num_seqs": len(lens), "num_tokens": sum(lens)}


def make_row(spec: MatrixSpec, w: Workload, framework: str, backend: str, result: dict, env: dict) -> dict:
    """One JSONL row: the common fields plus the cell's own result, with every ROW_KEYS key present."""
    if spec.settings.mode == "rl-step":
        from slipstream.bench.rl_step import make_rl_step_row

        return make_rl_step_row(spec, w, framework, backend, result, env)  # type: ignore[arg-type]
    from slipstream.bench.train_step import perf_metrics

    phases = add_noise(result.get("phases") or {})
    row = {
        "schema": SCHEMA,
        "cell": f"{w.name}/{framework}/{backend}",
        "workload": _workload_fields(w),
        "framework": framework,
        "backend": backend,
        "mode": spec.settings.mode,
        "status": result["status"],
        "reason": result.get("reason"),
        "install": result.get("install"),
        "held_constant": held_constant(spec),
        "phases": phases,
        "metrics": perf_metrics(phases) if phases else {},
        "micro_batches": result.get("micro_batches"),
        "fairness": result.get("fairness"),
        "impl": result.get("impl"),
        "env": env,
    }
    assert tuple(row) == ROW_KEYS and row["status"] in STATUSES
    return row


RERUN_ON_RESUME = ("error", "missing")
"""Row statuses `--resume` runs again (a peer installed since, a crash); the others are results."""


def finished_rows(spec: MatrixSpec, out_jsonl: str | Path, env: Mapping | None = None) -> dict[str, dict]:
    """Rows of an earlier run of the same spec kept by `--resume`, by cell; RERUN_ON_RESUME rows run again.

    Refuses rows recorded under other held-constant settings, another workload definition or
    (when `env` is given) another GPU / torch version: a resumed table must not mix those.
    """
    path = Path(out_jsonl)
    if not path.exists():
        return {}
    rows = read_rows(path)
    if spec.rl_step is not None:
        from slipstream.bench.rl_step import held_constant_rl

        held = held_constant_rl(spec)
    else:
        held = held_constant(spec)
    held = json.loads(json.dumps(held))  # as stored (tuples -> lists)
    # A setting added after a row was recorded counts at its default (the value that row ran with).
    defaults = {} if spec.rl_step is not None else json.loads(json.dumps(dataclasses.asdict(CellSettings())))
    workloads = {f"{w.name}/{f}/{b}": w for w, f, b in spec.cells()}
    for row in rows:
        problem = None
        if {**defaults, **row["held_constant"]} != held:
            problem = "was run with different held-constant settings"
        elif row["cell"] in workloads and spec.rl_step is None:
            if row["workload"] != json.loads(json.dumps(_workload_fields(workloads[row["cell"]]))):
                problem = "was run on a different workload definition"
        if problem is None and env is not None:
            for key in ("gpu", "torch"):
                if row["env"].get(key) != env.get(key):
                    problem = f"was run with {key} {row['env'].get(key)!r}, this machine has {env.get(key)!r}"
        if problem:
            raise ValueError(f"--resume: cell {row['cell']} in {path} {problem}; use a new --out directory")
    return {row["cell"]: row for row in rows if row["status"] not in RERUN_ON_RESUME}


def run_matrix(
    spec: MatrixSpec,
    out_jsonl: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    resume: bool = False,
) -> list[dict]:
    """Run every cell; rows are appended to `out_jsonl` as each cell finishes (a crash keeps the rest).

    `resume=True` keeps the rows already in `out_jsonl` for this spec and runs only the missing
    (or failed) cells, so a matrix longer than one sitting can be finished in several.
    """
    from slipstream.bench.peers import peer_versions
    from slipstream.bench.train_step import env_info

    env = {**env_info(), "peers": peer_versions()}
    out = Path(out_jsonl) if out_jsonl is not None else None
    done = finished_rows(spec, out, env) if (resume and out is not None) else {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(row) + "\n" for row in done.values()))
    rows = []
    for w, framework, backend in spec.cells():
        cell = f"{w.name}/{framework}/{backend}"
        if cell in done:
            rows.append(done[cell])
            if log:
                log(f"cell {cell}: kept from the earlier run ({done[cell]['status']})")
            continue
        if log:
            log(f"cell {w.name}/{framework}/{backend} ...")
        try:
            result = run_cell(spec, w, framework, backend)
        except _oom_types() as err:
            result = {"status": "oom", "reason": f"{type(err).__name__}: {err}"}
        except Exception as err:  # a matrix is many independent runs: one peer's failure must not lose the rest
            if spec.on_error == "raise":
                raise
            tail = "".join(traceback.format_exception(err)[-3:])
            result = {"status": "error", "reason": f"{type(err).__name__}: {err}\n{tail}"}
        row = make_row(spec, w, framework, backend, result, env)
        rows.append(row)
        if log:
            log(f"  -> {row['status']}" + (f": {row['reason'].splitlines()[0]}" if row["reason"] else ""))
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if out is not None and done:  # kept rows were written first: restore the spec's cell order
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a results JSONL file (blank lines ignored)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON row ({err})") from None
    return rows
