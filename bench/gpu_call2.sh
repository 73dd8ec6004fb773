#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (session 3): Megatron engine on the GPU (parity tests, W1), the W1
# FSDP step after the log-prob / GQA changes, offload diagnosis, GPU kernel tests, profile.
# Needs .whl (megatron-core, trl, datasets, dill, multiprocess for Python 3.12) carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
RES=/tmp/res2; rm -rf $RES; mkdir -p $RES
quiet() { grep -v -i -E "warn|^[0-9:]+ INFO|^\s+(decoder|embedding|output_layer)\.|return func|Params for bucket|^\s*$"; }
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
stamp megatron tests
timeout 170 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_engine_gpu.py tests/gpu/test_megatron_gpu.py \
    2>&1 | quiet > $RES/megatron_tests.txt; tail -45 $RES/megatron_tests.txt
stamp megatron W1
timeout 130 python -m slipstream.cli bench train-step --workload W1 --backend megatron --max-tokens-per-mb 32768 \
    --repeats 3 --out $RES/w1_megatron.json 2>&1 | quiet | tail -4
stamp fsdp W1 compile
OUT=$RES/suite timeout 140 python bench/train_step_suite.py --budget-s 135 --only w1-1.7b-fsdp-32k-compile 2>&1 | tail -2
stamp offload diag
timeout 60 python bench/diag_offload.py 2>&1 | quiet | tail -40 > $RES/diag_offload.txt; grep -E "step|<--|embed" $RES/diag_offload.txt | head -12
stamp kernel tests
timeout 100 python -m pytest -q -p no:cacheprovider tests/gpu/test_logprobs_gpu.py tests/gpu/test_attention_gpu.py \
    "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" 2>&1 | tail -4
stamp profile
timeout 110 python bench/profile_step.py --workload W1 --backend fsdp --max-tokens-per-mb 32768 --compile \
    --out $RES/profile.json > $RES/profile.txt 2>&1; grep -v -i warn $RES/profile.txt | tail -45
stamp done
tar czf $OUT/results.tgz -C $RES .
