#!/usr/bin/env bash
# Next device call (written in session 4, not run yet), ordered by what the open issues still need:
# the FSDP offload-vs-fp32 and GQA-path GPU tests (issue 3), the verl W1-0.6b cell (issue 5; --resume keeps
# the measured rows), qwen3-8b at an 8k budget (issue 3), varlen vs flex (issue 3), then for the record of
# issue 4: the Megatron W1 update after the norm-dtype fix (52a9f1b) and the SwiGLU / residual-add fusions, the FSDP full-recompute profile
# that makes the gap breakdown like-for-like, and the Megatron GPU parity tests again (numerics changed on CUDA).
# Carry .whl (incl. .whl/verl). DEADLINE = seconds for the whole script (default 560).
. bench/gpu_lib.sh
: "${DEADLINE:=560}"
gpu_setup /tmp/res w06 suite
stamp tests
timeout 80 python -m pytest -q -s -p no:cacheprovider "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" \
    "tests/gpu/test_attention_gpu.py::test_gqa_native_and_repeated_paths_match_reference" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|natively" $RES/gpu_tests.txt | head -8
stamp verl W1-0.6b
cp docs/results/matrix-w1-06b/results.jsonl $RES/w06/
timeout $(cap 240 200) python -m slipstream.cli bench matrix bench/matrix_w1_06b.yaml --out $RES/w06 --resume > $RES/w06.log 2>&1
grep -E "^\| W1-0.6b \(" $RES/w06.log | cut -c1-160
stamp qwen3-8b
OUT=$RES/suite timeout $(cap 150 110) python bench/train_step_suite.py --only w1-8b-fsdp-8k --budget-s $(cap 145 115) 2>&1 | quiet | tail -4
stamp varlen vs flex
timeout $(cap 60 100) python bench/bench_attention.py 2>&1 | quiet | tail -6 | tee $RES/attention.txt
stamp megatron W1 after the norm-dtype fix
timeout $(cap 130 45) python bench/profile_step.py --backend megatron --activation-checkpointing full --max-tokens-per-mb 32768 \
    --out $RES/profile_megatron.json > $RES/profile_megatron.log 2>&1; quiet < $RES/profile_megatron.log | head -14
stamp fsdp W1 full recompute profile
timeout $(cap 80 60) python bench/profile_step.py --backend fsdp --activation-checkpointing full --max-tokens-per-mb 32768 \
    --compile --out $RES/profile_fsdp_full.json > $RES/profile_fsdp.log 2>&1; quiet < $RES/profile_fsdp.log | head -14
stamp megatron GPU parity tests after 52a9f1b and the fusions
timeout $(left 2) python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py 2>&1 | quiet > $RES/gpu_tests_megatron.txt
grep -E "^\| |passed|failed|FAILED" $RES/gpu_tests_megatron.txt | head -6
stamp done
