# Shared set-up of the device scripts (bench/gpu_final_s3.sh, gpu_s4_call*.sh, gpu_s5.sh): sourced, not run.
#   gpu_setup RES [SUBDIR ...]  installs the carried wheels (.whl -> /tmp/site, .whl/verl -> /tmp/verl-site),
#                               exports PYTHONPATH / SLIPSTREAM_VERL_SITE, makes a fresh RES with its
#                               sub-folders, starts the clock and tars RES into $OUT/results.tgz on exit.
#   quiet                       filters library chatter (warnings, megatron INFO and parameter lists) from a log
#   stamp MSG                   prints MSG with the seconds since gpu_setup
#   left [RESERVE]              seconds left of DEADLINE (the script sets its default) minus RESERVE, never < 1
#                               (timeout 0 would mean no limit)
#   cap MAX [RESERVE]           min(MAX, left RESERVE)
set -u
gpu_setup() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/verl-site .whl/verl/*.whl
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 SLIPSTREAM_VERL_SITE=/tmp/verl-site
    RES=$1; shift
    rm -rf "$RES"; mkdir -p "$RES"
    local d; for d in "$@"; do mkdir -p "$RES/$d"; done
    T0=$(date +%s)
    trap 'tar czf $OUT/results.tgz -C $RES .' EXIT
}
quiet() { grep -v -i -E "warn|^[0-9:]+ INFO|^\s+(decoder|embedding|output_layer)\.|return func|return torch|Params for bucket|^\s*$"; }
el() { echo $(( $(date +%s) - T0 )); }
stamp() { echo "[t+$(el)s] $*"; }
left() { local t=$(( DEADLINE - $(el) - ${1:-0} )); [ $t -lt 1 ] && t=1; echo $t; }
cap() { local l; l=$(left ${2:-0}); [ $l -lt $1 ] && echo $l || echo $1; }
