#!/usr/bin/env bash
# Megatron engine on one H200 (issue 4): (a) the GPU parity tests, (b) W1 (qwen3-1.7b) train step
# with --backend fsdp and --backend megatron at the same micro-batch budget, (c) the GRPO demo recipe
# with actor.backend=fsdp and =megatron, reward trend side by side. The W1 table is printed last.
# megatron-core is not installed on the GPU machine: carry its wheel (Python 3.12) in .whl/.
# Usage (repo root): OUT=/some/dir bash bench/gpu_megatron.sh [max tokens per micro-batch, default 16384]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
RES=${OUT:-/tmp}/megatron; mkdir -p "$RES"
CAP=${1:-16384}
quiet() { grep -v -i -E "warn|^[0-9:]+ INFO|^\s+(decoder|embedding|output_layer)\.|return func|Params for bucket"; }

# (a) parity: engine vs FSDP (log-probs fp32/bf16, first step, 20-step curve, offload) and the provider
timeout 300 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py \
    tests/gpu/test_megatron_gpu.py 2>&1 | quiet | tail -70 | tee "$RES/gpu_tests.txt"

# (b) W1 train step, same planner and cap for both backends
for backend in fsdp megatron; do
    timeout 280 python -m slipstream.cli bench train-step --workload W1 --backend $backend \
        --max-tokens-per-mb "$CAP" --repeats 3 --out "$RES/w1_$backend.json" 2>&1 | quiet | tail -6
done

# (c) the GRPO demo (200 steps) on CUDA with each backend
for backend in fsdp megatron; do
    timeout 150 python -m slipstream.cli train recipes/demo.yaml actor.backend=$backend trainer.device=cuda \
        trainer.run_dir="$RES/demo-$backend" logging.tensorboard=false logging.log_every=50 2>&1 | quiet | tail -5
    rm -rf "$RES/demo-$backend/checkpoints" "$RES/demo-$backend/hf"
done

python - "$RES" <<'EOF'
import json, sys
from pathlib import Path

res = Path(sys.argv[1])
print("\nGRPO demo reward/mean (mean over 20-step windows)")
print("backend  | steps 1-20 | 91-110 | 181-200 | last grad_norm")
for backend in ("fsdp", "megatron"):
    path = res / f"demo-{backend}" / "metrics.jsonl"
    if not path.exists():
        print(f"{backend:8s} | missing"); continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    window = lambda a, b: sum(r["reward/mean"] for r in rows[a:b]) / max(1, len(rows[a:b]))
    print(f"{backend:8s} | {window(0, 20):10.3f} | {window(90, 110):6.3f} | {window(180, 200):7.3f} | "
          f"{rows[-1].get('actor/grad_norm', float('nan')):.4f}")

print("\nW1 (qwen3-1.7b) train step, one H200, bf16")
print("backend  | #mb | train s | train tok/s | MFU    | train GiB | logp s | logp GiB | grad_norm")
base = None
for backend in ("fsdp", "megatron"):
    path = res / f"w1_{backend}.json"
    if not path.exists():
        print(f"{backend:8s} | missing"); continue
    r = json.loads(path.read_text())["slipstream"]
    t, f = r["phases"]["actor_train"], r["phases"]["log_probs"]
    base = base or t["tok_per_s"]
    mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "-"
    print(f"{backend:8s} | {r['micro_batches']['count']:3d} | {t['time_s']:7.3f} | {t['tok_per_s']:11,.0f} | {mfu:6s} | "
          f"{t['peak_memory_gib']:9.1f} | {f['time_s']:6.3f} | {f['peak_memory_gib']:8.1f} | "
          f"{r['train_metrics'].get('actor/grad_norm', float('nan')):.4f}   ({t['tok_per_s'] / base:.2f}x fsdp)")
EOF
