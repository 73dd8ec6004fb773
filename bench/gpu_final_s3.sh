#!/usr/bin/env bash
# Last device call of 2026-12-02 (session 3), ordered by what the issues still need: the W1 train-step
# matrix (bench/matrix_w1.yaml; cells are appended as they finish, --resume finishes the rest later),
# the GRPO demo with actor.backend=megatron on CUDA, the rl-step matrix on the GPU, then the fixed GPU
# tests (Megatron vs FSDP, FSDP offload vs fp32, GQA paths) and varlen vs flex for what time is left.
# Needs .whl (incl. .whl/verl) carried. DEADLINE = seconds for the whole script (default 540).
. bench/gpu_lib.sh
: "${DEADLINE:=540}"
gpu_setup /tmp/res5 matrix
stamp train-step matrix
[ -f docs/results/matrix-w1/results.jsonl ] && cp docs/results/matrix-w1/results.jsonl $RES/matrix/
timeout ${MATRIX_S:-290} python -m slipstream.cli bench matrix ${MATRIX_SPEC:-bench/matrix_w1.yaml} --out $RES/matrix --resume 2>&1 \
    | grep -E "^cell|  -> "
stamp demo megatron
timeout 70 python -m slipstream.cli train recipes/demo.yaml actor.backend=megatron trainer.device=cuda \
    trainer.run_dir=$RES/demo-megatron logging.tensorboard=false logging.log_every=50 2>&1 | quiet | tail -3
cp $RES/demo-megatron/metrics.jsonl $RES/demo_megatron_metrics.jsonl; rm -rf $RES/demo-megatron
stamp rl-step matrix
timeout $(( $(left) < 100 ? $(left) : 100 )) python -m slipstream.cli bench matrix bench/matrix_rl_step_gpu.yaml \
    --out $RES/rl-step 2>&1 | quiet | grep -E "^\| demo|  -> " | head -12
stamp tests
timeout $(left 45) python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py \
    "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" \
    "tests/gpu/test_attention_gpu.py::test_gqa_native_and_repeated_paths_match_reference" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|Error|natively" $RES/gpu_tests.txt | head -12
stamp attention backends
timeout $(left 3) python bench/bench_attention.py 2>&1 | quiet | tail -3 | tee $RES/attention.txt
stamp done
