#!/usr/bin/env bash
# Session 4, device call 2: what call 1 ran out of time for: the fixed GPU tests (Megatron vs FSDP, FSDP
# offload vs fp32, both GQA paths), the Megatron update's kernel-time profile (issue 4's gap breakdown),
# the verl W1-0.6b cell (--resume keeps call 1's rows), then the GPU rl-step matrix. DEADLINE = seconds.
. bench/gpu_lib.sh
: "${DEADLINE:=520}"
gpu_setup /tmp/res w06 rl
stamp tests
timeout 170 python -m pytest -q -s -p no:cacheprovider --durations=0 tests/gpu/test_megatron_engine_gpu.py \
    "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" \
    "tests/gpu/test_attention_gpu.py::test_gqa_native_and_repeated_paths_match_reference" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|natively" $RES/gpu_tests.txt | head -16
stamp profile megatron
timeout 130 python bench/profile_step.py --backend megatron --activation-checkpointing full --max-tokens-per-mb 32768 \
    --out $RES/profile_megatron.json > $RES/profile_megatron.log 2>&1; quiet < $RES/profile_megatron.log | tail -16
stamp verl W1-0.6b
cp docs/results/matrix-w1-06b/results.jsonl $RES/w06/
timeout $(( $(left 60) < 170 ? $(left 60) : 170 )) python -m slipstream.cli bench matrix bench/matrix_w1_06b.yaml --out $RES/w06 --resume > $RES/w06.log 2>&1
grep -E "^\| W1-0.6b \(" $RES/w06.log | cut -c1-160
stamp rl-step
timeout $(left 2) python -m slipstream.cli bench matrix bench/matrix_rl_step_gpu.yaml --out $RES/rl > $RES/rl.log 2>&1
grep -E "^cell|  -> " $RES/rl.log | cut -c1-200 | tail -12
stamp done
