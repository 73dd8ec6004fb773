"""Reading a matrix spec: YAML -> validated settings (settings.py), every problem named by its key.

`parse_spec` handles `mode: train-step` (workloads x frameworks x backends, one `CellSettings`)
and hands `mode: rl-step` to rl_step.py; `load_spec` reads the YAML file. Errors are ValueErrors
that name the key and, for a typo, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from slipstream.bench.settings import (
    BACKENDS, DTYPES, FRAMEWORKS, MODES, RECOMPUTE, RL_BACKENDS, TRL_LOSS_TYPES, CellSettings, MatrixSpec,
    NaiveSettings, RLStepSettings, TrlSettings, VerlSettings,
)  # fmt: skip
from slipstream.bench.workloads import Workload, get_workload
from slipstream.config.loader import load_config, parse_override
from slipstream.config.schema import Config
from slipstream.models.presets import get_preset

_WORKLOAD_KEYS = tuple(f.name for f in dataclasses.fields(Workload))

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
    trl, verl, naive = _peers(data.get("peers", {}), workloads)
    return MatrixSpec(
        workloads=workloads,
        frameworks=_choice_list("frameworks", data["frameworks"], FRAMEWORKS),
        backends=_choice_list("backends", data["backends"], BACKENDS),
        settings=settings, trl=trl, verl=verl, naive=naive,
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


def _peers(raw, workloads: tuple[Workload, ...]) -> tuple[TrlSettings, VerlSettings, NaiveSettings]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"matrix spec: peers must be a mapping (trl: ..., verl: ..., naive: ...), got {raw!r}")
    _check_keys("peers.", raw, ("trl", "verl", "naive"))
    trl_raw, verl_raw, naive_raw = raw.get("trl") or {}, raw.get("verl") or {}, raw.get("naive") or {}
    _check_keys("peers.trl.", trl_raw, [f.name for f in dataclasses.fields(TrlSettings)])
    _check_keys("peers.verl.", verl_raw, [f.name for f in dataclasses.fields(VerlSettings)])
    _check_keys("peers.naive.", naive_raw, [f.name for f in dataclasses.fields(NaiveSettings)])
    naive = NaiveSettings(
        micro_batch_size=_int(
            "peers.naive.micro_batch_size", naive_raw.get("micro_batch_size", NaiveSettings.micro_batch_size), 1
        )
    )
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
        use_liger_kernel=_bool("peers.trl.use_liger_kernel", trl_raw.get("use_liger_kernel", t.use_liger_kernel)),
        params_dtype=_choice("peers.trl.params_dtype", trl_raw.get("params_dtype", t.params_dtype), (None, *DTYPES)),
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
            ("sdpa", "torch_varlen", "flash_attention_2", "eager"),
        ),
        use_remove_padding=_bool(
            "peers.verl.use_remove_padding", verl_raw.get("use_remove_padding", v.use_remove_padding)
        ),
        use_fused_kernels=_bool("peers.verl.use_fused_kernels", verl_raw.get("use_fused_kernels", v.use_fused_kernels)),
        fused_kernels_backend=_choice(
            "peers.verl.fused_kernels_backend", verl_raw.get("fused_kernels_backend", v.fused_kernels_backend),
            ("torch", "triton"),
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
    if verl.attn_implementation == "torch_varlen" and not verl.use_remove_padding:
        raise ValueError("matrix spec: peers.verl.attn_implementation torch_varlen needs use_remove_padding: true "
                         "(it is verl's varlen call over one packed row)")  # fmt: skip
    _check_verl_fits(verl, workloads)
    return trl, verl, naive


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
            "build one with `bash benchmarks/gpu_setup.sh verl-local DIR`"
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


# ---------------------------------------------------------------- mode: rl-step

RL_TOP_KEYS = ("mode", "frameworks", "backends", "rl_step", "device", "peak_flops", "on_error")
RL_STEP_KEYS = ("recipe", "steps", "warmup_steps", "overrides", "name", "budgets", "ignore_stop")
CONTROLLED_KEYS = (
    "trainer.run_dir", "trainer.export_hf", "logging.tensorboard", "trainer.resume", "trainer.total_steps",
    "actor.backend",
)  # fmt: skip
"""Config keys the bench sets itself for every cell; the spec's overrides may not touch them."""


def parse_rl_step_spec(data: Mapping) -> MatrixSpec:
    """Validate a `mode: rl-step` spec mapping; the recipe and overrides are resolved once to catch errors early."""
    for key in data:
        if key not in RL_TOP_KEYS and key in {"workloads", "peers"} | {f.name for f in dataclasses.fields(CellSettings)}:
            raise ValueError(
                f"matrix spec: key {key!r} applies to mode train-step only; in mode rl-step the recipe in "
                f"rl_step.recipe and rl_step.overrides set the workload and the training settings"
            )
    _check_keys("", data, RL_TOP_KEYS)
    for key in ("frameworks", "backends", "rl_step"):
        if key not in data:
            raise ValueError(f"matrix spec: missing required key {key!r}")
    settings = CellSettings(
        mode="rl-step",
        device=_choice("device", data.get("device"), (None, "cuda", "cpu")),
        peak_flops=_peak("peak_flops", data.get("peak_flops")),
    )
    rl = _rl_step_section(data["rl_step"], settings)
    return MatrixSpec(
        workloads=(rl,),  # type: ignore[arg-type]  # the recipe is the one workload of an rl-step matrix
        # the naive loop has no generation: rl-step compares the full RL loops only
        frameworks=_choice_list("frameworks", data["frameworks"], tuple(f for f in FRAMEWORKS if f != "naive")),
        backends=_choice_list("backends", data["backends"], RL_BACKENDS),
        settings=settings,
        on_error=_choice("on_error", data.get("on_error", "record"), ("record", "raise")),
        rl_step=rl,
    )


def _rl_step_section(raw, settings: CellSettings) -> RLStepSettings:
    if not isinstance(raw, Mapping):
        raise ValueError(f"matrix spec: rl_step must be a mapping (recipe, steps, ...), got {raw!r}")
    _check_keys("rl_step.", raw, RL_STEP_KEYS)
    for key in ("recipe", "steps"):
        if key not in raw:
            raise ValueError(f"matrix spec: rl_step is missing required key {key!r}")
    recipe = raw["recipe"]
    if not isinstance(recipe, str) or not recipe:
        raise ValueError(f"matrix spec: rl_step.recipe must be a path to a recipe YAML, got {recipe!r}")
    steps = _int("rl_step.steps", raw["steps"], 1)
    warmup = _int("rl_step.warmup_steps", raw.get("warmup_steps", 1), 0)
    if warmup >= steps:
        raise ValueError(
            f"matrix spec: rl_step.steps={steps} leaves no timed step after rl_step.warmup_steps={warmup} "
            "(steps counts the warm-up too)"
        )
    overrides = raw.get("overrides", [])
    if isinstance(overrides, str):
        overrides = [overrides]
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"matrix spec: rl_step.overrides must be a list of 'key=value' strings, got {overrides!r}")
    controlled = set(CONTROLLED_KEYS)
    controlled |= {"trainer.device"} if settings.device is not None else set()
    controlled |= {"trainer.peak_flops"} if settings.peak_flops is not None else set()
    for i, item in enumerate(overrides):
        try:
            key, _ = parse_override(item)
        except ValueError as err:
            raise ValueError(f"matrix spec: rl_step.overrides[{i}]: {err}") from None
        if key in controlled:
            raise ValueError(
                f"matrix spec: rl_step.overrides[{i}] sets {key!r}, which the bench sets itself "
                f"({', '.join(sorted(controlled))}); vary the backend with `backends` and the device with `device`"
            )
    name = raw.get("name", Path(recipe).stem)
    if not isinstance(name, str) or not name:
        raise ValueError(f"matrix spec: rl_step.name must be a non-empty string, got {name!r}")
    budgets = raw.get("budgets")
    if budgets not in (None, "w1"):
        raise ValueError(f"matrix spec: rl_step.budgets must be 'w1' or absent, got {budgets!r}")
    ignore_stop = raw.get("ignore_stop", False)
    if not isinstance(ignore_stop, bool):
        raise ValueError(f"matrix spec: rl_step.ignore_stop must be true or false, got {ignore_stop!r}")
    rl = RLStepSettings(recipe=recipe, steps=steps, warmup_steps=warmup, overrides=tuple(overrides), name=name,
                        budgets=budgets, ignore_stop=ignore_stop)  # fmt: skip
    try:  # resolve now: a typo in an override fails at spec load, not after the first cells have run
        cell_config(rl, settings, backend="local", run_dir="/nonexistent/rl-step-check")
    except ValueError as err:
        raise ValueError(f"matrix spec: rl_step: {err}") from None
    return rl


def cell_config(rl: RLStepSettings, settings: CellSettings, backend: str, run_dir: str | Path) -> Config:
    """The Config of one cell: recipe <- spec overrides <- what the bench controls (backend, run_dir, ...)."""
    forced = [
        f"trainer.run_dir={run_dir}", "trainer.export_hf=false", "logging.tensorboard=false",
        "trainer.resume=false", f"trainer.total_steps={rl.steps}", f"actor.backend={backend}",
    ]  # fmt: skip
    if settings.device is not None:
        forced.append(f"trainer.device={settings.device}")
    if settings.peak_flops is not None:
        forced.append(f"trainer.peak_flops={settings.peak_flops!r}")
    return load_config(rl.recipe, [*rl.overrides, *forced])


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

