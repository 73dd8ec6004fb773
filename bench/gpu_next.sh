#!/usr/bin/env bash
# The next single-GPU device call (written in session 5, not run): what session 5 could not measure.
#  1. the W1 slipstream-fsdp update with bf16 master weights after the optimizer became one compiled kernel
#     (78eef86) and the review fixes (cacb60f): train-step alone, then its kernel profile (optimizer row vs 205 ms);
#  2. the W1 Megatron matrix cell after 52a9f1b / 9b35bb2 (--resume keeps the other W1 rows);
#  3. the two Megatron GPU parity tests session 5's call C cut off (bf16 20-step curve, offload round trip).
# Carry .whl (incl. .whl/verl). DEADLINE = seconds for the whole script.
. bench/gpu_lib.sh
: "${DEADLINE:=580}"
gpu_setup /tmp/res core
stamp "W1 fsdp bf16 master, compiled optimizer"
timeout 120 python -m slipstream.cli bench train-step --workload W1 --backend fsdp --ac full --compile \
    --max-tokens-per-mb 32768 --master-dtype bfloat16 --repeats 2 --out $RES/w1_bf16.json 2>&1 | quiet | grep "│ slipstream"
timeout 80 python bench/profile_step.py --backend fsdp --activation-checkpointing full --max-tokens-per-mb 32768 \
    --compile --master-dtype bfloat16 --out $RES/profile_fsdp_bf16.json > $RES/profile_fsdp_bf16.log 2>&1
quiet < $RES/profile_fsdp_bf16.log | grep -v "^\s" | head -14
stamp "W1 megatron cell"
grep -v '"cell": "W1/slipstream/megatron"' docs/results/matrix-w1-core/results.jsonl > $RES/core/results.jsonl
SLIPSTREAM_VERL_SITE=/tmp/verl-site timeout 150 python -m slipstream.cli bench matrix bench/matrix_w1_core.yaml \
    --out $RES/core --resume > $RES/core.log 2>&1
grep -E "^\| W1 \(|^cell|  -> |error" $RES/core.log | cut -c1-200 | tail -8
stamp "megatron GPU parity tests"
timeout $(left 2) python -m pytest -q -s -p no:cacheprovider --durations=5 "tests/gpu/test_megatron_engine_gpu.py::test_first_step_and_20_step_curve_vs_fsdp[bf16]" \
    tests/gpu/test_megatron_engine_gpu.py::test_offload_onload_round_trip 2>&1 | quiet > $RES/gpu_tests_megatron.txt
grep -E "^\| |passed|failed|FAILED|s call|^ *(0|19) \|" $RES/gpu_tests_megatron.txt | head -12
stamp done
