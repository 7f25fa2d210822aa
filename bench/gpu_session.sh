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
# short keeps the rows it printed). Round 1 (2026-11-27) ran FSDP2 memory, kernels, FP8 explore, the CUDA
# profile, batch-16 MFU and attention backends: docs/gpu-runs/2026-11-27-h100.log.
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

# Round 2 (planned 2026-11-27 after round 1's run, docs/gpu-runs/2026-11-27-h100.log): first the fixes of
# what round 1 found, then the measurements round 1 could not finish. Caps in order of priority.

# The fixes, on the GPU: kernels bit for bit (fused FP8 row quantiser, the one-launch Flow-SDE step) and
# Sol-RL's explore stage with GPU-scored rewards.
# Then Flow-GRPO's rollout and training through the fused Flow-SDE step: the first-update ratio exactly 1.
step tests_fixes 75 python3 -m pytest -q -m cuda tests/kernels tests/solrl/test_cuda_solrl.py \
  tests/test_cuda.py::test_cuda_rollout_matches_cpu_and_ratio_is_one -p no:cacheprovider

# Issue 15: kernel bandwidth (GPU time beside wall time), then FP8 explore with the fused quantiser.
step kernels 45 python3 -m bench.kernels
step fp8_explore 80 python3 -m bench.fp8_explore --models SD3.5-M --repeats 1

# Issue 17: Sol-RL's profile on CUDA (failed in round 1; its flow_grpo row now runs the fused Flow-SDE step in
# rollout and training: round 1's eager "sampler" was 0.114 s of 2.04 s), then the default job with CUDA graphs
# (round 1: 2.04 s an iteration eager, about 143 s for 70; target <= 20 s).
step profile_solrl 60 python3 -m bench.profile --device cuda --models digits --objectives sol_rl flow_grpo \
  --iterations 1 --warmup 1 --json "$OUT/profile_cuda_solrl.json"
step default_job_graphs 130 python3 -m flowrl train model.device=cuda memory.compile=reduce-overhead \
  output.dir=/tmp/default-graphs train.progress=false
cp /tmp/default-graphs/summary.json "$OUT/default_job_graphs_summary.json" 2>/dev/null

# Issue 12 and 17: the rows round 1 lost to bench bugs (fixed since).
step fsdp2_accelerate_flux 45 python3 -m bench.fsdp2_memory --via accelerate --models FLUX.1-dev --batch 1
step gpu_measure_flux 55 python3 -m bench.gpu_measure --models FLUX.1-dev --batch 16 --repeats 3
step attention_flux 45 python3 -m bench.attention_backends --models FLUX.1-dev --batch 4 --repeats 2

# With what is left: compiled FP8 against compiled bf16 (round 1: the bf16 compile took 67 s; the FP8 quantiser is
# one torch operator since, so each FP8 Linear compiles without a graph break), then the trainer's CUDA tests.
step fp8_compiled 200 python3 -m bench.fp8_explore --models SD3.5-M --repeats 1 --compile default \
  --variants bf16 fp8_e4m3:row
step tests_cuda 200 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider
echo "== done at +$(elapsed) s" | tee -a "$LOG"
