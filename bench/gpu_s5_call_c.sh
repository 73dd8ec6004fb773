#!/usr/bin/env bash
# Session 5, device call C: the Megatron GPU parity tests after 52a9f1b (norm dtype) and 9b35bb2 (fusions),
# the W1 Megatron matrix cell again with those commits (--resume keeps the other W1 rows), and the
# like-for-like FSDP W1 kernel profiles at full recompute (bf16 and fp32 master weights) for the gap
# breakdown. Carry .whl. DEADLINE = seconds for the whole script.
. bench/gpu_lib.sh
: "${DEADLINE:=480}"
gpu_setup /tmp/res core
stamp megatron GPU parity tests
timeout 150 python -m pytest -q -s -p no:cacheprovider --durations=5 tests/gpu/test_megatron_engine_gpu.py 2>&1 | quiet > $RES/gpu_tests_megatron.txt
grep -E "^\| |passed|failed|FAILED|s call" $RES/gpu_tests_megatron.txt | head -12
stamp W1 megatron cell
grep -v '"cell": "W1/slipstream/megatron"' docs/results/matrix-w1-core/results.jsonl > $RES/core/results.jsonl
SLIPSTREAM_VERL_SITE=/tmp/verl-site timeout $(cap 110 120) python -m slipstream.cli bench matrix bench/matrix_w1_core.yaml \
    --out $RES/core --resume > $RES/core.log 2>&1
grep -E "^\| W1 \(|^cell|  -> " $RES/core.log | cut -c1-200 | tail -8
stamp fsdp W1 full recompute profile, bf16 master
timeout $(cap 80 50) python bench/profile_step.py --backend fsdp --activation-checkpointing full --max-tokens-per-mb 32768 \
    --compile --master-dtype bfloat16 --out $RES/profile_fsdp_full_bf16.json > $RES/profile_fsdp_bf16.log 2>&1
quiet < $RES/profile_fsdp_bf16.log | grep -v "^\s" | head -14
stamp fsdp W1 full recompute profile, fp32 master
timeout $(left 2) python bench/profile_step.py --backend fsdp --activation-checkpointing full --max-tokens-per-mb 32768 \
    --compile --out $RES/profile_fsdp_full.json > $RES/profile_fsdp.log 2>&1
quiet < $RES/profile_fsdp.log | grep -v "^\s" | head -14
stamp done
