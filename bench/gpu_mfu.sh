#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (session 3): GPU tests, where the W1 update's time goes (kernel
# categories + graph breaks), larger micro-batches, native GQA, and qwen3-8b on one GPU.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RES=/tmp/slipstream_res; rm -rf $RES; mkdir -p $RES
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $RES/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu -k "not megatron" 2>&1 | tail -8 | tee $RES/gpu_tests.txt
python -c "
import torch; from slipstream.ops import attention as a
print('native GQA through varlen_attn on this torch:', a.probe_native_gqa(torch.device('cuda')))" | tee $RES/gqa.txt
TORCH_LOGS=graph_breaks timeout 150 python bench/profile_step.py --workload W1 --backend fsdp --max-tokens-per-mb 32768 \
    --compile --out $RES/profile-w1-32k-compile.json > $RES/profile.txt 2>&1
grep -c "Graph break" $RES/profile.txt | sed 's/^/graph breaks logged: /'
grep -v -i "warn" $RES/profile.txt | tail -32
OUT=$RES/suite timeout 330 python bench/train_step_suite.py --budget-s 320 \
    --only w1-1.7b-fsdp-32k-compile,w1-1.7b-fsdp-64k-compile-sel,w1-8b-fsdp 2>&1 | tail -6
tar czf $OUT/results.tgz -C $RES .
