#!/usr/bin/env bash
# Session 5, device call B: bf16 master weights (actor.master_dtype=bfloat16) on the GPU. The W1 / W1-0.6b
# matrix with slipstream-fsdp and TRL in the same run (issue 5's memory-class comparison), then qwen3-8b
# on one GPU, which fits only with 8 B/param (issue 3). Carry .whl. DEADLINE = seconds for the whole script.
. bench/gpu_lib.sh
: "${DEADLINE:=575}"
gpu_setup /tmp/res bf16
stamp matrix bf16
timeout $(cap 330 150) python -m slipstream.cli bench matrix bench/matrix_bf16.yaml --out $RES/bf16 > $RES/bf16.log 2>&1
grep -E "^\| W1|^cell|  -> " $RES/bf16.log | cut -c1-200 | tail -12
stamp qwen3-8b bf16 master
timeout $(left 3) python -m slipstream.cli bench train-step --workload W1-8b --backend fsdp --ac full --compile \
    --max-tokens-per-mb 16384 --master-dtype bfloat16 --repeats 2 --out $RES/w1_8b_bf16.json 2>&1 | quiet | tail -8
stamp done
