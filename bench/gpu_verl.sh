#!/usr/bin/env bash
# The verl cells of issue 5 on one H200: verl 0.9.1's own FSDP actor on W1 (qwen3-1.7b) and on
# qwen3-0.6b with the same lengths, from its own site directory.
# Needs .whl/verl carried (bash bench/peers_verl_wheels.sh gpu, ~17 MiB). Run from the repo root:
#   bash bench/gpu_verl.sh            (writes $OUT/verl/results.jsonl + matrix.md, prints a table last)
# The full matrix with verl afterwards (slipstream + TRL + verl, FSDP + Megatron):
#   SLIPSTREAM_VERL_SITE=/tmp/verl-site python3 -m slipstream.cli bench matrix bench/matrix_w1.yaml --out $OUT/matrix
set -u
OUT=${OUT:-bench_results}
SITE=/tmp/verl-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/verl/*.whl
export SLIPSTREAM_VERL_SITE=$SITE PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT/verl"

# 1. The site imports verl's actor path with its own transformers (stand-ins for ray & co.).
PYTHONPATH=$SITE:$PWD/slipstream/bench/peers/stubs:$PWD python3 -c "
import transformers, tensordict, verl, ray
from verl.workers.engine_workers import TrainingWorker
print('verl', verl.__version__, 'transformers', transformers.__version__, 'tensordict', tensordict.__version__,
      'ray stand-in', ray.IS_SLIPSTREAM_STANDIN)" 2>&1 | grep -v -i warn | tail -3

# 2. CPU checks of the cell against this site (layout, rows, verl on CPU, log-probs equal slipstream's).
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_bench_verl.py 2>&1 | tail -3

# 3. The verl cells on the GPU.
cat > "$OUT/verl/spec.yaml" <<'EOF'
mode: train-step
workloads:
  - W1
  - like: W1
    name: W1-0.6b
    preset: qwen3-0.6b
frameworks: [verl]
backends: [fsdp, megatron]
dtype: bfloat16
recompute: full
max_tokens_per_mb: 32768
repeats: 3
warmup: 1
peers:
  verl: {attn_implementation: sdpa, use_remove_padding: false, strategy: fsdp2, use_dynamic_bsz: true}
EOF
timeout 540 python3 -m slipstream.cli bench matrix "$OUT/verl/spec.yaml" --out "$OUT/verl" 2>&1 | grep -v -i warn | tail -12

# 4. The short table.
python3 - "$OUT/verl/results.jsonl" <<'EOF'
import json, sys
print(f"{'cell':28} {'status':14} {'train tok/s':>11} {'MFU':>6} {'peak GiB':>9} {'logp tok/s':>10} {'peak GiB':>9} {'pad %':>6}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["status"] != "ok":
        print(f"{r['cell']:28} {r['status']:14} {(r['reason'] or '').splitlines()[0][:90]}")
        continue
    t, f = r["phases"]["actor_train"], r["phases"]["log_probs"]
    mfu = f"{100 * t['mfu']:.1f}" if t["mfu"] else "-"
    print(f"{r['cell']:28} {r['status']:14} {t['tok_per_s']:11.0f} {mfu:>6} {t['peak_memory_gib']:9.1f} "
          f"{f['tok_per_s']:10.0f} {f['peak_memory_gib']:9.1f} {100 * r['fairness']['padding_fraction']:6.1f}")
EOF
