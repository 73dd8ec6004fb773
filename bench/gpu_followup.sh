#!/usr/bin/env bash
# Second device call of 2026-12-02: the offload test in detail, the demo recipe on CUDA, equal-memory rows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RES=/tmp/slipstream_res2; rm -rf $RES; mkdir -p $RES
timeout 120 python -m pytest -q --timeout 100 -p no:cacheprovider --tb=short \
    tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload 2>&1 | grep -v Warning | tail -30 | tee $RES/offload_test.txt
timeout 120 python -m slipstream.cli train recipes/demo.yaml trainer.device=cuda trainer.run_dir=$RES/demo-gpu \
    logging.tensorboard=false logging.log_every=50 2>&1 | tail -6 | tee $RES/demo_gpu.txt
cp $RES/demo-gpu/metrics.jsonl $RES/demo_gpu_metrics.jsonl; rm -rf $RES/demo-gpu
OUT=$RES/suite python bench/train_step_suite.py --budget-s 260 --only w1-1.7b-fsdp-32k-compile-sel,w1-1.7b-fsdp-32k-compile-full 2>&1 | tail -8
tar czf $OUT/results.tgz -C $RES .
