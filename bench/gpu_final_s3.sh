#!/usr/bin/env bash
# Last device call of 2026-12-02 (session 3), ordered by what the issues still need: the W1 train-step
# matrix (bench/matrix_w1.yaml; cells are appended as they finish, --resume finishes the rest later),
# the GRPO demo with actor.backend=megatron on CUDA, the rl-step matrix on the GPU, then the fixed GPU
# tests (Megatron vs FSDP, FSDP offload vs fp32, GQA paths) and varlen vs flex for what time is left.
# Needs .whl (incl. .whl/verl) carried. DEADLINE = seconds for the whole script (default 540).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/verl-site .whl/verl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 SLIPSTREAM_VERL_SITE=/tmp/verl-site
RES=/tmp/res5; rm -rf $RES; mkdir -p $RES/matrix
quiet() { grep -v -i -E "warn|^[0-9:]+ INFO|^\s+(decoder|embedding|output_layer)\.|return func|Params for bucket|^\s*$"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }; stamp() { echo "[t+$(el)s] $*"; }
left() { local t=$(( ${DEADLINE:-540} - $(el) - ${1:-0} )); [ $t -lt 1 ] && t=1; echo $t; }  # never 0 (= no limit)
trap 'tar czf $OUT/results.tgz -C $RES .' EXIT
stamp train-step matrix
[ -f docs/results/matrix-w1/results.jsonl ] && cp docs/results/matrix-w1/results.jsonl $RES/matrix/
timeout ${MATRIX_S:-290} python -m slipstream.cli bench matrix ${MATRIX_SPEC:-bench/matrix_w1.yaml} --out $RES/matrix --resume 2>&1 \
    | grep -E "^cell|  -> "
stamp demo megatron
timeout 70 python -m slipstream.cli train recipes/demo.yaml actor.backend=megatron trainer.device=cuda \
    trainer.run_dir=$RES/demo-megatron trainer.tensorboard=false trainer.log_every=50 2>&1 | quiet | tail -3
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
