#!/usr/bin/env bash
# Session 4, device call 1 (issues 5, 4, 3): the verl W1 fsdp cell (matrix_w1_core --resume keeps the two
# slipstream rows already measured), the W1-0.6b matrix (every framework x backend), the kernel-time
# profiles of the Megatron and FSDP updates at the W1-core settings (full recompute, 32k, no compile), then
# the fixed GPU tests. Needs .whl (incl. .whl/verl) carried. DEADLINE = seconds for the whole script.
. bench/gpu_lib.sh
: "${DEADLINE:=575}"
gpu_setup /tmp/res w1core w06
stamp verl W1
cp docs/results/matrix-w1-core/results.jsonl $RES/w1core/
timeout 230 python -m slipstream.cli bench matrix bench/matrix_w1_core.yaml --out $RES/w1core --resume > $RES/w1core.log 2>&1
grep -E "^cell|  -> |^\| W1" $RES/w1core.log | tail -6; grep -E "Error|error" $RES/w1core.log | tail -3
stamp W1-0.6b matrix
timeout $(( $(left 150) < 210 ? $(left 150) : 210 )) python -m slipstream.cli bench matrix bench/matrix_w1_06b.yaml --out $RES/w06 > $RES/w06.log 2>&1
grep -E "^\| W1" $RES/w06.log | cut -c1-150
stamp profiles
timeout 75 python bench/profile_step.py --backend megatron --activation-checkpointing full --max-tokens-per-mb 32768 \
    --out $RES/profile_megatron.json 2>&1 | quiet | tail -14
timeout $(left 80) python bench/profile_step.py --backend fsdp --activation-checkpointing full --max-tokens-per-mb 32768 \
    --out $RES/profile_fsdp_full.json 2>&1 | quiet | tail -14
stamp tests
timeout $(left 3) python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py \
    "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" \
    "tests/gpu/test_attention_gpu.py::test_gqa_native_and_repeated_paths_match_reference" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|natively" $RES/gpu_tests.txt | head -14
stamp done
