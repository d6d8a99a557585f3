#!/usr/bin/env bash
# hlo-train on one NVIDIA GPU (H100 80 GB or H200 141 GB), in one go and in
# under 8 minutes: the headline table of hlo-train's LoRA step against
# PyTorch+PEFT (eager and torch.compile) first, then correctness checks.
#
# Such a machine has python3 with JAX's CUDA PJRT plugin, PyTorch,
# transformers and PEFT but no Rust, so build here first and carry the
# binaries along:
#   cargo build --release -p hlo-train -p hlo-runtime --examples --bins
#   mkdir -p .device/bin && cp target/release/hlo-train target/release/examples/plugin_bench .device/bin/
# then, on the GPU machine, from the repository root (the device tool:
# carry [".device"], timeout_s about BUDGET + 40):
#   bash bench/gpu.sh
# Every line goes to $OUT/summary.txt as soon as it is known (a run cut off
# at its limit still brings back what it measured); the table is printed
# last. $OUT holds at most 5 files (summary.txt, results.jsonl, log.txt and
# two gzipped HLO dumps); everything else goes to $WORK.
#
# Order: whole rows of the table first (the machine may be cut off), each
# item time-boxed with `timeout` (at most its cap, never past the budget's
# end) and skipped when less time is left than it needs. Expected times on
# an H100/H200 (guesses from BENCHMARKS.md's runs, not yet measured as one):
#   item           what                                               expected       cap
#   sanity         hlo-train devices (PJRT), nvidia-smi               ~5-10 s        60 s
#   hlo-1b         hlo-train bench Llama 3.2 1B 8 x 1024              ~25 s          100 s
#   peer-1b        PyTorch+PEFT 1B 8 x 1024: eager, torch.compile     ~15 s + ~60 s  180 s
#   hlo-8b         hlo-train bench 8B 4 x 1024 (+ the HLO dump)       ~30-60 s       150 s
#   peer-8b        PyTorch+PEFT 8B 4 x 1024: eager, torch.compile     ~25 s + ~90 s  220 s
#   hlo-8b         8B 1 x 4096; 1 x 16384 (LONG_STEPS timed steps)    ~40 s; 60-110 s 150; 200 s
#   peer-8b        PyTorch+PEFT 8B eager 1 x 4096, 1 x 16384 (grad    ~60 s          150 s
#                  ckpt where it runs out of memory without)
#   longest        hlo-train 8B batch 1 at the longest seq that fits  compile + one  by estimate
#                  (LONGEST_SEQ, else `plan`'s line; if its step      step (10-250 s
#                  would not fit the time left, the longest that does) at 7-30% MFU)
#   peer-8b-more   torch.compile at 1 x 4096, 1 x 16384               ~2 x 90 s      250 s
#   (the table, into summary.txt)                                     sum ~430-520 s: the budget
#   correctness    f32 fixture logits + one SGD step vs HF/PEFT       ~20 s          60 s each
#   bf16           one bf16 SGD step vs PyTorch+PEFT bf16, each attention ~30 s        60 s each
#   hlo-dump       only with HLO_DUMP=separate (else rides hlo-8b)    ~60 s          150 s
#   multiproc preference grpo serve: older issues' checks, only when named in ONLY
# log.txt has each item's exit code, seconds and stderr tail.
#
# Knobs (environment):
#   BUDGET=460       seconds for the whole run (give the device tool ~40 more);
#                    RESERVE=25 of them are kept for the items after the table
#   ONLY="..."       the items to run (default: sanity hlo-1b peer-1b hlo-8b
#                    peer-8b longest peer-8b-more correctness bf16)
#   STEPS=10         timed steps (after 2 warm-up steps) for every column; and
#   LONG_STEPS=4     for rows of LONG_TOKENS=16384 tokens or more (1 warm-up)
#   HLO_FLAGS="..."  extra `hlo-train bench` arguments for every hlo-train run
#                    (e.g. "--attention naive" or "--remat layers"), so the
#                    same script measures an alternative; LABEL=... tags it.
#                    XLA options per compile: HLO_FLAGS="--xla-option KEY=VALUE"
#                    (or process-wide in XLA_FLAGS, which the plugin reads).
#   PEERS="eager compile"   which PyTorch columns (PEERS=none: hlo-train only)
#   SMALL_SHAPE=8x1024  BIG_SHAPES="4x1024 1x4096 1x16384"   the rows
#   LONGEST_SEQ=N    the longest row's seq (no probe); LONGEST_MARGIN=0.9 of
#                    the allocator's limit for the probe; LONGEST_STEPS=1,
#                    LONGEST_WARMUP=0; LONGEST_SHRINK=0: skip rather than
#                    shorten it when time is short
#   HLO_DUMP=1       dump the 8B 4 x 1024 step's optimized HLO and buffer
#                    assignment during its headline run (its compile time then
#                    includes writing them; HLO_DUMP_MODULES picks the module);
#                    separate: a run of its own after the table; 0: none
#   COMPILE_EST=90   seconds a torch.compile is taken to need (for skipping)
#   PEAK_TFLOPS=989  the MFU denominator (H100/H200 dense bf16)
#   DRY=1            the same pipeline on this machine: the CPU plugin, the
#                    tiny model (shapes 8x64; 4x64 1x128 1x256), PyTorch on the
#                    CPU; PLUGIN, MODEL_SMALL, MODEL_BIG, PEER_DEVICE, PY, BIN
#                    override single pieces
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

DRY=${DRY:-}
if [ -n "$DRY" ]; then
  : "${PLUGIN:=cpu}" "${MODEL_SMALL:=tiny}" "${MODEL_BIG:=tiny}" "${PEER_DEVICE:=cpu}"
  : "${SMALL_SHAPE:=8x64}" "${BIG_SHAPES:=4x64 1x128 1x256}" "${STEPS:=3}" "${LONG_STEPS:=2}"
  : "${LONGEST_CAPACITY:=4000000}" "${PROBE_SEQS:=64 256}" "${SEQ_ROUND:=64}" "${MAX_SEQ:=512}"
  : "${BUDGET:=900}" "${COMPILE_EST:=40}"
fi
PLUGIN=${PLUGIN:-cuda}
MODEL_SMALL=${MODEL_SMALL:-llama3.2-1b}
MODEL_BIG=${MODEL_BIG:-llama3.1-8b}
SMALL_SHAPE=${SMALL_SHAPE:-8x1024}
BIG_SHAPES=${BIG_SHAPES:-4x1024 1x4096 1x16384}
PEER_DEVICE=${PEER_DEVICE:-cuda}
PEERS=${PEERS:-eager compile}
DTYPE=${DTYPE:-bf16}
STEPS=${STEPS:-10}
LONG_STEPS=${LONG_STEPS:-4}
LONG_TOKENS=${LONG_TOKENS:-16384}
BUDGET=${BUDGET:-460}
RESERVE=${RESERVE:-25}
COMPILE_EST=${COMPILE_EST:-90}
PROBE_SEQS=${PROBE_SEQS:-8192 131072}
# `plan` needs the CPU plugin (.plugins/cpu, 200 MB, not carried to a GPU
# machine): there these totals are used, planned on the development machine
# at 717fa27 (Llama 3.1 8B, batch 1, LoRA r=16 on all projections, bf16,
# AdamW, attention and loss on auto; the total is linear in the sequence).
PLAN_POINTS=${PLAN_POINTS:-8192:23040829440 131072:112822855680}
SEQ_ROUND=${SEQ_ROUND:-2048}
MAX_SEQ=${MAX_SEQ:-131072}
LONGEST_MARGIN=${LONGEST_MARGIN:-0.9}
LONGEST_STEPS=${LONGEST_STEPS:-1}
LONGEST_WARMUP=${LONGEST_WARMUP:-0}
HLO_DUMP=${HLO_DUMP:-1}
HLO_DUMP_MODULES=${HLO_DUMP_MODULES:-.*train_step.*}
export PEAK_TFLOPS=${PEAK_TFLOPS:-989}
ONLY=${ONLY:-sanity hlo-1b peer-1b hlo-8b peer-8b longest peer-8b-more correctness bf16}
PY=${PY:-python3}
if [ -z "${BIN:-}" ]; then
  BIN=.device/bin
  [ -x "$BIN/hlo-train" ] || BIN=target/release
  [ -x "$BIN/hlo-train" ] || BIN=target/debug
fi
HT=$BIN/hlo-train
read -r -a HLO_EXTRA <<<"${HLO_FLAGS:-}"
OUT=${OUT:-/tmp/hlo-train-gpu}
W=${WORK:-/tmp/hlo-train-gpu-work}
mkdir -p "$OUT" "$W"
R=$OUT/results.jsonl
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
: >"$OUT/summary.txt"
: >"$OUT/log.txt"
: >"$R"
summary=()
note() { summary+=("$1"); printf '%s\n' "$1" >>"$OUT/summary.txt"; }
report() { "$PY" bench/gpu_report.py "$@"; }
wanted() { [[ " $ONLY " == *" $1 "* ]]; }

# The budget: SECONDS counts from the script's start.
END=$BUDGET
HEAD_END=$((BUDGET - RESERVE))
left() { echo $(( ${1:-$END} - SECONDS )); }
# box NAME CAP NEED [END] -- CMD...: CMD under `timeout`, at most CAP seconds
# and never past END; not started (exit 200) when fewer than NEED seconds
# are left. Its stderr goes to $W/NAME.err, whose tail goes to log.txt.
box() {
  local name=$1 cap=$2 need=$3 end=$END
  shift 3
  if [ "$1" != -- ]; then end=$1; shift; fi
  shift
  local l rc t0=$SECONDS
  l=$(left "$end")
  if (( l < need )); then
    printf '== %s: skipped at %d s (%d s left, %d needed)\n' "$name" "$SECONDS" "$l" "$need" >>"$OUT/log.txt"
    return 200
  fi
  timeout -k 10 $(( cap < l ? cap : l )) "$@" 2>"$W/$name.err"
  rc=$?
  { printf '== %s: exit %d after %d s (at %d s)\n' "$name" "$rc" $((SECONDS - t0)) "$SECONDS"
    tail -n 15 "$W/$name.err"; } >>"$OUT/log.txt"
  return $rc
}
why() {  # a failed box's reason, in a few words
  case $1 in
    200) echo "skipped (budget)";;
    124|137) echo "timed out";;
    *) if grep -qE "[Oo]ut of memory|RESOURCE_EXHAUSTED|\bOOM\b" "$W/$2.err" 2>/dev/null; then
         echo "out of memory"
       else echo "failed (exit $1): $(tail -c 200 "$W/$2.err" | tr '\n' ' ')"; fi;;
  esac
}
b_of() { echo "${1%x*}"; }
s_of() { echo "${1#*x}"; }

note "hlo-train GPU run ${LABEL:+($LABEL) }$(date -u +%FT%TZ): plugin $PLUGIN, $HT, HLO_FLAGS='${HLO_FLAGS:-}', budget ${BUDGET} s, ONLY='$ONLY'"

# One hlo-train bench run: ROW-NAME MODEL BxS STEPS WARMUP CAP NEED [extra args].
hlo_bench() {
  local name=$1 model=$2 shape=$3 steps=$4 warm=$5 cap=$6 need=$7 rc
  shift 7
  local b s
  b=$(b_of "$shape"); s=$(s_of "$shape")
  box "$name" "$cap" "$need" "$HEAD_END" -- "$HT" bench --plugin "$PLUGIN" --model "$model" --dtype "$DTYPE" \
      --lora-rank 16 --lora-alpha 32 --batch "$b" --seq "$s" --steps "$steps" --warmup-steps "$warm" \
      --json "${HLO_EXTRA[@]}" "$@" >"$W/$name.json"
  rc=$?
  if [ $rc = 0 ]; then
    note "$(report hlo "$R" "$W/$name.json" "${LABEL:-}" 2>&1)"
  else
    report record "$R" kind=failed impl=hlo-train "row=$model $shape" "why=$(why $rc "$name")"
    note "hlo-train $model $b x $s: $(why $rc "$name")"
  fi
  return $rc
}

# One PyTorch+PEFT process: NAME MODEL CAP NEED JOBS [extra args].
peer() {
  local name=$1 model=$2 cap=$3 need=$4 jobs=$5 rc size=8b
  shift 5
  [ -z "$jobs" ] && return 0
  [ "$model" = "$MODEL_SMALL" ] && size=1b
  [ "$model" = tiny ] && size=tiny
  box "$name" "$cap" "$need" "$HEAD_END" -- "$PY" bench/peft_lora_step.py "$size" --jobs "$jobs" \
      --device "$PEER_DEVICE" --steps "$STEPS" --compile-est "$COMPILE_EST" \
      --deadline $(( $(date +%s) + $(left "$HEAD_END") )) "$@" >"$W/$name.jsonl"
  rc=$?
  [ $rc = 200 ] && : >"$W/$name.jsonl"
  while read -r l; do note "$l"; done < <(report peer "$R" "$W/$name.jsonl" "$jobs" "$model" "$(why $rc "$name")" 2>&1)
  [ $rc = 0 ] || note "PyTorch+PEFT $name: $(why $rc "$name")"
}
# The jobs of MODE for SHAPES (each BxS; long rows LONG_STEPS steps).
jobs_of() {
  local mode=$1 shape out=()
  [[ " $PEERS " == *" $mode "* ]] || return 0
  shift
  for shape in "$@"; do
    if (( $(b_of "$shape") * $(s_of "$shape") >= LONG_TOKENS )); then
      out+=("$mode:$shape:$LONG_STEPS")
    else
      out+=("$mode:$shape")
    fi
  done
  local IFS=,
  echo "${out[*]}"
}
join() {  # the non-empty arguments, comma-separated
  local a out=()
  for a in "$@"; do [ -n "$a" ] && out+=("$a"); done
  local IFS=,
  echo "${out[*]}"
}
steps_for() { if (( $(b_of "$1") * $(s_of "$1") >= LONG_TOKENS )); then echo "$LONG_STEPS"; else echo "$STEPS"; fi; }
warmup_for() { if (( $(b_of "$1") * $(s_of "$1") >= LONG_TOKENS )); then echo 1; else echo 2; fi; }

CAPACITY=
sanity() {
  echo "== sanity: devices, nvidia-smi; the longest-sequence probe (plan, on the CPU) in the background"
  # `plan` compiles on the CPU plugin, which a GPU machine lacks (PLAN_POINTS then).
  if [ -z "${LONGEST_SEQ:-}" ] && wanted longest && [ -f .plugins/cpu/pjrt_cpu_plugin.so ]; then
    for s in $PROBE_SEQS; do
      timeout 60 "$HT" plan --model "$MODEL_BIG" --dtype "$DTYPE" --lora-rank 16 --lora-alpha 32 \
          --batch 1 --seq "$s" --json --no-suggestions >"$W/plan-$s.json" 2>"$W/plan-$s.err" &
    done
  fi
  if box devices 60 5 -- "$HT" devices --plugin "$PLUGIN" --json >"$W/devices.json"; then
    local out
    out=$(report devices "$R" "$W/devices.json" 2>&1)
    note "$(head -n 1 <<<"$out")"
    CAPACITY=$(tail -n 1 <<<"$out")
  else
    note "devices: FAILED: $(tail -c 300 "$W/devices.err")"
  fi
  if command -v nvidia-smi >/dev/null; then
    note "nvidia-smi: $(timeout 10 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -n 2)"
  fi
}

hlo_1b() {
  echo "== hlo-1b: hlo-train bench $MODEL_SMALL $SMALL_SHAPE"
  hlo_bench hlo-1b "$MODEL_SMALL" "$SMALL_SHAPE" "$(steps_for "$SMALL_SHAPE")" "$(warmup_for "$SMALL_SHAPE")" 100 30
}

peer_1b() {
  echo "== peer-1b: PyTorch+PEFT $MODEL_SMALL $SMALL_SHAPE, eager then torch.compile"
  peer peer-1b "$MODEL_SMALL" 180 25 "$(join "$(jobs_of eager "$SMALL_SHAPE")" "$(jobs_of compile "$SMALL_SHAPE")")"
}

biggest() {  # the biggest file in $W/hlo-dump whose name ends in $1
  find "$W/hlo-dump" -maxdepth 1 -name "*$1" -printf '%s %p\n' 2>/dev/null | sort -n | tail -n 1 | cut -d' ' -f2-
}
collect_dump() {  # the biggest optimized module and its buffer assignment, gzipped into $OUT
  local f b sizes
  f=$(biggest after_optimizations.txt)
  [ -n "$f" ] && gzip -c "$f" >"$OUT/hlo-8b-after_optimizations.txt.gz"
  # That module's buffer assignment, else the biggest.
  b=${f%.txt}-buffer-assignment.txt
  [ -f "$b" ] || b=$(biggest buffer-assignment.txt)
  [ -n "$b" ] && gzip -c "$b" >"$OUT/hlo-8b-buffer-assignment.txt.gz"
  sizes=$(find "$OUT" -maxdepth 1 -name 'hlo-8b-*.gz' -printf '%f %s bytes; ')
  note "HLO dump: ${sizes:-none; }$(find "$W/hlo-dump" -type f 2>/dev/null | wc -l) files dumped (${f##*/})"
}

read -r BIG_FIRST _ <<<"$BIG_SHAPES"
read -r -a BIG_REST <<<"${BIG_SHAPES#"$BIG_FIRST"}"

hlo_8b_first() {
  echo "== hlo-8b: hlo-train bench $MODEL_BIG $BIG_FIRST"
  local shape=$BIG_FIRST
  if [ "$HLO_DUMP" = 1 ]; then
    rm -rf "$W/hlo-dump"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$W/hlo-dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=$HLO_DUMP_MODULES" \
      hlo_bench "hlo-8b-$shape" "$MODEL_BIG" "$shape" "$(steps_for "$shape")" "$(warmup_for "$shape")" 150 45
    [ $? = 200 ] || collect_dump
  else
    hlo_bench "hlo-8b-$shape" "$MODEL_BIG" "$shape" "$(steps_for "$shape")" "$(warmup_for "$shape")" 150 45
  fi
}

hlo_8b_rest() {
  local shape
  for shape in "${BIG_REST[@]}"; do
    echo "== hlo-8b: hlo-train bench $MODEL_BIG $shape"
    hlo_bench "hlo-8b-$shape" "$MODEL_BIG" "$shape" "$(steps_for "$shape")" "$(warmup_for "$shape")" 200 45
  done
}

peer_8b_first() {
  echo "== peer-8b: PyTorch+PEFT $MODEL_BIG $BIG_FIRST, eager then torch.compile"
  peer peer-8b "$MODEL_BIG" 220 40 "$(join "$(jobs_of eager "$BIG_FIRST")" "$(jobs_of compile "$BIG_FIRST")")"
}

peer_8b_rest() {
  [ ${#BIG_REST[@]} = 0 ] && return
  echo "== peer-8b: PyTorch+PEFT $MODEL_BIG ${BIG_REST[*]}, eager"
  peer peer-8b-rest "$MODEL_BIG" 150 40 "$(jobs_of eager "${BIG_REST[@]}")"
}

peer_8b_more() {
  [ ${#BIG_REST[@]} = 0 ] && return
  echo "== peer-8b-more: PyTorch+PEFT $MODEL_BIG ${BIG_REST[*]}, torch.compile, while time is left"
  peer peer-8b-more "$MODEL_BIG" 250 60 "$(jobs_of compile "${BIG_REST[@]}")"
}

longest() {
  echo "== longest: hlo-train bench $MODEL_BIG, batch 1, at the longest sequence that fits"
  local seq how s plans=() source="plan run here"
  wait  # the probe's plans
  if [ -n "${LONGEST_SEQ:-}" ]; then
    seq=$LONGEST_SEQ how="LONGEST_SEQ given"
  else
    local cap=${LONGEST_CAPACITY:-$CAPACITY}
    for s in $PROBE_SEQS; do
      if [ -s "$W/plan-$s.json" ]; then plans+=("$W/plan-$s.json"); else plans=(); break; fi
    done
    if [ ${#plans[@]} = 0 ]; then
      read -r -a plans <<<"$PLAN_POINTS"
      source="plan's totals from the development machine (no CPU plugin here)"
    fi
    if [ -z "$cap" ] || [ "$cap" = 0 ]; then
      note "longest: no allocator limit known (devices failed?): not run; set LONGEST_SEQ"
      return
    fi
    local out
    if ! out=$(report longest "$cap" "$LONGEST_MARGIN" "$SEQ_ROUND" "$MAX_SEQ" "${plans[@]}" 2>&1); then
      note "longest: the plan probe failed: $(tail -c 300 <<<"$out") $(tail -c 200 "$W/plan-${PROBE_SEQS%% *}.err")"
      return
    fi
    seq=$(head -n 1 <<<"$out")
    note "$(tail -n 1 <<<"$out")"
    how="plan probe, ${LONGEST_MARGIN} x allocator limit"
    note "longest: the probe used $source"
  fi
  local row est need n=$((LONGEST_STEPS + LONGEST_WARMUP)) room
  # A compile and the steps, at the slowest MFU hlo-train showed so far.
  est=$(report estimate "$R" "$MODEL_BIG" 1 "$seq")
  need=$(awk -v e="$est" -v n="$n" -v c="$COMPILE_EST" 'BEGIN { printf "%d", c / 2 + n * e + 10 }')
  note "longest: $seq tokens fit ($how); a step estimated at ${est} s, the run at ${need} s ($LONGEST_WARMUP warm-up, $LONGEST_STEPS timed)"
  room=$(( $(left "$HEAD_END") - COMPILE_EST / 2 - 10 ))
  if (( need > $(left "$HEAD_END") )) && [ "${LONGEST_SHRINK:-1}" = 1 ] && (( room > 0 )); then
    # Not the time for it: the longest sequence whose steps fit the time
    # left, if longer than every row before.
    local fit
    fit=$(report within "$R" "$MODEL_BIG" $(( room / n )) "$SEQ_ROUND" "$seq")
    local longest_row=0 shape
    for shape in $BIG_SHAPES; do (( $(s_of "$shape") > longest_row )) && longest_row=$(s_of "$shape"); done
    if (( fit > longest_row )); then
      how="$how; memory would allow $seq, the time left $fit"
      note "longest: not the time for $seq tokens; $fit instead (the longest whose steps fit the $(left "$HEAD_END") s left)"
      seq=$fit
      need=$(( $(left "$HEAD_END") - 5 ))
    fi
  fi
  row="$MODEL_BIG 1x$seq"
  report record "$R" kind=longest "row=$row" "how=$how; $LONGEST_STEPS step(s) after $LONGEST_WARMUP warm-up"
  hlo_bench hlo-longest "$MODEL_BIG" "1x$seq" "$LONGEST_STEPS" "$LONGEST_WARMUP" 400 "$need"
  local rc=$?
  if [ $rc != 0 ] && [ "$(why $rc hlo-longest)" = "out of memory" ] && [ -z "${LONGEST_SEQ:-}" ]; then
    # The plan is XLA's CPU plan; the GPU's may differ: once more at 4/5.
    seq=$(( seq * 4 / 5 / SEQ_ROUND * SEQ_ROUND ))
    row="$MODEL_BIG 1x$seq"
    report record "$R" kind=longest "row=$row" "how=$how, 4/5 after out of memory"
    est=$(report estimate "$R" "$MODEL_BIG" 1 "$seq")
    need=$(awk -v e="$est" -v n=$((LONGEST_STEPS + LONGEST_WARMUP)) -v c="$COMPILE_EST" 'BEGIN { printf "%d", c / 2 + n * e + 10 }')
    note "longest: out of memory; again at $seq tokens (estimated ${need} s)"
    hlo_bench hlo-longest2 "$MODEL_BIG" "1x$seq" "$LONGEST_STEPS" "$LONGEST_WARMUP" 400 "$need"
  fi
}

correctness() {
  echo "== correctness: fixture logits (f32) and one SGD step from a PEFT adapter, against HF/PEFT"
  local F=tests/fixtures/llama m prompt d
  for m in gqa_llama3 mha_tied head_dim; do
    prompt=$("$PY" -c "from safetensors.torch import load_file; print(','.join(map(str, load_file('$F/$m/expected.safetensors')['input_ids'][0].tolist())))")
    if box "logits-$m" 60 10 -- "$HT" generate --plugin "$PLUGIN" --dtype f32 --checkpoint "$F/$m" --adapter "$F/$m/adapter" \
        --prompt-ids "$prompt" --max-new-tokens 1 --dump-logits "$W/$m.safetensors" >/dev/null; then
      d=$("$PY" -c "
from safetensors.torch import load_file
a = load_file('$W/$m.safetensors')['logits']; b = load_file('$F/$m/expected.safetensors')['logits_adapter'][0]
print(f'{(a - b).abs().max().item():.2e}')" 2>&1)
    else d=$(why $? "logits-$m"); fi
    note "logits $m + adapter, f32 on $PLUGIN vs HF: max abs diff $d"
  done
  "$PY" - "$F" "$W/rows.jsonl" <<'PY'
import json, sys
from safetensors.torch import load_file
e = load_file(f"{sys.argv[1]}/gqa_llama3/expected.safetensors")
with open(sys.argv[2], "w") as f:
    for row in e["input_ids"].tolist():
        f.write(json.dumps({"input_ids": row}) + "\n")
PY
  rm -rf "$W/step"
  if box sgd-step 60 10 -- "$HT" train --plugin "$PLUGIN" --dtype f32 --checkpoint "$F/gqa_llama3" --init-adapter "$F/gqa_llama3/adapter" \
      --data "$W/rows.jsonl" --batch 2 --seq 9 --steps 1 --optimizer sgd --lr 0.05 --clip-norm 0 --out "$W/step" >/dev/null; then
    d=$("$PY" -c "
from safetensors.torch import load_file
ours = load_file('$W/step/adapter_model.safetensors'); want = load_file('$F/gqa_llama3/train_step.safetensors')
print(f'{max((ours[k] - want[\"sgd.\" + k]).abs().max().item() for k in ours):.2e}')" 2>&1)
  else d=$(why $? sgd-step); fi
  note "one SGD step (f32) on $PLUGIN vs PyTorch+PEFT: max abs diff of the adapter $d"
}

# ---------------------------------------------------------------------------
# One bf16 LoRA SGD step of hlo-train (--dtype bf16, on $PLUGIN) from the
# gqa_llama3 fixture's bf16-rounded weights and its f32 adapter, against
# PyTorch+PEFT's bf16 step (scripts/make_bf16_step_fixture.py), for each
# attention form. The bound on the adapter is tests/tests/llama_bf16.rs's
# (sqrt(4R) u max|update|, R = 49 roundings in series, u = 2^-8: 8.2e-4);
# the f64 step is what both bf16 programs round towards.
bf16_step_check() {
  echo "== bf16: one bf16 step against PyTorch+PEFT in bf16, each attention form"
  local F=tests/fixtures/llama/gqa_llama3 a d
  "$PY" - "$F/bf16_step.safetensors" "$W/rows16.jsonl" <<'PY'
import json, sys
from safetensors.torch import load_file
e = load_file(sys.argv[1])
with open(sys.argv[2], "w") as f:
    for row in e["input_ids"].tolist():
        f.write(json.dumps({"input_ids": row}) + "\n")
PY
  local forms="naive blockwise auto"
  [ "$PLUGIN" = cuda ] && forms="$forms cudnn"
  for a in $forms; do
    rm -rf "$W/step16-$a"
    if box "bf16-step-$a" 60 10 -- "$HT" train --plugin "$PLUGIN" --dtype bf16 --checkpoint "$F" --init-adapter "$F/adapter" \
        --data "$W/rows16.jsonl" --batch 2 --seq 9 --steps 1 --optimizer sgd --lr 0.05 --clip-norm 0 \
        --attention "$a" --out "$W/step16-$a" >/dev/null; then
      d=$("$PY" -c "
from safetensors.torch import load_file
ours = load_file('$W/step16-$a/adapter_model.safetensors'); want = load_file('$F/bf16_step.safetensors')
pt = max((ours[k].float() - want['bf16.sgd.' + k]).abs().max().item() for k in ours)
ex = max((ours[k].float() - want['f64.sgd.' + k]).abs().max().item() for k in ours)
print(f'{pt:.2e} (vs the f64 step {ex:.2e}; bound 8.2e-4)')" 2>&1)
    else d=$(why $? "bf16-step-$a"); fi
    note "one SGD step (bf16, --attention $a) on $PLUGIN vs PyTorch+PEFT bf16: max abs diff of the adapter $d"
  done
}
# ---------------------------------------------------------------------------

hlo_dump() {
  [ "$HLO_DUMP" = separate ] || return 0
  echo "== hlo-dump: the $MODEL_BIG ${BIG_SHAPES%% *} step's optimized HLO and buffer assignment"
  local shape=${BIG_SHAPES%% *} b s
  b=$(b_of "$shape"); s=$(s_of "$shape")
  rm -rf "$W/hlo-dump"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$W/hlo-dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=$HLO_DUMP_MODULES" \
    box hlo-dump 150 45 -- "$HT" bench --plugin "$PLUGIN" --model "$MODEL_BIG" --dtype "$DTYPE" --lora-rank 16 --lora-alpha 32 \
      --batch "$b" --seq "$s" --steps 1 --warmup-steps 0 --json "${HLO_EXTRA[@]}" >/dev/null
  [ $? = 200 ] || collect_dump
}

# --- older issues' checks: run only when named in ONLY --------------------

multiproc() {
  echo "== multiproc (issue 24): two processes on this GPU meet through our key-value store"
  # Both processes drive the one GPU (no LOCAL_RANK), so each should list 2
  # global devices, 1 of them addressable.
  local port=$((20000 + RANDOM % 20000)) k
  for k in 0 1; do
    timeout 150 "$HT" devices --plugin "$PLUGIN" --json --num-processes 2 --process-id $k \
      --coordinator 127.0.0.1:$port --init-timeout 120 >"$W/devices-p$k.json" 2>"$W/devices-p$k.err" &
  done
  wait
  for k in 0 1; do
    if [ -s "$W/devices-p$k.json" ]; then
      note "process $k of 2 on one GPU: $("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print("process_index", d["process_index"], "of", d["num_processes"], "|", len(d["devices"]), "devices,", sum(x["addressable"] for x in d["devices"]), "addressable, ids", [x["id"] for x in d["devices"]])' "$W/devices-p$k.json")"
    else
      note "process $k of 2 on one GPU: FAILED: $(tail -c 300 "$W/devices-p$k.err")"
    fi
  done
}

preference() {
  echo "== preference (issue 36): DPO against TRL's fixture (f32), DPO/ORPO steps against SFT of the same tokens, the PyTorch+PEFT DPO peer"
  local F=tests/fixtures/llama P=tests/fixtures/preference spec objective b extra
  box dpo-fixture 60 10 -- "$HT" train --plugin "$PLUGIN" --dtype f32 --objective dpo --checkpoint "$F/gqa_llama3" --data "$P/data_ids.jsonl" \
      --batch 4 --seq 16 --steps 1 --optimizer sgd --lr 0.1 --clip-norm 0 --init-adapter "$P/adapters/init" \
      --metrics "$W/dpo.jsonl" >/dev/null
  note "DPO (f32) on $PLUGIN vs TRL: $("$PY" -c '
import json, sys
got = json.loads(open(sys.argv[1]).readline()); want = json.load(open(sys.argv[2]))["dpo.init.sgd"]
keys = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
print("max abs diff over loss and rewards/logps %.2e" % max(abs(got[k] - (want["loss"] if k == "loss" else want["metrics"][k])) for k in keys))' "$W/dpo.jsonl" "$P/expected.json" 2>&1 | tail -n 1)"
  for spec in "$MODEL_SMALL $SMALL_SHAPE" "$MODEL_BIG ${BIG_SHAPES%% *}"; do
    local model shape
    read -r model shape <<<"$spec"
    for objective in ${PREFERENCE_OBJECTIVES:-sft dpo dpo-precomputed orpo}; do
      # The same rows a step: SFT's batch of rows is DPO's and ORPO's pairs' two sides.
      b=$(b_of "$shape"); [ "$objective" != sft ] && b=$((b / 2))
      extra=(--objective "${objective%-precomputed}"); [ "$objective" = dpo-precomputed ] && extra+=(--precompute-ref)
      hlo_bench "pref-$model-$objective" "$model" "${b}x$(s_of "$shape")" "$STEPS" 2 200 30 "${extra[@]}"
    done
    [ -n "${NO_PEER:-}" ] && continue
    peer "peer-dpo-$model" "$model" 200 30 "eager:$shape" --objective dpo
  done
}

grpo() {
  echo "== grpo (issue 37): a TRL fixture case (f32), then rollouts and steps of $MODEL_SMALL shapes"
  local F=tests/fixtures/llama G=tests/fixtures/grpo len
  box grpo-fixture 90 10 -- "$HT" train --plugin "$PLUGIN" --dtype f32 --objective grpo --checkpoint "$F/gqa_llama3" \
      --tokenizer tests/fixtures/preference/tokenizer/tokenizer.json --rollouts "$G/rollouts.jsonl" \
      --batch 8 --num-generations 4 --seq 16 --steps 2 --num-iterations 2 --beta 0.04 --max-completion-length 6 \
      --optimizer sgd --lr 0.1 --clip-norm 0 --init-adapter "$G/adapters/init" --ref-adapter "$G/adapters/ref" \
      --metrics "$W/grpo-fixture.jsonl" >/dev/null
  note "GRPO (f32) on $PLUGIN vs TRL (dapo.b0.04.mu2.ref): $("$PY" -c '
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]; want = json.load(open(sys.argv[2]))["dapo.b0.04.mu2.ref"]["steps"]
keys = ["loss", "kl", "entropy", "clip_ratio/region_mean"]
print("max abs diff over both steps %.2e" % max(abs(g[k] - w["logged"][k]) for g, w in zip(got, want) for k in keys))' "$W/grpo-fixture.jsonl" "$G/expected.json" 2>&1 | tail -n 1)"
  "$PY" - "$W/prompts-1b.jsonl" <<'PY'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"prompt_ids": [random.randrange(3, 128000) for _ in range(128)]}) + "\n")
PY
  for len in ${GRPO_COMPLETIONS:-128 512}; do
    if box "grpo-$len" 300 60 -- "$HT" train --plugin "$PLUGIN" --objective grpo --model "$MODEL_SMALL" --dtype "$DTYPE" --lora-rank 16 --lora-alpha 32 \
        --data "$W/prompts-1b.jsonl" --reward length --num-generations 8 --batch 64 --seq $((128 + len)) \
        --max-completion-length "$len" --steps 5 --log-every 5 --metrics "$W/grpo-1b-$len.jsonl" >/dev/null; then
      note "GRPO $MODEL_SMALL, 8 prompts x 8 completions of $len tokens (prompts 128): $("$PY" -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]; later = rows[1:]
gen = sum(r["rollout/seconds"] for r in later); step = sum(r["step_time_s"] for r in later)
print("rollouts %.0f tokens/s (%.2f s a batch; first %.1f s with compiling), step %.0f ms (%.0f tokens/s), %.0f%% of the loop generating" % (
    statistics.median(r["rollout/tokens_per_s"] for r in later), statistics.median(r["rollout/seconds"] for r in later),
    rows[0]["rollout/seconds"], 1e3 * statistics.median(r["step_time_s"] for r in later),
    statistics.median(r["tokens_per_s"] for r in later), 100 * gen / (gen + step)))' "$W/grpo-1b-$len.jsonl" 2>&1 | tail -n 1)"
    else
      note "GRPO $MODEL_SMALL ($len): $(why $? "grpo-$len")"
    fi
  done
}

healthy() {
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2)' "$1" 2>/dev/null
}

serve() {
  echo "== serve: $MODEL_SMALL shapes (random bf16 weights), 32 slots, 8 rank-8 adapters; streamed greedy completions through the openai client"
  # The openai client is not on such a machine: carry its wheels in .whl
  # (the device tool's README says how) and install them into /tmp/site.
  if ! "$PY" -c 'import openai' 2>/dev/null; then
    [ -d .whl ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" bench/serve_load.py make-adapters --config bench/configs/llama-1b.json --count 8 --rank 8 \
      --targets q_proj,k_proj,v_proj,o_proj --out "$W/adapters" >/dev/null
  local port=$((20000 + RANDOM % 20000)) adapters=() k models
  for k in 0 1 2 3 4 5 6 7; do adapters+=(--adapter "a$k=$W/adapters/a000$k"); done
  "$HT" serve --plugin "$PLUGIN" --model "$MODEL_SMALL" --dtype "$DTYPE" --served-model-name base \
      --max-batch-size 32 --max-model-len 512 --max-lora-rank 8 --max-loras 8 --port "$port" \
      "${adapters[@]}" >"$W/serve.log" 2>&1 &
  local pid=$!
  for k in $(seq 1 240); do
    healthy "$port" && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if ! healthy "$port"; then
    note "serve: FAILED to start: $(tail -c 300 "$W/serve.log")"
    kill -TERM $pid 2>/dev/null
    return
  fi
  note "serve: ready ${k} s after start (weights made on the host, programs compiled)"
  for models in base a0 a0,a1,a2,a3,a4,a5,a6,a7; do
    timeout 200 "$PY" bench/serve_load.py run --url "http://127.0.0.1:$port" --models "$models" \
        --concurrency "${SERVE_CONCURRENCY:-1,16,32}" --requests 16 --prompt-len 32 --max-tokens 64 \
        --vocab 128000 >"$W/serve-$models.jsonl" 2>>"$W/serve.log"
    while read -r l; do
      note "serve models=$models: $("$PY" -c 'import json, sys; r = json.loads(sys.argv[1]); print("c=%s %.1f tok/s, %s errors, TTFT p50 %s ms, ITL p50/p99 %s/%s ms" % (r.get("concurrency"), r.get("output_tokens_per_s", 0), r.get("errors"), r.get("ttft_p50_ms"), r.get("itl_p50_ms"), r.get("itl_p99_ms")))' "$l")"
    done <"$W/serve-$models.jsonl"
  done
  kill -TERM $pid; wait $pid
  note "serve: SIGTERM exit code $?"
}

# --- the run ---------------------------------------------------------------
wanted sanity && sanity
wanted hlo-1b && hlo_1b
wanted peer-1b && peer_1b
# Whole rows first: 1B, then 8B at the first shape, then the longer 8B rows.
wanted hlo-8b && hlo_8b_first
wanted peer-8b && peer_8b_first
wanted hlo-8b && hlo_8b_rest
wanted peer-8b && peer_8b_rest
wanted longest && longest
wanted peer-8b-more && peer_8b_more
wait
TABLE=$(report table "$R" 2>&1)
{ echo; echo "== table (at $SECONDS s)"; echo "$TABLE"; echo; } >>"$OUT/summary.txt"
wanted correctness && correctness
wanted bf16 && bf16_step_check
hlo_dump
wanted multiproc && multiproc
wanted preference && preference
wanted grpo && grpo
wanted serve && serve
wait

note "done at $SECONDS s of a ${BUDGET} s budget"
echo
echo "== summary"
printf '%s\n' "${summary[@]}"
echo
echo "== table"
report table "$R" 2>&1
