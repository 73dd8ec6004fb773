#!/usr/bin/env bash
# Wheels for verl's separate site directory (the verl cell of `slipstream bench matrix`).
#
#   bash bench/peers_verl_wheels.sh gpu          -> .whl/verl/*.whl, for the GPU machine (CPython 3.12,
#                                                   manylinux x86_64, no internet; the lead carries .whl)
#   bash bench/peers_verl_wheels.sh local [DIR]  -> build/verl-wheels-py<ver>/ for THIS python, installed
#                                                   into DIR (default /work/verl-site); then
#                                                   SLIPSTREAM_VERL_SITE=DIR runs the verl cell and tests here.
# On the GPU machine:
#   pip install --no-index --no-deps --target /tmp/verl-site .whl/verl/*.whl
#   export SLIPSTREAM_VERL_SITE=/tmp/verl-site
#
# What is in the set and why (everything else verl imports on the timed path is already on the
# GPU machine's image: torch, numpy, accelerate, peft, pandas, pyarrow, xxhash, fsspec, httpx,
# huggingface-hub 1.33, safetensors, cloudpickle, pyyaml, regex, psutil, ...):
#   verl 0.9.1 (no deps); transformers 5.10.4 (verl pins <5.11; the site shadows the image's 5.17);
#   tokenizers 0.22.2 (transformers 5.10 checks tokenizers<=0.23.0 at import; the image has 0.23.2);
#   tensordict 0.10.0 (verl pins <=0.10) + orjson, pyvers<0.2, importlib_metadata;
#   omegaconf 2.3 + antlr4-python3-runtime 4.9.3 (built here: PyPI has only its sdist); codetiming;
#   dill, datasets, multiprocess (verl.protocol and verl.utils.dataset import them).
# ray, uvicorn, fastapi and pydantic are NOT carried: slipstream/bench/peers/standin.py writes import-only
# stand-ins for them (verl imports them at module load; the timed path never calls them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mode=${1:-gpu}

COMMON=(verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 tensordict==0.10.0 "pyvers<0.2" orjson
        importlib_metadata omegaconf==2.3.0 codetiming==1.4.0 dill==0.4.1 datasets==5.2.0 multiprocess==0.70.19)
# Only for a python whose environment lacks what the GPU image has (this repo's CPU venv).
LOCAL_EXTRA=(cloudpickle httpx httpcore peft "huggingface_hub>=1.5,<2")

case "$mode" in
  gpu)
    out=.whl/verl
    rm -rf "$out" && mkdir -p "$out"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$out" "${COMMON[@]}"
    ;;
  local)
    site=${2:-/work/verl-site}
    out=build/verl-wheels-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    rm -rf "$out" && mkdir -p "$out"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$out" "${COMMON[@]}" "${LOCAL_EXTRA[@]}"
    ;;
  *) echo "usage: $0 gpu | local [SITE_DIR]" >&2; exit 2 ;;
esac
# antlr4-python3-runtime is pure Python but published only as an sdist: build its wheel here.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$out" antlr4-python3-runtime==4.9.3

if [ "$mode" = local ]; then
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --target "$site" "$out"/*.whl
  echo "verl site: $site  (export SLIPSTREAM_VERL_SITE=$site)"
fi
ls -1 "$out"
du -ch "$out"/*.whl | tail -1
