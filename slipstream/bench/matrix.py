"""`slipstream bench matrix SPEC.yaml`: {workload} x {framework} x {backend} on identical work.

A spec (spec.py) names workloads, frameworks and backends; the settings it does not vary
(dtype, recompute, micro-batch token budget, repeats, ...) are copied into every result row, and
each row states its own engine, processes, compile, recompute, micro-batching and padding in its
`fairness` dict, so a row read on its own says exactly what was measured. One JSON row per cell:

  slipstream x fsdp      bench_train_step(..., backend="fsdp") (the `bench train-step` numbers)
  slipstream x megatron  bench_train_step(..., backend="megatron") (megatron-core engine; compile not applied)
  naive x torch          the plain HF loop (naive.py): padded micro-batches, full fp32 logits
  trl x accelerate       TRL's own GRPOTrainer loss path (benchmarks/peers/trl_adapter.py): transformers'
                         Trainer on accelerate in one process (TRL has one engine, so it gets one row, never "fsdp")
  verl x fsdp            verl 0.9.1's own FSDP actor in a subprocess with its site dir
                         (benchmarks/peers/verl_adapter.py); "missing" without a verl site directory
  verl x megatron        status "not-available": verl's Megatron engine needs Transformer Engine

`mode: rl-step` runs whole GRPO steps from a recipe instead (rl_step.py): slipstream on the
local / fsdp / megatron backend at world size 1, TRL's own GRPOTrainer.train(); verl an explained row.

The peer adapters live in the repository's benchmarks/ (checkout.py finds it); without a checkout
the peer cells are explained rows. Row statuses: ok, missing (peer not installed; `install` says how),
not-available, not-applicable, oom, error. Only "ok" rows carry numbers. Timing and statistics follow
train_step.py: warm-up discarded, median / min / max over repeats, real tokens only, model
FLOPs (docs/architecture.md#tokens-flops-and-mfu); `rel_spread` = (max - min) / median is the run-to-run noise of a phase.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from slipstream.bench.rl_step import held_constant_rl, make_rl_step_row, run_slipstream_rl_step
from slipstream.bench.rows import ROW_KEYS, SCHEMA, STATUSES, add_noise, read_rows
from slipstream.bench.settings import CellSettings, MatrixSpec, RLStepSettings
from slipstream.bench.workloads import Workload

# ---------------------------------------------------------------- runner


def held_constant(spec: MatrixSpec) -> dict:
    """The settings every row shares (not varied by the matrix), peers' settings included."""
    return {
        **dataclasses.asdict(spec.settings),
        "peers": {
            "trl": dataclasses.asdict(spec.trl), "verl": dataclasses.asdict(spec.verl),
            "naive": dataclasses.asdict(spec.naive),
        },  # fmt: skip
        "frameworks": list(spec.frameworks),
        "backends": list(spec.backends),
    }


_KERNEL_NAMES = {
    "varlen": "varlen (FlashAttention, torch varlen_attn)",
    "flex": "flex_attention (document-causal mask)",
    "sdpa": "sdpa (one masked call per group of consecutive sequences)",
}


def _slipstream_cell(w: Workload, s: CellSettings, backend: str) -> dict:
    """slipstream's own training step on `backend` ("fsdp" or "megatron"), via `bench_train_step`."""
    import torch

    from slipstream.bench.train_step import bench_train_step
    from slipstream.ops.attention import kernel_for

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
    kernel = kernel_for(device, dtype, compiled=compile)
    tokens = r["workload"]["num_tokens"]
    mixed = dtype != torch.float32
    return {
        "status": "ok",
        "phases": r["phases"],
        "micro_batches": r["micro_batches"],
        "fairness": {
            "engine": "FSDP2 (fully_shard per block)" if backend == "fsdp"
            else "megatron-core GPTModel (local layer spec), DDP + distributed optimizer",
            "processes": r["config"]["num_ranks"],
            "compile": "torch.compile per block" if compile else "no",
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
        return _rl_step_cell(spec, w, framework, backend)  # type: ignore[arg-type]  # w is the RLStepSettings
    if framework == "slipstream":
        return _slipstream_cell(w, s, backend)
    if framework == "naive":
        from slipstream.bench.naive import run_naive_cell

        return run_naive_cell(w, s, spec.naive)
    adapter = _peer_adapter(framework, "trl_adapter" if framework == "trl" else "verl_adapter")
    if isinstance(adapter, dict):
        return adapter
    if framework == "trl":
        return adapter.run_trl_cell(w, s, spec.trl)
    return adapter.run_verl_cell(w, s, spec.verl, backend)


def _peer_adapter(framework: str, module: str):
    """benchmarks.peers.<module> of the repository checkout, or the explained row of a cell that has none."""
    from slipstream.bench import checkout

    try:
        return checkout.load(f"peers.{module}")
    except checkout.BenchmarksNotFound as err:
        return {"status": "not-available", "reason": f"no {framework} adapter: {err}"}


def _rl_step_cell(spec: MatrixSpec, rl: RLStepSettings, framework: str, backend: str) -> dict:
    """The framework-specific part of one rl-step row; peers without an adapter get an explained row."""
    if framework == "slipstream":
        return run_slipstream_rl_step(rl, spec.settings, backend)
    if framework == "trl":
        adapter = _peer_adapter(framework, "trl_rl_step")
        return adapter if isinstance(adapter, dict) else adapter.run_trl_rl_step_cell(rl, spec.settings, backend)
    return {
        "status": "not-available",
        "reason": f"rl-step adapter for {framework} not written yet (its train-step adapter exists; "
        "full-step timing of its own generation loop is a later slice)",
    }


def _oom_types() -> tuple[type[BaseException], ...]:
    import torch

    from slipstream.engine.base import OutOfMemory

    return (torch.OutOfMemoryError, OutOfMemory)


def _workload_fields(w: Workload) -> dict:
    """The `workload` field of a train-step row: the definition plus its sequence and token counts."""
    from slipstream.bench.workloads import seq_lens

    lens = seq_lens(w)
    return {**dataclasses.asdict(w), "num_seqs": len(lens), "num_tokens": sum(lens)}


def make_row(spec: MatrixSpec, w: Workload, framework: str, backend: str, result: dict, env: dict) -> dict:
    """One JSONL row: the common fields plus the cell's own result, with every ROW_KEYS key present."""
    if spec.settings.mode == "rl-step":
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
    from slipstream.bench import checkout
    from slipstream.bench.train_step import env_info

    try:
        peers = checkout.load("peers").peer_versions()
    except checkout.BenchmarksNotFound:
        peers = {}  # no peer adapters here: the peer cells are explained rows
    env = {**env_info(), "peers": peers}
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
