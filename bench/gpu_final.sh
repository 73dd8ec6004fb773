#!/usr/bin/env bash
# Third device call of 2026-12-02: Megatron parity on CUDA and the quick W1 matrix (slipstream vs TRL).
# Needs .whl (megatron-core, trl, datasets, dill, multiprocess for Python 3.12) carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 70 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_gpu.py 2>&1 | grep -v -i warn | tail -20 | tee $OUT/megatron_gpu.txt
timeout 170 python -m slipstream.cli bench matrix bench/matrix_w1_quick.yaml --out $OUT/matrix 2>&1 | grep -v -i warn | tail -25
