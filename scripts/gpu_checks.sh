#!/usr/bin/env bash
# The GPU proving ground: one bounded script for a bare CUDA machine as it comes (Python 3.12 with
# torch, transformers & co., no network, nothing installed for us), with only the working tree and
# gpu-bundle/ (`make gpu-bundle`, built beforehand on a machine with the registries) beside it:
#
#   bash scripts/gpu_checks.sh [OUT_DIR]              on the GPU machine (OUT_DIR: $OUT, else gpu-out)
#   bash scripts/gpu_checks.sh --cpu-smoke [OUT_DIR]  the same steps at tiny sizes on this CPU, in a
#                                                     stand-in for that machine's Python (make gpu-smoke)
#
# It installs the bundle into a temporary folder (seconds), then runs each step under its own timeout,
# all within GPU_CHECKS_BUDGET_S (default 470 s on the GPU: the contract says 8 minutes; 3 x 180 s for
# the smoke run); GPU_CHECKS_STEPS
# (e.g. "step-cost,engine") runs only those steps after install and env (a targeted rerun):
#   env         versions, where each package came from, the bundle's requirements, every import
#   tests-gpu   tests/gpu (the CUDA oracle: fp32/bf16/NF4 agreement, preprocessing, EXIF, NVML)
#   prefill     a prompt whole / in chunks of 512, 1024, 2048 / as a prefix hit; a step's chunks of
#               several rows in one call against one call a row
#   engine      the engine on a realistic mix: tokens/s, step time by rows, host vs GPU, graphs on/off,
#               prefix reuse on/off, the pool step (slots by need, captured) against the fixed one
#   step-cost   the engine's decode-step cost table, graphs on and off, fixed and pool steps
#   preprocess  device preprocessing vs FuyuProcessor: ms/image at batch 1/16, max abs difference
#   grammar     the grammar mask at a 262,144-token (synthetic) vocabulary: fill + apply, compile times
#   model       a random Fuyu-8B-shaped model, bf16 and NF4: images/s at batch 1/8/32, memory, roofline
# and writes OUT_DIR/gpu-checks.json (every figure), OUT_DIR/summary.txt, OUT_DIR/gpu-checks.log and,
# on a GPU, OUT_DIR/nvidia-smi.txt. A step that fails or times out is recorded and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
smoke=0
if [ "${1:-}" = "--cpu-smoke" ]; then
  smoke=1
  shift
fi
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-checks.log"
: > "$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
SECONDS=0

if [ "$smoke" = 1 ]; then
  mode=cpu-smoke
  # The rehearsal proves the script and the bundle, not a speed: every step gets GPU_SMOKE_SLACK times
  # its limit (71-75 s in all on a quiet 2-core host; 171 s and two steps cut off at 1x on a slow one).
  slack=${GPU_SMOKE_SLACK:-3}
  budget=${GPU_CHECKS_BUDGET_S:-$((180 * slack))}
  py=$(scripts/gpu_device_python.sh) || exit 2
  SECONDS=0 # the stand-in Python is made once, outside the budget
  export MRC_DEVICE=cpu CUDA_VISIBLE_DEVICES=""
else
  mode=gpu
  slack=1
  budget=${GPU_CHECKS_BUDGET_S:-470}
  py=${GPU_PYTHON:-python3}
  export MRC_DEVICE=cuda
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export MRC_HOME="$PWD/.cache/mrc"
report_s=10 # kept for the report at the end

# step NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, what the budget has left), output to the log.
step() {
  local name=$1 limit=$(($2 * slack))
  shift 2
  if [ -n "${GPU_CHECKS_STEPS:-}" ] && [[ ",install,env,$GPU_CHECKS_STEPS," != *",$name,"* ]]; then
    printf '%s\t-\t0\t0\t%s\n' "$name" "not run: not in GPU_CHECKS_STEPS" >> "$work/steps.tsv"
    return
  fi
  local left=$((budget - report_s - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    printf '%s\t-\t0\t%s\t%s\n' "$name" "$limit" "not run: the budget was spent" >> "$work/steps.tsv"
    return
  fi
  echo "==== $name (limit ${limit} s, ${SECONDS} s in) ====" | tee -a "$log"
  local began=$SECONDS
  GPU_STEP_LIMIT_S=$limit timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$((SECONDS - began))" "$limit" >> "$work/steps.tsv"
}

skip() { printf '%s\t-\t0\t0\t%s\n' "$1" "$2" >> "$work/steps.tsv"; }

site="$work/site"
step install 60 "$py" scripts/gpu_env.py install "$site" gpu-bundle
export PYTHONPATH="$site:$PWD"
step env 40 "$py" scripts/gpu_env.py report --bundle gpu-bundle --site "$site" --json "$work/env.json"
if ! grep -qP '^env\t(0|3)\t' "$work/steps.tsv"; then # 3: partly ready (scripts/gpu_env.py)
  echo "the environment is not ready (see the env step above): the remaining steps would fail" | tee -a "$log"
else
  # The engine's steps first: when the budget runs short, the figures already measured once go.
  if [ "$smoke" = 1 ]; then
    step tests-gpu 45 "$py" -m pytest tests/gpu -q -p no:cacheprovider --junitxml "$work/tests_gpu.xml"
    step prefill 30 "$py" tests/bench/bench_prefill.py --device cpu --quick --json "$work/prefill.json"
    step engine 40 "$py" tests/bench/bench_engine_mix.py --smoke --json "$work/engine.json"
    step step-cost 40 "$py" tests/bench/bench_step_cost.py --device cpu --quick --json "$work/step_cost.json"
    step preprocess 40 "$py" tests/bench/bench_preprocess.py --device cpu --quick --no-mixed --json "$work/preprocess.json"
    step grammar 40 "$py" tests/bench/bench_grammar_vocab.py --smoke --json "$work/grammar.json"
    step model 40 "$py" tests/bench/bench_gpu.py --smoke --json "$work/model.json"
  else
    step tests-gpu 90 "$py" -m pytest tests/gpu -q -p no:cacheprovider --junitxml "$work/tests_gpu.xml"
    step prefill 50 "$py" tests/bench/bench_prefill.py --device cuda --chunks 512,1024,2048 --repeats 3 \
      --json "$work/prefill.json"
    step engine 170 "$py" tests/bench/bench_engine_mix.py --json "$work/engine.json"
    step step-cost 60 "$py" tests/bench/bench_step_cost.py --device cuda --graphs both --repeats 3 --json "$work/step_cost.json"
    step preprocess 50 "$py" tests/bench/bench_preprocess.py --device cuda --passes 2 --per-kind 2 --no-mixed \
      --json "$work/preprocess.json"
    step grammar 40 "$py" tests/bench/bench_grammar_vocab.py --device cuda --json "$work/grammar.json"
    step model 110 "$py" tests/bench/bench_gpu.py --modes bf16,nf4 --batches 1,8,32 --json "$work/model.json"
  fi
fi
# standard library only: any Python will do if the one under test is broken
{ "$py" scripts/gpu_report.py "$work" "$out" "$mode" || python3 scripts/gpu_report.py "$work" "$out" "$mode"; } | tee -a "$log"
echo "wall ${SECONDS} s (budget ${budget} s); figures in $out/gpu-checks.json" | tee -a "$log"
# at most 16 MiB per file comes back from the GPU machine: keep the log's end
if [ "$(stat -c %s "$log")" -gt $((15 * 1024 * 1024)) ]; then
  tail -c $((15 * 1024 * 1024)) "$log" > "$work/log" && mv "$work/log" "$log"
fi
# the run passed when every step that ran passed
! grep -qv -P '^[^\t]+\t(0|-)\t' "$work/steps.tsv"
