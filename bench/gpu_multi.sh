#!/usr/bin/env bash
# Issue 6 on a multi-GPU kind (nvidia-h200-x2 / -x4 / -x8): written before any was lent, not run yet.
# Carry .whl. DEADLINE = seconds for the whole script. Uses every GPU the machine has (N); in order:
#  1. FSDP2 weak scaling: W1's per-GPU work (--scale K: K x the prompts) on K = 1, 2, 4, 8 <= N GPUs,
#     qwen3-1.7b (fp32 master, full recompute, 32k, compile) -> tokens/s per GPU, scaling efficiency,
#     micro-batch balance (the JSON's micro_batches per rank 0; the planner balances all ranks).
#  2. qwen3-8b on N GPUs with fp32 master weights (sharded: 122 GiB / N) at K = N.
#  3. Megatron TP=2 vs FSDP on 2 GPUs, same batch: pg_loss / grad_norm of the last step and tokens/s.
#  4. `slipstream train` on the demo recipe over N GPUs (fsdp) -> reward trend, step time.
. bench/gpu_lib.sh
: "${DEADLINE:=580}"
gpu_setup /tmp/res scale
N=$(nvidia-smi -L | wc -l)
echo "GPUs: $N"
TS="-m slipstream.cli bench train-step --backend fsdp --ac full --compile --max-tokens-per-mb 32768 --repeats 2"
for K in 1 2 4 8; do
    [ $K -le $N ] || break
    stamp "fsdp W1 x$K on $K GPUs"
    timeout $(cap 110 200) torchrun --standalone --nproc-per-node $K $TS --workload W1 --scale $K \
        --out $RES/scale/w1_k$K.json 2>&1 | quiet | grep "│ slipstream" | tail -1
done
stamp "qwen3-8b on $N GPUs, fp32 master"
timeout $(cap 150 150) torchrun --standalone --nproc-per-node $N $TS --workload W1-8b --scale $N \
    --out $RES/scale/w1_8b_k$N.json 2>&1 | quiet | grep "│ slipstream" | tail -1
stamp "megatron t2 vs fsdp on 2 GPUs (same batch)"
for B in fsdp megatron:t2; do
    timeout $(cap 100 60) torchrun --standalone --nproc-per-node 2 -m slipstream.cli bench train-step --backend $B \
        --ac full --max-tokens-per-mb 32768 --repeats 2 --workload W1 --out $RES/scale/tp_${B/:/_}.json 2>&1 | quiet | grep "│ slipstream" | tail -1
done
python - <<'PY' $RES/scale/tp_fsdp.json $RES/scale/tp_megatron_t2.json
import json, sys
rows = [json.load(open(p))["slipstream"] for p in sys.argv[1:]]
for r in rows:
    m = r["train_metrics"]
    print(r["config"]["backend"], "pg_loss %.6f grad_norm %.5f tok/s %.0f" % (m["actor/pg_loss"], m["actor/grad_norm"], r["phases"]["actor_train"]["tok_per_s"]))
PY
stamp "slipstream train, demo recipe, fsdp over $N GPUs"
timeout $(left 2) torchrun --standalone --nproc-per-node $N -m slipstream.cli train recipes/demo.yaml actor.backend=fsdp \
    trainer.device=cuda trainer.run_dir=$RES/demo logging.tensorboard=false 2>&1 | quiet | tail -4
stamp done
