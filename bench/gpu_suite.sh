#!/usr/bin/env bash
# Everything autopar checks on a GPU, in one run that fits a lent device machine's time
# (about 8 minutes on one H200), written to one results file:
#   1. pytest -m gpu                (tests/test_gpu.py: NCCL, compile, bf16, device="auto")
#   2. bench/gpu_step.py            (one rank against the plain model: eager, compiled, bf16;
#                                    the (2, 4) plan's eight ranks in lockstep on the GPU)
#   3. bench/gpu_profile.py         (a measured profile of this GPU, written beside the
#                                    results to ship under cost_models/profiles/, and its
#                                    predicted step against the measured one)
#   4. bench/gpu_kernels.py         (the bf16 step's kernels, autopar beside autocast)
#
#   bench/gpu_suite.sh [--dry-run]
#
# Results go to $OUT/gpu_suite.txt ($OUT is set on the device machine; bench/results
# otherwise). --dry-run runs the same steps on this machine's CPU at tiny sizes (gloo
# instead of NCCL): it checks the script, not the GPU (tests/test_gpu_suite.py runs it).
# Each step has its own time limit; the last line counts the steps that passed, and the
# exit status is non-zero if any failed.
#
# On a bare device machine (torch there, not pulp or highspy, autopar not installed) the
# script sets itself up first (bench/gpu_setup.sh, which a single bench script's run can
# source too): wheels in .whl/ (downloaded here for its Python and
# platform, carried along) go to /tmp/autopar-site, and autopar is installed editable
# without its dependencies (or, where that cannot build, its folders are linked in place).
# From a session with a lent machine: download pulp and highspy wheels for its Python
# (/work/.library/device/README.md says how) into .whl/, then run this with .whl carried.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-bench/results}"
mkdir -p "$out"
results="$out/gpu_suite.txt"
. bench/gpu_setup.sh
if [ $dry = 1 ]; then
    sizes=(--device cpu --layers 1 --hidden 64 --seq 16 --batch 2 --steps 2)
    step_mesh=(--mesh 2,2)
else
    sizes=()
    step_mesh=()
fi

{
    echo "# bench/gpu_suite.sh $* ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    "$py" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} > "$results" 2>&1

passed=0
total=0
step() {  # step <seconds> <name> <command...>
    local limit=$1 name=$2
    shift 2
    total=$((total + 1))
    echo "## $name: $*" >> "$results"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$results" 2>&1
    local rc=$?
    echo "## $name: exit $rc after $((SECONDS - t0)) s" >> "$results"
    [ $rc = 0 ] && passed=$((passed + 1))
}

step 150 "gpu tests" "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
step 200 "gpu step" "$py" bench/gpu_step.py "${sizes[@]}" "${step_mesh[@]}"
step 120 "gpu profile" "$py" bench/gpu_profile.py --out "$out" "${sizes[@]}"
[ $dry = 1 ] || step 90 "gpu kernels" "$py" bench/gpu_kernels.py --dtype bf16
echo "gpu_suite: $passed of $total steps passed" | tee -a "$results"
[ $passed = $total ]
