#!/usr/bin/env bash
# One device call of the pending GPU measurements (issues 12, 15, 17), in order of priority. Rounds 1 and 2 ran on an
# H100; the kind lent since 2026-11-28 is an H200 (the H100's arithmetic, 1.43x its memory bandwidth, 141 GB):
# every table names the GPU, and shares of peak use that GPU's datasheet (flowrl/kernels/roofline.py).
#
# Usage (on the device machine, from the repository root; see docs/gpu-session.md):
#   OUT=/some/dir bash bench/gpu_session.sh [BUDGET_S]
#
# The flowrl wheel and the pinned diffusers / peft / transformers wheels travel in .whl/ (built
# here with `pip wheel`, so nothing is built there). Each step runs under its own cap, shortened
# so that the whole script ends BUDGET_S seconds (default 560) after it starts; a step with less
# than 15 s left is skipped and says so. Every step's output goes to $OUT/session.log (a step cut
# short keeps the rows it printed). Round 1 (2026-11-27) ran FSDP2 memory, kernels, FP8 explore, the CUDA
# profile, batch-16 MFU and attention backends: docs/gpu-runs/2026-11-27-h100.log; round 2 the kernel fixes,
# eager FP8 with the fused quantiser, Sol-RL on CUDA and FLUX's rows: docs/gpu-runs/2026-11-27-h100-round2.log.
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

keep_run() {  # keep_run RUN_DIR NAME: a training run's summary and per-iteration metrics come back as NAME_*
  cp "$1/summary.json" "$OUT/$2_summary.json" 2>/dev/null
  cp "$1/metrics.jsonl" "$OUT/$2_metrics.jsonl" 2>/dev/null
}

if [ ! -d "$SITE/flowrl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2>&1 | tee -a "$LOG" || exit 1
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,diffusers,transformers,peft,accelerate,triton,flowrl as f;print('torch',torch.__version__,'diffusers',diffusers.__version__,'transformers',transformers.__version__,'peft',peft.__version__,'accelerate',accelerate.__version__,'triton',triton.__version__,'flowrl from',f.__file__)"
} 2>&1 | tee -a "$LOG"

# Round 3 (planned 2026-11-27 after round 2's run, docs/gpu-runs/2026-11-27-h100-round2.log). Round 2 measured the
# kernels, eager FP8 explore (0.91x bf16), Sol-RL's CUDA profile and FLUX's rows; what it could not finish comes first.

# The card's own ceilings first (about 10 s): copy bandwidth, bf16 and FP8 matrix rates, against which the kernels'
# bandwidth and the denoisers' MFU below are read (datasheet rates are leads: /work/.library/device/METHOD.md).
step ceilings 30 python3 -m bench.ceilings --json "$OUT/ceilings.json"

# The tests rewritten after round 2: the fused Flow-SDE gradient held to float64, the bench's FP8 sweep bit check;
# memory.compile=cudagraphs (new): the default job's rollout equal to eager bit for bit, ratio 1; the step noise's
# copy without a stream sync (new); FP8 layers sharing one quantised input (new 2026-11-29); bf16 rollouts on the
# training attention kernels, first-update ratio exactly 1 (new 2026-11-29, session 20); FP8 fast accumulation
# (new 2026-12-07); the NVFP4 torch reference and kernel equal on CUDA at a block scale torch's reciprocal
# division rounded differently, and on subnormal inputs (new 2026-12-07, second session).
step tests_fixes 75 python3 -m pytest -q -m cuda tests/kernels/test_fused_flow_sde.py \
  tests/kernels/test_bench_kernels.py "tests/test_cuda.py::test_the_default_job_under_cudagraphs_replays_the_eager_kernels" \
  "tests/test_cuda.py::test_step_noise_for_a_cuda_latent_is_the_cpu_draw_and_does_not_synchronise" \
  "tests/test_cuda.py::test_bf16_autocast_on_cuda_keeps_log_probs_fp32_and_the_ratio_one" \
  "tests/test_cuda.py::test_bf16_tiny_sd3_with_sd35_head_width_keeps_the_ratio_one_on_cuda" \
  tests/kernels/test_fp8.py::test_fp8_layers_sharing_an_input_quantise_it_once \
  tests/core/test_precision.py::test_scaled_mm_layers_share_quantised_inputs_with_the_same_output_also_after_a_refresh \
  tests/kernels/test_fp8.py::test_fast_accum_is_passed_to_scaled_mm_and_changes_only_the_accumulation \
  tests/core/test_precision.py::test_fast_accum_reaches_every_fp8_layer_survives_a_refresh_and_stays_close \
  tests/kernels/test_nvfp4.py::test_block_scale_divides_rather_than_multiplies_by_a_reciprocal \
  tests/kernels/test_nvfp4.py::test_kernel_matches_reference_on_subnormal_inputs \
  -p no:cacheprovider

# Issue 17: the default job under CUDA graphs of the eager kernels (memory.compile=cudagraphs: seconds of tracing per
# graph instead of inductor's tens of seconds, 4.6 vs 34.3 s on the 2-core CPU; the eager results).
step default_job_cudagraphs 120 python3 -m flowrl train model.device=cuda memory.compile=cudagraphs \
  output.dir=/tmp/default-cudagraphs train.progress=false
keep_run /tmp/default-cudagraphs default_job_cudagraphs

# Issue 15: compiled FP8 explore against compiled bf16, block by block (one graph per block variant, 3 for
# SD3.5-M's 24 blocks; round 1's whole-model FP8 compiles outlasted 170 s, round 2's bf16 + FP8 its 91 s cap);
# ":fused" traces the activation quantiser from torch operators so inductor can fuse it into the op before;
# ":fastacc" (new 2026-12-07) runs the FP8 GEMMs with use_fast_accum, as inference stacks do (step 5b measures it
# eagerly against the default accumulation).
step fp8_compiled_blocks 170 python3 -m bench.fp8_explore --models SD3.5-M --repeats 1 --compile default \
  --compile-scope blocks --variants bf16 fp8_e4m3:row:fused fp8_e4m3:row:fused:fastacc

# Issue 15: the per-Linear ledger (bf16 vs quantise vs _scaled_mm: where FP8's GEMM gain goes), then the FP8
# quantiser's GPU time and launch configurations (each a Triton compile: printed last).
step kernels_sweep 60 python3 -m bench.kernels --repeats 3 --fp8-sweep

# Issue 17: SD3.5-M's MFU compiled block by block (eager: 18.4 % / 16.1 % at batch 16).
step gpu_measure_sd3_compiled 60 python3 -m bench.gpu_measure --models SD3.5-M --batch 16 --repeats 3 \
  --compile default --compile-scope blocks

# Issue 15: eager FP8 with each activation quantised once for the Linears that read it (q / k / v; new 2026-11-29)
# against one quantisation per Linear (round 2's 0.91x bf16), and with fast accumulation (new 2026-12-07), SD3.5-M.
# 12 seeds a prompt (48 candidates): round 2's 24 took 56 s for three copies.
step fp8_shared_inputs 65 python3 -m bench.fp8_explore --models SD3.5-M --repeats 1 --seeds 12 \
  --variants bf16 fp8_e4m3:row:unshared fp8_e4m3:row fp8_e4m3:row:fastacc

# With what is left: FLUX.1-dev's FP8 explore (eager) and its batch-16 training row with the OOM diagnosis (141 GB on
# an H200: it may fit).
step fp8_explore_flux 60 python3 -m bench.fp8_explore --models FLUX.1-dev --repeats 1 --variants bf16 fp8_e4m3:row
step gpu_measure_flux 45 python3 -m bench.gpu_measure --models FLUX.1-dev --batch 16 --repeats 3

# Issue 17: xformers beside SDPA's flash and memory-efficient kernels (never measured: the device image has no
# xformers). Its wheel travels apart in .whl/xformers/ and is put on the path for this step only, since diffusers
# imports xformers whenever it is installed. "auto" and "cudnn" are left out: FLUX's cuDNN backward breaks the CUDA
# context (round 2), which would end the run before the xformers rows; ratios are over flash.
BASE_PYTHONPATH=$PYTHONPATH
if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-xformers .whl/xformers/*.whl \
  >>"$LOG" 2>&1; then
  export PYTHONPATH=/tmp/site-xformers:$PYTHONPATH
else
  echo "== attention_xformers: the xformers wheel did not install (see above); its rows will be missing" | tee -a "$LOG"
fi
step attention_xformers 50 python3 -m bench.attention_backends --models SD3.5-M FLUX.1-dev --batch 4 --repeats 2 \
  --backends flash efficient xformers
export PYTHONPATH=$BASE_PYTHONPATH  # xformers off the path again

# Issue 17: the default job under inductor's CUDA graphs, last: it takes what is left. Round 2 crashed at the first
# training step (a kept velocity overwritten by a later graph replay; fixed: MemoryAdapter.own_outputs) after >130 s
# of cold compiling, so a short remainder would be spent compiling; the cudagraphs run above answers the same question
# sooner. Its metrics.jsonl holds each iteration's time, so the steady rate is read past the compile.
step default_job_graphs 180 python3 -m flowrl train model.device=cuda memory.compile=reduce-overhead \
  output.dir=/tmp/default-graphs train.progress=false
keep_run /tmp/default-graphs default_job_graphs

echo "== done at +$(elapsed) s" | tee -a "$LOG"
