#!/usr/bin/env bash
# Session 5, device call A (ran as bench/gpu_s6a.sh at 6150125): what the open issues still need from one GPU with the code as it stands:
# the FSDP offload-vs-fp32 and GQA-path GPU tests (issue 3), the verl W1-0.6b cell (issue 5; --resume keeps
# the measured rows), varlen vs flex (issue 3), the Megatron W1 update after 52a9f1b (norm dtype) and 9b35bb2
# (SwiGLU / residual-add fusions). Carry .whl (incl. .whl/verl). DEADLINE = seconds for the whole script.
. bench/gpu_lib.sh
: "${DEADLINE:=580}"
gpu_setup /tmp/res w06
stamp tests
timeout 80 python -m pytest -q -s -p no:cacheprovider "tests/gpu/test_fsdp_gpu.py::test_offload_matches_no_offload" \
    "tests/gpu/test_attention_gpu.py::test_gqa_native_and_repeated_paths_match_reference" 2>&1 | quiet > $RES/gpu_tests.txt
grep -E "^\| |passed|failed|FAILED|natively" $RES/gpu_tests.txt | head -8
stamp varlen vs flex
timeout 60 python bench/bench_attention.py 2>&1 | quiet | tail -6 | tee $RES/attention.txt
stamp megatron W1 after the norm-dtype fix and the fusions
timeout 130 python bench/profile_step.py --backend megatron --activation-checkpointing full --max-tokens-per-mb 32768 \
    --out $RES/profile_megatron.json > $RES/profile_megatron.log 2>&1; quiet < $RES/profile_megatron.log | head -14
stamp verl W1-0.6b
cp docs/results/matrix-w1-06b/results.jsonl $RES/w06/
timeout $(left 3) python -m slipstream.cli bench matrix bench/matrix_w1_06b.yaml --out $RES/w06 --resume > $RES/w06.log 2>&1
grep -E "^\| W1-0.6b \(|^cell|  -> " $RES/w06.log | cut -c1-200 | tail -8
stamp done
