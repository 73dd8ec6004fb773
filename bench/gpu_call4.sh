#!/usr/bin/env bash
# Device call 4 of 2026-12-02 (session 3): the W1 / W1-0.6b train-step matrix, slipstream x TRL x verl,
# FSDP and Megatron columns (bench/matrix_w1.yaml). Needs .whl (incl. .whl/verl) carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/verl-site .whl/verl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 SLIPSTREAM_VERL_SITE=/tmp/verl-site
RES=/tmp/res4; mkdir -p $RES
[ -f docs/results/matrix-w1/results.jsonl ] && cp docs/results/matrix-w1/results.jsonl $RES/ 2>/dev/null
( timeout 560 python -m slipstream.cli bench matrix bench/matrix_w1.yaml --out $RES --resume 2>&1 \
    | grep -E "^cell|  -> " ) ; tar czf $OUT/results.tgz -C $RES .
