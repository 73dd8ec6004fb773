"""`slipstream bench rollout`: generation speed of the builtin engine against the memory-bandwidth bound.

Workloads (random weights of a named preset; FLOPs and bytes do not depend on the weights):
  fixed     B samples = B / group prompts of `prompt_len` random ids, each sampled `group` times,
            `new_tokens` each, no stop tokens, temperature 1
  w1        8 prompts x 8 samples of 512 tokens, per-sample budgets linspace(256, 3584): the
            response lengths of the W1 training workload (bench/workloads.py)
  nanovllm  nano-vllm's bench.py: random.seed(0), 256 prompts of randint(100, 1024) ids in
            [0, 10000], then max_tokens randint(100, 1024) each (133,966 tokens), stop ignored

Each case runs twice: a first call (shapes the engine has not seen: an RL step always runs at
new shapes) and a repeat. tok/s = response tokens / wall time of the whole call (prefill
included); graph capture (and the compilation its warm-up triggers) is start-up time, reported
as `startup_s` and excluded, as is the engine's warm-up compile.

Bandwidth bound (decode only), per decode step: every weight is read once, plus the keys and
values of every live sample at its current context; bound tok/s = response tokens / (sum over
steps of those bytes / HBM bandwidth). `--peer hf` runs transformers' `generate` (dynamic cache;
static cache + torch.compile) on the same prompts in the same process; its compile and warm-up
are counted apart too.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch

from slipstream.config.schema import RolloutSection
from slipstream.models.config import ModelConfig
from slipstream.models.presets import get_preset
from slipstream.perf.mfu import lookup_device
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.kv_cache import kv_bytes_per_token

# HBM bandwidth (bytes/s) by device name substring, first match wins (datasheet figures).
HBM_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIE", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("A100", 2.039e12),
    ("A800", 2.039e12),
    ("L40S", 0.864e12),
)


def hbm_bandwidth(device_name: str) -> float | None:
    """HBM bandwidth (bytes/s) for a device name as torch reports it, or None if unknown."""
    return lookup_device(HBM_BANDWIDTH, device_name)


@dataclass(frozen=True)
class RolloutCase:
    """Prompts and per-sample budgets of one benchmark case."""

    name: str
    prompts: list[list[int]]
    budgets: list[list[int]]

    @property
    def num_samples(self) -> int:
        return sum(len(b) for b in self.budgets)

    @property
    def response_tokens(self) -> int:
        return sum(sum(b) for b in self.budgets)


def fixed_case(batch: int, prompt_len: int, new_tokens: int, group: int, seed: int = 0) -> RolloutCase:
    if batch % group:
        raise ValueError(f"batch {batch} must be a multiple of the group size {group}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(10_000) for _ in range(prompt_len)] for _ in range(batch // group)]
    return RolloutCase(f"fixed-b{batch}-p{prompt_len}-n{new_tokens}", prompts, [[new_tokens] * group for _ in prompts])


def w1_case(seed: int = 0) -> RolloutCase:
    """8 prompts x 8 samples, 512-token prompts, budgets linspace(256, 3584) spread over the 64 samples."""
    rng = random.Random(seed)
    budgets = [round(256 + i * (3584 - 256) / 63) for i in range(64)]
    prompts = [[rng.randrange(10_000) for _ in range(512)] for _ in range(8)]
    return RolloutCase("w1", prompts, [budgets[g * 8 : g * 8 + 8] for g in range(8)])


def nanovllm_case() -> RolloutCase:
    """nano-vllm bench.py's requests, drawn in its order: all prompts first, then all budgets."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    budgets = [[rng.randint(100, 1024)] for _ in range(256)]
    return RolloutCase("nanovllm", prompts, budgets)


def bound_tok_per_s(cfg: ModelConfig, case: RolloutCase, bandwidth: float, dtype=torch.bfloat16) -> float:
    """Decode-only bandwidth bound: all samples start together; a step reads the weights + live KV."""
    with torch.device("meta"):
        from slipstream.models.transformer import Transformer

        weight_bytes = sum(p.numel() for p in Transformer(cfg).parameters()) * torch.finfo(dtype).bits // 8
    kv = kv_bytes_per_token(cfg, dtype)
    steps = max(max(b) for b in case.budgets)
    # a sample of prompt P and budget R reads contexts P, P+1, ..., P+R-1
    kv_reads = sum(len(p) * r + r * (r - 1) // 2 for p, group in zip(case.prompts, case.budgets) for r in group)
    return case.response_tokens / ((steps * weight_bytes + kv_reads * kv) / bandwidth)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_builtin(engine, case: RolloutCase, sampling: SamplingParams, key_base: int) -> dict:
    """One generate call of `case`; wall time minus graph capture, and the engine's own breakdown."""
    device = engine.device
    engine_core = engine.core
    capture0 = engine.runner.capture_s
    _peak_reset(device)
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(case.prompts, sampling, keys=[key_base + i for i in range(len(case.prompts))], budgets=case.budgets)
    _sync(device)
    wall = time.perf_counter() - start
    capture = engine.runner.capture_s - capture0
    stats = engine.core.stats
    tokens = sum(len(s.response_ids) for g in out for s in g)
    assert tokens == case.response_tokens, (tokens, case.response_tokens)
    row = {
        "wall_s": wall,
        "capture_s": capture,
        "time_s": wall - capture,
        "tok_per_s": tokens / (wall - capture),
        "response_tokens": tokens,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_steps": stats.decode_steps,
        "ms_per_decode_step": 1e3 * stats.decode_s / max(stats.decode_steps, 1),
        # device time of the replayed decode steps; decode_s less this is the device waiting for the host
        "decode_device_s": stats.decode_device_s if engine.runner.cuda_graphs else None,
        "mean_rows_per_step": stats.decode_row_steps / max(stats.decode_steps, 1),
        "cache_reallocated": engine_core is not engine.core,
        "peak_memory_gib": _peak_gib(device),
    }
    engine.core.stats = type(stats)()
    return row


def run_hf(hf_model, case: RolloutCase, static: bool, device: torch.device) -> dict:
    """transformers `generate` on the same prompts (one row per sample, all budgets equal), EOS ignored."""
    budgets = {b for group in case.budgets for b in group}
    if len(budgets) != 1 or len({len(p) for p in case.prompts}) != 1:
        raise ValueError("the HF peer runs fixed cases only (one prompt length, one budget)")
    (new_tokens,) = budgets
    ids = torch.tensor([p for p, group in zip(case.prompts, case.budgets) for _ in group], device=device)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        pad_token_id=0, attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    if static:
        kwargs["cache_implementation"] = "static"
    _peak_reset(device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(ids, **kwargs)
    _sync(device)
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"wall_s": wall, "time_s": wall, "tok_per_s": tokens / wall, "response_tokens": int(tokens),
            "peak_memory_gib": _peak_gib(device)}  # fmt: skip


def build_cases(workload: str, batches: list[int], prompt_len: int, new_tokens: int, group: int) -> list[RolloutCase]:
    if workload == "fixed":
        return [fixed_case(b, prompt_len, new_tokens, group) for b in batches]
    if workload == "w1":
        return [w1_case()]
    if workload == "nanovllm":
        return [nanovllm_case()]
    raise ValueError(f"unknown rollout workload {workload!r}; expected fixed, w1 or nanovllm")


def bench_rollout(
    preset: str,
    workload: str = "fixed",
    batches: tuple[int, ...] = (64, 256),
    prompt_len: int = 512,
    new_tokens: int = 512,
    group: int = 8,
    peers: tuple[str, ...] = (),
    device: str | None = None,
    temperature: float = 1.0,
    compile: bool | None = None,
    cuda_graphs: bool | None = None,
    gpu_memory_fraction: float = 0.6,
    profile: str | None = None,
    profile_first: bool = False,
    decode_attention: tuple[str, ...] = ("triton",),
    peer_batches: tuple[int, ...] | None = None,
    steps_per_sync: int = 16,
    overlap_decode: bool = True,
    kernels: RolloutSection | None = None,
    log=print,
    on_row=None,
) -> list[dict]:
    """Rows of (engine, case, call) results; see the module docstring. `kernels`: the rollout section whose
    kernel settings the engine takes (layer_kernels, fused_lm_head, decode_launch, decode_programs_per_sm;
    default: the config's defaults). `on_row(rows)` runs after every row (the command writes its results file
    there, so a run cut short keeps what it measured)."""
    from slipstream.rollout.builtin import BuiltinRollout

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = get_preset(preset)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    cases = build_cases(workload, list(batches), prompt_len, new_tokens, group)
    if cfg.vocab_size <= 10_000:  # test presets: fold the random ids into the vocabulary
        cases = [replace(c, prompts=[[t % cfg.vocab_size for t in p] for p in c.prompts]) for c in cases]
    max_rows = max(c.num_samples for c in cases)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=1, stop_token_ids=())
    rows: list[dict] = []
    kernels = kernels or RolloutSection()

    for kernel in decode_attention:
        start = time.perf_counter()
        engine = BuiltinRollout(
            cfg, dev, dtype, max_batch_size=max_rows, seed=0, compile=compile, cuda_graphs=cuda_graphs,
            gpu_memory_fraction=gpu_memory_fraction, decode_attention=kernel, decode_steps_per_sync=steps_per_sync,
            overlap_decode=overlap_decode, layer_kernels=kernels.layer_kernels, fused_lm_head=kernels.fused_lm_head,
            decode_launch=kernels.decode_launch, decode_programs_per_sm=kernels.decode_programs_per_sm,
        )  # fmt: skip
        engine.warmup(sampling)
        _sync(dev)
        warmup_s = time.perf_counter() - start
        log(f"[rollout] {preset} engine ({kernel} decode attention) ready in {warmup_s:.1f} s (weights, compile, warm-up)")
        settings = {"compile": engine.runner.compile, "cuda_graphs": engine.runner.cuda_graphs,
                    "decode_attention": kernel if dev.type == "cuda" else "sdpa", "dtype": str(dtype).removeprefix("torch."),
                    "decode_steps_per_sync": steps_per_sync, "overlap_decode": overlap_decode,
                    "fused_lm_head": engine.runner.fused_lm_head and dev.type == "cuda",
                    "layer_kernels": engine.runner.layer_kernels}  # fmt: skip
        if kernel == "triton" and dev.type == "cuda":  # the launch the row ran with
            settings.update(
                decode_launch=dict(engine.runner.decode_launch), programs_per_sm=engine.runner.decode_programs_per_sm
            )
        label = "slipstream" if len(decode_attention) == 1 else f"slipstream-{kernel}"
        for case in cases:
            bound = bound_tok_per_s(cfg, case, bandwidth) if bandwidth else None
            for call in ("first", "repeat"):
                run = lambda e=engine, c=case: run_builtin(e, c, sampling, key_base=1000 * len(rows))  # noqa: E731
                if profile and profile_first and call == "first" and case is cases[0]:
                    r = _profiled(run, dev, profile.replace(".txt", f"-{kernel}-first.txt"))
                    r["profiled"] = True  # its time includes the profiler's overhead
                else:
                    r = run()
                r.update(engine=label, preset=preset, case=case.name, call=call, samples=case.num_samples,
                         bound_tok_per_s=bound, bound_frac=(r["tok_per_s"] / bound) if bound else None,
                         startup_s=warmup_s + r["capture_s"], settings=settings)  # fmt: skip
                rows.append(r)
                log(_line(r))
                if on_row:
                    on_row(rows)
            if profile and not profile_first and case is cases[0]:
                extra = lambda e=engine, c=case: run_builtin(e, c, sampling, key_base=10**6)  # noqa: E731
                _profiled(extra, dev, profile.replace(".txt", f"-{kernel}.txt"))
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    peer_cases = [c for c in cases if peer_batches is None or c.num_samples in peer_batches]
    for peer in peers:
        for r in _hf_rows(preset, peer_cases, dev, dtype, peer, log):
            rows.append(r)
            if on_row:
                on_row(rows)
    return rows


def _profiled(fn, device: torch.device, path: str):
    """fn() under torch.profiler; writes its kernels by total device time and its host operations by own host
    time (allocations, compiles and launches outside the graphs show there) as text tables; returns fn()."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
    table = lambda sort: prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)  # noqa: E731
    device_table = table("cuda_time_total") + "\n\n" if device.type == "cuda" else ""
    Path(path).write_text(device_table + table("self_cpu_time_total"))
    return result


def _hf_rows(preset: str, cases: list[RolloutCase], dev: torch.device, dtype, peer: str, log):
    if peer != "hf":
        raise ValueError(f"unknown rollout peer {peer!r}; expected hf")
    from slipstream.bench.naive import build_hf_model, copy_native_weights
    from slipstream.models.transformer import Transformer

    cfg = get_preset(preset)
    native = Transformer(cfg)
    native.init_weights(0)
    hf_model = build_hf_model(cfg, dtype, dev)
    copy_native_weights(hf_model, native)
    hf_model.eval()
    for static in (False, True):
        label = "hf-static-compile" if static else "hf-dynamic"
        for case in cases:
            start = time.perf_counter()
            # warm-up: the dynamic cache at a small shape; the static cache at this very shape, because its
            # compiled decode step is specialised to the batch and cache length (the compile is start-up time)
            warm = case if static else replace(case, prompts=case.prompts[:1], budgets=[[8]])
            run_hf(hf_model, warm, static, dev)
            startup = time.perf_counter() - start
            for call in ("first", "repeat"):
                r = run_hf(hf_model, case, static, dev)
                r.update(engine=label, preset=preset, case=case.name, call=call,
                         samples=case.num_samples, startup_s=startup,
                         settings={"cache": "static" if static else "dynamic", "compile": static,
                                   "attn": "sdpa", "dtype": str(dtype).removeprefix("torch.")})  # fmt: skip
                log(_line(r))
                yield r


def decode_idle(row: dict) -> float | None:
    """Share of a rollout row's decode wall time outside its graph replays (CUDA events): at least the share in
    which the device waited for the host's look at the tokens every ring, slot reuse and launches; None where
    not measured."""
    if row.get("decode_device_s") is None or not row.get("decode_s"):
        return None
    return max(0.0, 1.0 - row["decode_device_s"] / row["decode_s"])


def _line(r: dict) -> str:
    bound = f", {r['bound_frac']:.1%} of bound" if r.get("bound_frac") else ""
    step = f", {r['ms_per_decode_step']:.2f} ms/step" if "ms_per_decode_step" in r else ""
    idle = decode_idle(r)
    step += f", device idle {idle:.1%} of the decode" if idle is not None else ""
    return (f"[rollout] {r['engine']:<18} {r['case']:<24} {r['call']:<6} {r['tok_per_s']:>9,.0f} tok/s "
            f"({r['time_s']:.2f} s{step}{bound})")  # fmt: skip


def run_rollout_command(args) -> int:
    import json
    import sys
    from pathlib import Path

    from slipstream.bench.train_step import env_info

    def write(rows: list[dict]) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=2))

    env = env_info()
    try:
        if args.profile_first and not args.profile:
            raise ValueError("--profile-first needs --profile FILE")
        if args.steps_per_sync < 1:
            raise ValueError(f"--steps-per-sync must be >= 1, got {args.steps_per_sync}")
        # the flags set the rollout section's kernel fields (validated there), at its defaults when not given
        given = {"decode_launch": args.decode_launch, "decode_programs_per_sm": args.decode_programs_per_sm}
        kernels = RolloutSection(
            layer_kernels=not args.no_layer_kernels, fused_lm_head=args.fused_lm_head,
            **{key: value for key, value in given.items() if value is not None},
        )
        batches = tuple(int(b) for b in args.batch.split(","))
        rows = bench_rollout(
            args.preset, args.workload, batches, args.prompt_len, args.new_tokens, args.group, tuple(args.peer),
            device=args.device, temperature=args.temperature, compile=False if args.no_compile else None,
            cuda_graphs=False if args.no_cuda_graphs else None, profile=args.profile, profile_first=args.profile_first,
            decode_attention=tuple(args.decode_attention.split(",")),
            peer_batches=tuple(int(b) for b in args.peer_batch.split(",")) if args.peer_batch else None,
            steps_per_sync=args.steps_per_sync, overlap_decode=not args.no_overlap_decode, kernels=kernels,
            on_row=write,
        )  # fmt: skip
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    print_rollout_table(rows)
    return 0


def print_rollout_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollout")
    cols = ("engine", "case", "call", "tok/s", "s", "ms/step", "prefill s", "decode idle", "bound", "of bound",
            "startup s", "GiB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("engine", "case", "call") else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        table.add_row(
            r["engine"], r["case"], r["call"], f"{r['tok_per_s']:,.0f}", f"{r['time_s']:.2f}",
            fmt(r.get("ms_per_decode_step"), ".2f"), fmt(r.get("prefill_s"), ".2f"), fmt(decode_idle(r), ".1%"),
            fmt(r.get("bound_tok_per_s"), ",.0f"), fmt(r.get("bound_frac"), ".1%"), fmt(r.get("startup_s"), ".1f"),
            fmt(r.get("peak_memory_gib"), ".1f"),
        )  # fmt: skip
    Console(width=200).print(table)
