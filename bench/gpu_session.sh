#!/usr/bin/env bash
# One device call: GPU tests, the train-step suite, and the demo recipe on CUDA.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/gpu_session.sh [suite budget s] [suite --only list]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RES=/tmp/slipstream_res; rm -rf $RES; mkdir -p $RES
BUDGET=${1:-300}
ONLY=${2:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $RES/gpu.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a $RES/gpu.txt
git rev-parse HEAD 2>/dev/null | tee -a $RES/gpu.txt
timeout 150 python -m pytest -q --timeout 100 -p no:cacheprovider tests/gpu 2>&1 | tail -25 | tee $RES/gpu_tests.txt
timeout 90 python -m slipstream.cli train recipes/demo.yaml trainer.device=cuda trainer.run_dir=$RES/demo-gpu \
    logging.tensorboard=false logging.log_every=50 2>&1 | tail -8 | tee $RES/demo_gpu.txt
OUT=$RES/suite python bench/train_step_suite.py --budget-s $BUDGET ${ONLY:+--only $ONLY} 2>&1 | tail -40
cp $RES/demo-gpu/metrics.jsonl $RES/demo_gpu_metrics.jsonl 2>/dev/null
rm -rf $RES/demo-gpu/checkpoints $RES/demo-gpu/hf
tar czf $OUT/results.tgz -C $RES .
