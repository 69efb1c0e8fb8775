#!/usr/bin/env bash
# The prepared measurement of a GPU session (docs/gpu.md, "Measuring on one GPU"): throughput and
# MFU against the plain-PyTorch reference and HF's EuroBERT at 16k and 64k tokens per step, the
# profile (GPU-busy fraction, host synchronisations), and the GPU tier's checks of the fast path.
# Every part writes its log to OUT and prints a line `=== <part> rc=<status> <seconds>s`.
#
#   bash tools/gpu_check.sh OUT [PARTS]
#
# PARTS, comma-separated (default: bench16k,profile): bench16k, bench64k, profile (with the
# Chrome trace of its timed steps, gzipped; the reference profiled beside ours), stack (the layer
# stack against the layers compiled one by one), hostfirst (the 16k row without HF, the host
# reading the step's figures before it queues the update: train.skip_spikes=1e30, against
# bench16k's queued update), bench210m, bench610m, bench1b (one model size with all its rows:
# 16k and 24,576 tokens a step, ours, the reference and ours with the distributed optimizer's
# layout, one at a time, no HF; `sizes` runs the three), tier, compare and long
# (tools/gpu_train_check.py on real shards in $GPU_DATA: the default path against the reference
# path over 200 steps, and a run of LONG_SECONDS exported and fine-tuned), evalprobe (the
# evaluation probe at PROBE_SIZE, 210m, on SST-2, CoNLL-2003, SQuAD and SciFact in $GPU_DATA, and a
# plan priced from it), and smoke (the same
# commands in their CPU quick forms: checks the plumbing on any machine). Each part has its own
# time limit. On a fresh H100 (2026-11-27) they took: bench16k 76 s without HF and 100-107 s
# with it, profile 27-33 s (the compiles cached by bench16k), bench64k 71-80 s, tier 35 s with
# TIER_K=accumulation and 50-61 s with "optimizer or synchronis" (its whole default selection
# ran past 200 s); the machine's start and the copies add 30-40 s a call.
#
# Where the machine has no megatron-core, put its wheel (and nothing else) in .whl/ first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
# The sample-index extension is built here with the machine's pybind11.
set -uo pipefail

OUT=${1:?usage: tools/gpu_check.sh OUT [PARTS]}
PARTS=${2:-bench16k,profile}
PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/mlmclm-inductor}

has() { [[ ",$PARTS," == *",$1,"* ]]; }

part() {  # part NAME LIMIT_S COMMAND...: run, log to OUT/NAME.log, report status and time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s) $(date -u +%FT%TZ)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    grep -E "^(RESULT|PLAN|PROFILE|SYNC|torch |device|headline|\| |GPU tier|check |.* (pass|FAIL)$)|^ *(documents|parameters|peak GPU)" \
        "$OUT/$name.log" | tail -40
    [ "$rc" -ne 0 ] && tail -25 "$OUT/$name.log"
    echo "=== $name rc=$rc $(($(date +%s) - start))s"
}

# --- setup: megatron-core (carried wheel where missing), the C++ extension, versions
if ! $PY -c "import megatron.core" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/mlmclm-site .whl/*.whl \
        || { echo "megatron-core missing and no wheel in .whl/"; exit 2; }
    export PYTHONPATH=/tmp/mlmclm-site
fi  # (other missing wheels in .whl/, e.g. seqeval for the fine-tuning, come along)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import megatron_mlmclm._sample_index" 2>/dev/null; then
    $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 2; }
fi
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        || echo "no nvidia-smi"
    $PY - <<'EOF'
import importlib.metadata as md
import torch
import megatron_mlmclm
names = ("megatron-core", "transformers", "transformer-engine", "apex", "triton")
found = {}
for name in names:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = "absent"
cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
print(f"megatron_mlmclm {megatron_mlmclm.__version__}; torch {torch.__version__} ({cuda});",
      "; ".join(f"{k} {v}" for k, v in found.items()))
EOF
} | tee "$OUT/versions.txt"

# BENCH_EXTRA: more flags for the benchmark parts (e.g. --no-hf when time is short).
read -r -a EXTRA <<<"${BENCH_EXTRA:-}"
BENCH=(benchmarks/train_throughput.py --presets 210m --seqs 2048 --objectives mlm --fp8 ""
    --warmup 3 --steps 15 "${EXTRA[@]}")
has bench16k && part bench16k "${LIMIT_BENCH:-330}" $PY "${BENCH[@]}" --tokens-per-step 16384
# No HF at 64k: its full-vocabulary logits alone ask for 31 GiB more (out of memory on an H100).
has bench64k && part bench64k "${LIMIT_BENCH:-330}" $PY "${BENCH[@]}" --tokens-per-step 65536 \
    --no-hf
has hostfirst && part hostfirst "${LIMIT_BENCH:-330}" $PY "${BENCH[@]}" --tokens-per-step 16384 \
    --no-hf --set train.skip_spikes=1e30
# One size a part, all its rows in one process (--size: seq 2048, MLM 40%, 16k and 24,576 tokens
# a step, ours, the reference, ours with the distributed optimizer; compiles twice per model).
for size in 210m 610m 1b; do
    if has "bench$size" || has sizes; then
        part "bench$size" "${LIMIT_SIZE:-540}" $PY benchmarks/train_throughput.py --size "$size" \
            --warmup 3 --steps 15 "${EXTRA[@]}"
    fi
done
if has profile; then  # the timed pass's Chrome trace comes back gzipped
    part profile "${LIMIT_PROFILE:-200}" $PY "${BENCH[@]}" --tokens-per-step 16384 --profile \
        --trace "$OUT/profile-trace.json"
    [ -f "$OUT/profile-trace.json" ] && gzip -f "$OUT/profile-trace.json"
fi
# The layer stack against the same layers compiled one by one, 210m at 16k tokens a step.
has stack && part stack "${LIMIT_STACK:-300}" $PY benchmarks/layer_stack.py --precision bf16 \
    --layers 12 --hidden 768 --ffn 3072 --heads 12 --kv-heads 12 --seq 2048 --micro-batch 8 \
    --vocab 128256 --threads 8
# TIER_K: the tier's checks (pytest -k); the first, a model trained until it has learned, takes
# a few minutes on a fresh machine. "fusions" and "compile" train the fast path against megatron's
# unfused kernels and optimizer, and against eager.
TIER_DEFAULT="learned or varlen or flex or optimizer or synchronis or accumulation or fusions"
# TIER_ARGS: more pytest arguments, e.g. "-n 4 --dist load" to run the checks side by side.
read -r -a TIER_EXTRA <<<"${TIER_ARGS:-}"
has tier && part tier "${LIMIT_TIER:-480}" $PY -m pytest -q -m gpu -rs tests/gpu \
    -k "${TIER_K:-$TIER_DEFAULT or compile}" "${TIER_EXTRA[@]}"
# Real shards: GPU_DATA holds tok/, shards/ and the fine-tuning sets (tools/gpu_train_check.py).
GPU_DATA=${GPU_DATA:-.gpu/data}
has compare && part compare "${LIMIT_COMPARE:-330}" $PY tools/gpu_train_check.py compare \
    "$GPU_DATA" "$OUT/compare"
has long && part long "${LIMIT_LONG:-480}" $PY tools/gpu_train_check.py long "$GPU_DATA" \
    "$OUT/long" --seconds "${LONG_SECONDS:-240}"
# The evaluation probe (docs/cluster.md#4-plan): PROBE_SIZE's random-init model with PROBE_TOKENIZER's
# vocabulary (the study's Llama-3 tokenizer prices the study: the embedding's update is a share of
# every step), fine-tuned 200 steps on each task, then a plan of that size priced from the file.
probe_then_plan() {  # probe_then_plan SIZE TOKENIZER OUTFILE [evaluate flags]
    local size=$1 tok=$2 file=$3
    local PROBE_TASKS=(sst2 conll2003 squad scifact)
    shift 3
    MLMCLM_DATA_DIR=$GPU_DATA $PY -m megatron_mlmclm evaluate --probe "$size" --tokenizer "$tok" \
        --task "${PROBE_TASKS[@]}" --out "$file" "$@" || return
    cat "$file"
    MLMCLM_DATA_DIR=$GPU_DATA $PY -m megatron_mlmclm plan --out "$file.plan" --force \
        --sizes "$size" --budgets 12000 --mask-ratios 0.4 --clm-shares --cpt-steps \
        --eval-tasks "${PROBE_TASKS[@]}" --eval-data-dir "$GPU_DATA" --eval-probe "$file" &&
        cat "$file.plan/SUMMARY_EVAL.csv"
}
export -f probe_then_plan  # `part` runs it under `timeout`, in a shell of its own
export PY GPU_DATA
has evalprobe && part evalprobe "${LIMIT_PROBE:-540}" bash -c 'probe_then_plan "$@"' probe \
    "${PROBE_SIZE:-210m}" "${PROBE_TOKENIZER:-$GPU_DATA/tok}" "$OUT/eval-probe-${PROBE_SIZE:-210m}.json"
if has smoke; then
    part smoke-bench 300 $PY benchmarks/train_throughput.py --quick
    part smoke-hostfirst 300 $PY benchmarks/train_throughput.py --quick --set train.skip_spikes=1e30
    part smoke-size 300 $PY benchmarks/train_throughput.py --quick --size 1b
    part smoke-profile 300 $PY benchmarks/train_throughput.py --quick --profile \
        --trace "$OUT/smoke-trace.json"
    part smoke-stack 300 $PY benchmarks/layer_stack.py --quick
    [ -d "$GPU_DATA/shards" ] && part smoke-compare 300 $PY tools/gpu_train_check.py compare \
        "$GPU_DATA" "$OUT/smoke-compare" --quick --steps 12
    [ -d "$GPU_DATA/sst2" ] && part smoke-long 300 $PY tools/gpu_train_check.py long \
        "$GPU_DATA" "$OUT/smoke-long" --quick --steps 60 --seconds 60 --save-interval 20 --workers 2
    [ -d "$GPU_DATA/sst2" ] && part smoke-evalprobe 300 bash -c 'probe_then_plan "$@"' probe \
        tiny "${PROBE_TOKENIZER:-$GPU_DATA/tok}" "$OUT/smoke-eval-probe.json" --probe-steps 12
fi
exit 0
