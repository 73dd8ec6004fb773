#!/usr/bin/env bash
# Device call 3 of 2026-12-02 (session 3): Megatron GPU tests (fixed), FSDP offload vs fp32, W1 on
# megatron and fsdp at 16k (no compile, no recompute: equal footing), GRPO demo with megatron on CUDA,
# rl-step matrix on the GPU. Needs .whl carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
RES=/tmp/res3; rm -rf $RES; mkdir -p $RES
quiet() { grep -v -i -E "warn|^[0-9:]+ INFO|^\s+(decoder|embedding|output_layer)\.|return func|Params for bucket|^\s*$"; }
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
stamp tests
timeout 150 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py \
    "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|Error" $RES/gpu_tests.txt | head -12
for b in megatron fsdp; do
  stamp W1 $b 16k
  timeout 100 python -m slipstream.cli bench train-step --workload W1 --backend $b --max-tokens-per-mb 16384 \
      --repeats 3 --out $RES/w1_${b}_16k.json 2>&1 | quiet | tail -3
done
stamp demo megatron
timeout 80 python -m slipstream.cli train recipes/demo.yaml actor.backend=megatron trainer.device=cuda \
    trainer.run_dir=$RES/demo-megatron trainer.tensorboard=false trainer.log_every=50 2>&1 | quiet | tail -4
cp $RES/demo-megatron/metrics.jsonl $RES/demo_megatron_metrics.jsonl; rm -rf $RES/demo-megatron
stamp rl-step matrix
timeout 150 python -m slipstream.cli bench matrix bench/matrix_rl_step_gpu.yaml --out $RES/rl-step 2>&1 | quiet \
    | grep -E "^\| demo|kept|->" | head -12
stamp done
tar czf $OUT/results.tgz -C $RES .
