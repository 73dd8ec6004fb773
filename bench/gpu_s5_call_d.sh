#!/usr/bin/env bash
# Session 5, device call D: what call C's time limit cut: the last two Megatron GPU parity tests (bf16 20-step
# curve, offload round trip) and the W1 Megatron matrix cell after 52a9f1b / 9b35bb2 (--resume keeps the other
# W1 rows; rows recorded before `master_dtype` existed count at its default). Carry .whl.
. bench/gpu_lib.sh
: "${DEADLINE:=400}"
gpu_setup /tmp/res core
stamp W1 megatron cell
grep -v '"cell": "W1/slipstream/megatron"' docs/results/matrix-w1-core/results.jsonl > $RES/core/results.jsonl
SLIPSTREAM_VERL_SITE=/tmp/verl-site timeout 150 python -m slipstream.cli bench matrix bench/matrix_w1_core.yaml \
    --out $RES/core --resume > $RES/core.log 2>&1
grep -E "^\| W1 \(|^cell|  -> |error" $RES/core.log | cut -c1-200 | tail -8
stamp megatron GPU parity tests, the two call C did not reach
timeout $(left 2) python -m pytest -q -s -p no:cacheprovider --durations=5 "tests/gpu/test_megatron_engine_gpu.py::test_first_step_and_20_step_curve_vs_fsdp[bf16]" \
    tests/gpu/test_megatron_engine_gpu.py::test_offload_onload_round_trip 2>&1 | quiet > $RES/gpu_tests_megatron.txt
grep -E "^\| |passed|failed|FAILED|s call|^ *(0|19) \|" $RES/gpu_tests_megatron.txt | head -12
stamp done
