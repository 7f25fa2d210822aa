#!/usr/bin/env bash
# One device call of the pending H100 measurements (issues 12, 15, 17), in order of priority.
#
# Usage (on the device machine, from the repository root; see docs/gpu-session.md):
#   OUT=/some/dir bash bench/gpu_session.sh [BUDGET_S]
#
# The flowrl wheel and the pinned diffusers / peft / transformers wheels travel in .whl/ (built
# here with `pip wheel`, so nothing is built there). Each step runs under its own cap, shortened
# so that the whole script ends BUDGET_S seconds (default 560) after it starts; a step with less
# than 15 s left is skipped and says so. Every step's output goes to $OUT/session.log (a step cut
# short keeps the rows it printed); Kernel tests run beside the FSDP2 memory steps (correctness
# only; the FSDP2 figure that matters is the memory peak, which is per process).
set -o pipefail
: "${OUT:?set OUT to the folder that comes back}"
BUDGET_S=${1:-560}
SITE=${SITE:-/tmp/site}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=$SITE:$PWD
LOG=$OUT/session.log
T0=$(date +%s)

elapsed() { echo $(($(date +%s) - T0)); }

step() {  # step NAME CAP_S COMMAND...
  local name=$1 cap=$2 left start rc
  shift 2
  left=$((BUDGET_S - $(elapsed) - 5))
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    echo "== $name: skipped, ${left} s left of the budget" | tee -a "$LOG"
    return
  fi
  start=$(date +%s)
  echo "== $name (cap ${cap} s, at +$(elapsed) s): $*" | tee -a "$LOG"
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$LOG"
  rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - start)) s$( ((rc == 124 || rc == 137)) && echo ' (cut by its cap)')" | tee -a "$LOG"
}

if [ ! -d "$SITE/flowrl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,diffusers,transformers,peft,accelerate,triton,flowrl as f;print('torch',torch.__version__,'diffusers',diffusers.__version__,'transformers',transformers.__version__,'peft',peft.__version__,'accelerate',accelerate.__version__,'triton',triton.__version__,'flowrl from',f.__file__)"
} 2>&1 | tee -a "$LOG"

# Issue 15: the Triton kernels against their torch references on the GPU (beside the FSDP2 steps).
(timeout -k 5 150 python3 -m pytest -q -m cuda tests/kernels -p no:cacheprovider >"$OUT/pytest_kernels.txt" 2>&1
  echo "rc=$?" >>"$OUT/pytest_kernels.txt") &
TESTS=$!

# Issue 12: FSDP2 with one process on the full-size SD3.5-M and FLUX.1-dev training step.
step fsdp2_mesh 100 python3 -m bench.fsdp2_memory --batch 1 4
step fsdp2_accelerate 50 python3 -m bench.fsdp2_memory --via accelerate --batch 1
wait "$TESTS"
tail -n 8 "$OUT/pytest_kernels.txt" | tee -a "$LOG"

# Issue 15: the kernels' bandwidth, then FP8 explore copies against bf16 (candidates/s, Kendall tau).
step kernels 45 python3 -m bench.kernels
step fp8_explore 90 python3 -m bench.fp8_explore --models SD3.5-M --repeats 1

# Issue 17: where a training iteration's time goes on the GPU, MFU at batch 16, attention kernels.
step profile 100 python3 -m bench.profile --device cuda --models digits --iterations 1 --warmup 1 \
  --json "$OUT/profile_cuda_digits.json"
step gpu_measure 75 python3 -m bench.gpu_measure --models SD3.5-M FLUX.1-dev --batch 16 --repeats 3
step attention 60 python3 -m bench.attention_backends --models SD3.5-M FLUX.1-dev --batch 4 --repeats 2
echo "== done at +$(elapsed) s" | tee -a "$LOG"
