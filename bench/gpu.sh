#!/usr/bin/env bash
# hlo-train on an NVIDIA GPU machine, in one go: validation, benchmarks
# and the PyTorch+PEFT peer.
#
# Such a machine has python3 with JAX's CUDA PJRT plugin, PyTorch,
# transformers and PEFT but no Rust, so build here first and carry the
# binaries along:
#   cargo build --release -p hlo-train -p hlo-runtime --examples --bins
#   mkdir -p .device/bin && cp target/release/hlo-train target/release/examples/plugin_bench .device/bin/
# then, on the GPU machine, from the repository root:
#   bash bench/gpu.sh
# It prints a short table last. Steps that need later issues say so.
set -uo pipefail
BIN=${BIN:-.device/bin}
OUT=${OUT:-/tmp/hlo-train-gpu}
STEPS=${STEPS:-12}
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
summary=()
# Each line also goes to $OUT/summary.txt as soon as it is known, so a run
# cut off at its time limit still brings back what it measured.
: >"$OUT/summary.txt"
note() { summary+=("$1"); printf '%s\n' "$1" >>"$OUT/summary.txt"; }
F=tests/fixtures/llama

step1() {
echo "== 1. devices"
if "$BIN/hlo-train" devices --plugin cuda --json >"$OUT/devices.json"; then
  note "devices: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["platform"], "API", d["api_version"], len(d["devices"]), "x", d["devices"][0]["kind"])' "$OUT/devices.json")"
else
  note "devices: FAILED"
fi
}

step2() {
echo "== 2. correctness: fixture logits (f32) and one SGD step from a PEFT adapter, against HF/PEFT"
python3 - "$F" <<'PY' >"$OUT/rows.txt"
import sys, torch
from safetensors.torch import load_file
e = load_file(f"{sys.argv[1]}/gqa_llama3/expected.safetensors")
import json
for row in e["input_ids"].tolist():
    print(json.dumps({"input_ids": row}))
PY
cp "$OUT/rows.txt" "$OUT/rows.jsonl"
for m in gqa_llama3 mha_tied head_dim; do
  prompt=$(python3 -c "from safetensors.torch import load_file; print(','.join(map(str, load_file('$F/$m/expected.safetensors')['input_ids'][0].tolist())))")
  "$BIN/hlo-train" generate --plugin cuda --dtype f32 --checkpoint "$F/$m" --adapter "$F/$m/adapter" \
      --prompt-ids "$prompt" --max-new-tokens 1 --dump-logits "$OUT/$m.safetensors" >/dev/null
  d=$(python3 -c "
from safetensors.torch import load_file
a = load_file('$OUT/$m.safetensors')['logits']; b = load_file('$F/$m/expected.safetensors')['logits_adapter'][0]
print(f'{(a - b).abs().max().item():.2e}')" 2>&1)
  note "logits $m + adapter, f32 on GPU vs HF: max abs diff $d"
done
"$BIN/hlo-train" train --plugin cuda --dtype f32 --checkpoint "$F/gqa_llama3" --init-adapter "$F/gqa_llama3/adapter" \
    --data "$OUT/rows.jsonl" --batch 2 --seq 9 --steps 1 --optimizer sgd --lr 0.05 --clip-norm 0 --out "$OUT/step" >/dev/null
d=$(python3 -c "
from safetensors.torch import load_file
ours = load_file('$OUT/step/adapter_model.safetensors'); want = load_file('$F/gqa_llama3/train_step.safetensors')
print(f'{max((ours[k] - want[\"sgd.\" + k]).abs().max().item() for k in ours):.2e}')" 2>&1)
note "one SGD step (f32) on GPU vs PyTorch+PEFT: max abs diff of the adapter $d"
}

step3() {
echo "== 3. train step: Llama 3.2 1B shapes, random bf16 weights, LoRA r=16 on all projections, AdamW"
python3 -c "
import json, random
random.seed(0)
with open('$OUT/ids.jsonl', 'w') as f:
    for _ in range(256):
        f.write(json.dumps({'input_ids': [random.randrange(128256) for _ in range(1024)]}) + '\n')"
for cfg in "8 1024"; do
  set -- $cfg
  "$BIN/hlo-train" train --plugin cuda --model llama3.2-1b --dtype bf16 --data "$OUT/ids.jsonl" --batch $1 --seq $2 \
      --steps $STEPS --lr 2e-4 --lora-rank 16 --lora-alpha 32 --log-every 4 --metrics "$OUT/1b.jsonl" 2>&1 | grep -v "^\s*$" | tail -5
  line=$(python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('$OUT/1b.jsonl')][2:]
t = statistics.median(r['step_time_s'] for r in rows)
print(f'batch $1 x seq $2: median step {t*1e3:.1f} ms, {$1*$2/t:.0f} tokens/s, MFU {statistics.median(r[\"mfu\"] for r in rows)*100:.1f}%')")
  note "hlo-train 1B LoRA $line"
done
}

step4() {
echo "== 4. the peer: PyTorch + PEFT, same shapes, bf16 base, f32 LoRA, AdamW, SDPA attention"
python3 bench/peft_lora_step.py 1b 8 1024 "$STEPS" | tee "$OUT/torch.txt"
while read -r l; do note "$l"; done <"$OUT/torch.txt"
}

step5() {
echo "== 5. hlo-train bench (weights made on the GPU): Llama 3.2 1B and Llama 3.1 8B, bf16, LoRA r=16"
for spec in "llama3.2-1b 8 1024" "llama3.1-8b 4 1024"; do
  set -- $spec
  if "$BIN/hlo-train" bench --plugin cuda --model "$1" --dtype bf16 --lora-rank 16 --lora-alpha 32 \
      --batch "$2" --seq "$3" --steps 10 --json >"$OUT/bench-$1.json"; then
    note "hlo-train bench $1 batch $2 x seq $3: $(python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); print("median step %.1f ms, %.0f tokens/s, MFU %.1f%%, compile %.1f s, peak %.1f GiB" % (v["step_time_s"] * 1e3, v["tokens_per_s"], v["mfu"] * 100, v["compile_s"], v["peak_bytes"] / 2**30))' "$OUT/bench-$1.json")"
  else
    note "hlo-train bench $1: FAILED"
  fi
done
}

step6() {
echo "== 6. the peer for 8B: PyTorch + PEFT, Llama 3.1 8B shapes, batch 4 x seq 1024"
python3 bench/peft_lora_step.py 8b 4 1024 "$STEPS" | tee "$OUT/torch8b.txt"
while read -r l; do note "$l"; done <"$OUT/torch8b.txt"
}

step7() {
echo "== 7. long context (issue 22): Llama 3.1 8B LoRA r=16, batch 1, blockwise attention and chunked loss (auto), against PyTorch+PEFT with SDPA (flash) attention"
for seq in ${LONG_SEQS:-4096 16384}; do
  if "$BIN/hlo-train" bench --plugin cuda --model llama3.1-8b --dtype bf16 --lora-rank 16 --lora-alpha 32 \
      --batch 1 --seq "$seq" --steps 10 --json >"$OUT/bench-8b-$seq.json"; then
    note "hlo-train bench llama3.1-8b batch 1 x seq $seq: $(python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); print("%s, median step %.1f ms, %.0f tokens/s, MFU %.1f%%, peak %.1f GiB" % (v["attention"], v["step_time_s"] * 1e3, v["tokens_per_s"], v["mfu"] * 100, v["peak_bytes"] / 2**30))' "$OUT/bench-8b-$seq.json")"
  else
    note "hlo-train bench llama3.1-8b seq $seq: FAILED"
  fi
  # The naive form where it still fits (NAIVE_SEQS), for the comparison.
  if [[ " ${NAIVE_SEQS:-4096} " != *" $seq "* ]]; then
    :
  elif "$BIN/hlo-train" bench --plugin cuda --model llama3.1-8b --dtype bf16 --lora-rank 16 --lora-alpha 32 \
      --batch 1 --seq "$seq" --steps 10 --attention naive --json >"$OUT/bench-8b-naive-$seq.json"; then
    note "  same, --attention naive: $(python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); print("median step %.1f ms, MFU %.1f%%, peak %.1f GiB" % (v["step_time_s"] * 1e3, v["mfu"] * 100, v["peak_bytes"] / 2**30))' "$OUT/bench-8b-naive-$seq.json")"
  else
    note "  same, --attention naive: FAILED (out of memory is expected at 16384)"
  fi
  python3 bench/peft_lora_step.py 8b 1 "$seq" "$STEPS" | tee "$OUT/torch8b-$seq.txt"
  while read -r l; do note "$l"; done <"$OUT/torch8b-$seq.txt"
done
# cuDNN fused attention (XLA's custom call) is not built yet: the CUDA
# plugin runs the blockwise form like every other plugin (docs/training.md, "Long
# sequences").
}

step8() {
echo "== 8. several processes (issue 24): two processes on this GPU meet through our key-value store; the CUDA plugin exchanges its topology over our callbacks"
# Both processes drive the one GPU (no LOCAL_RANK), so each should list 2
# global devices, 1 of them addressable. The plugin preallocates GPU memory
# per client, so the second client may run short: that shows in the line.
PORT=$((20000 + RANDOM % 20000))
for k in 0 1; do
  "$BIN/hlo-train" devices --plugin cuda --json --num-processes 2 --process-id $k \
    --coordinator 127.0.0.1:$PORT --init-timeout 120 >"$OUT/devices-p$k.json" 2>"$OUT/devices-p$k.err" &
done
wait
for k in 0 1; do
  if [ -s "$OUT/devices-p$k.json" ]; then
    note "process $k of 2 on one GPU: $(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print("process_index", d["process_index"], "of", d["num_processes"], "|", len(d["devices"]), "devices,", sum(x["addressable"] for x in d["devices"]), "addressable, ids", [x["id"] for x in d["devices"]])' "$OUT/devices-p$k.json")"
  else
    note "process $k of 2 on one GPU: FAILED: $(tail -c 300 "$OUT/devices-p$k.err")"
  fi
done
}

step10() {
echo "== 10. preference (issue 36): DPO on the GPU against TRL's fixture (f32), then a DPO and an ORPO step against an SFT step of the same tokens, and the PyTorch+PEFT DPO peer"
P=tests/fixtures/preference
"$BIN/hlo-train" train --plugin cuda --dtype f32 --objective dpo --checkpoint "$F/gqa_llama3" --data "$P/data_ids.jsonl" \
    --batch 4 --seq 16 --steps 1 --optimizer sgd --lr 0.1 --clip-norm 0 --init-adapter "$P/adapters/init" \
    --metrics "$OUT/dpo.jsonl" >/dev/null
note "DPO (f32) on GPU vs TRL: $(python3 -c '
import json, sys
got = json.loads(open(sys.argv[1]).readline()); want = json.load(open(sys.argv[2]))["dpo.init.sgd"]
keys = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
print("max abs diff over loss and rewards/logps %.2e" % max(abs(got[k] - (want["loss"] if k == "loss" else want["metrics"][k])) for k in keys))' "$OUT/dpo.jsonl" "$P/expected.json")"
for spec in "llama3.2-1b 8 1024 1b" "llama3.1-8b 4 1024 8b"; do
  set -- $spec
  for objective in ${PREFERENCE_OBJECTIVES:-sft dpo dpo-precomputed orpo}; do
    # The same rows a step: SFT's batch of rows is DPO's and ORPO's pairs' two sides.
    b=$2; [ $objective != sft ] && b=$(( $2 / 2 ))
    extra=(); [ $objective = dpo-precomputed ] && extra=(--precompute-ref)
    if "$BIN/hlo-train" bench --plugin cuda --model "$1" --dtype bf16 --lora-rank 16 --lora-alpha 32 \
        --objective ${objective%-precomputed} "${extra[@]}" --batch $b --seq "$3" --steps 10 --json >"$OUT/bench-$1-$objective.json"; then
      note "hlo-train bench $1 $objective ($2 rows x seq $3): $(python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); print("median step %.1f ms, %.0f tokens/s, MFU %.1f%%, compile %.1f s, peak %.1f GiB" % (v["step_time_s"] * 1e3, v["tokens_per_s"], v["mfu"] * 100, v["compile_s"], v["peak_bytes"] / 2**30))' "$OUT/bench-$1-$objective.json")"
    else
      note "hlo-train bench $1 $objective: FAILED"
    fi
  done
  [ -n "${NO_PEER:-}" ] && continue
  python3 bench/peft_lora_step.py "$4" "$2" "$3" "$STEPS" dpo | tee "$OUT/torch-dpo-$4.txt"
  while read -r l; do note "$l"; done <"$OUT/torch-dpo-$4.txt"
done
}

step11() {
echo "== 11. GRPO (issue 37): a TRL fixture case on the GPU (f32), then rollouts and steps of Llama 3.2 1B shapes (random bf16 weights)"
G=tests/fixtures/grpo
"$BIN/hlo-train" train --plugin cuda --dtype f32 --objective grpo --checkpoint "$F/gqa_llama3" \
    --tokenizer tests/fixtures/preference/tokenizer/tokenizer.json --rollouts "$G/rollouts.jsonl" \
    --batch 8 --num-generations 4 --seq 16 --steps 2 --num-iterations 2 --beta 0.04 --max-completion-length 6 \
    --optimizer sgd --lr 0.1 --clip-norm 0 --init-adapter "$G/adapters/init" --ref-adapter "$G/adapters/ref" \
    --metrics "$OUT/grpo-fixture.jsonl" >/dev/null
note "GRPO (f32) on GPU vs TRL (dapo.b0.04.mu2.ref): $(python3 -c '
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]; want = json.load(open(sys.argv[2]))["dapo.b0.04.mu2.ref"]["steps"]
keys = ["loss", "kl", "entropy", "clip_ratio/region_mean"]
print("max abs diff over both steps %.2e" % max(abs(g[k] - w["logged"][k]) for g, w in zip(got, want) for k in keys))' "$OUT/grpo-fixture.jsonl" "$G/expected.json")"
python3 - "$OUT/prompts-1b.jsonl" <<'PY'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"prompt_ids": [random.randrange(3, 128000) for _ in range(128)]}) + "\n")
PY
for len in ${GRPO_COMPLETIONS:-128 512}; do
  if "$BIN/hlo-train" train --plugin cuda --objective grpo --model llama3.2-1b --dtype bf16 --lora-rank 16 --lora-alpha 32 \
      --data "$OUT/prompts-1b.jsonl" --reward length --num-generations 8 --batch 64 --seq $((128 + len)) \
      --max-completion-length "$len" --steps 5 --log-every 5 --metrics "$OUT/grpo-1b-$len.jsonl" >"$OUT/grpo-1b-$len.log" 2>&1; then
    note "GRPO 1B, 8 prompts x 8 completions of $len tokens (prompts 128): $(python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]; later = rows[1:]
gen = sum(r["rollout/seconds"] for r in later); step = sum(r["step_time_s"] for r in later)
print("rollouts %.0f tokens/s (%.2f s a batch; first %.1f s with compiling), step %.0f ms (%.0f tokens/s), %.0f%% of the loop generating; loop %.1f s = rollouts + steps %.1f s" % (
    statistics.median(r["rollout/tokens_per_s"] for r in later), statistics.median(r["rollout/seconds"] for r in later),
    rows[0]["rollout/seconds"], 1e3 * statistics.median(r["step_time_s"] for r in later),
    statistics.median(r["tokens_per_s"] for r in later), 100 * gen / (gen + step),
    rows[-1]["elapsed_s"], sum(r["rollout/seconds"] + r["step_time_s"] for r in rows)))' "$OUT/grpo-1b-$len.jsonl")"
  else
    note "GRPO 1B ($len): FAILED: $(tail -c 300 "$OUT/grpo-1b-$len.log")"
  fi
done
}

healthy() {
  python3 -c 'import sys, urllib.request; urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2)' "$1" 2>/dev/null
}

step9() {
echo "== 9. serve: Llama 3.2 1B shapes (random bf16 weights), 32 slots, 8 rank-8 adapters; streamed greedy completions through the openai client"
# The openai client is not on such a machine: carry its wheels in .whl
# (the device tool's README says how) and install them into /tmp/site.
if ! python3 -c 'import openai' 2>/dev/null; then
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 bench/serve_load.py make-adapters --config bench/configs/llama-1b.json --count 8 --rank 8 \
    --targets q_proj,k_proj,v_proj,o_proj --out "$OUT/adapters" >/dev/null
local port=$((20000 + RANDOM % 20000)) adapters=() k
for k in 0 1 2 3 4 5 6 7; do adapters+=(--adapter "a$k=$OUT/adapters/a000$k"); done
"$BIN/hlo-train" serve --plugin cuda --model llama3.2-1b --dtype bf16 --served-model-name base \
    --max-batch-size 32 --max-model-len 512 --max-lora-rank 8 --max-loras 8 --port "$port" \
    "${adapters[@]}" >"$OUT/serve.log" 2>&1 &
local pid=$!
for k in $(seq 1 240); do
  healthy "$port" && break
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
if ! healthy "$port"; then
  note "serve 1B: FAILED to start: $(tail -c 300 "$OUT/serve.log")"
  return
fi
note "serve 1B: ready ${k} s after start (weights made on the host, programs compiled)"
for models in base a0 a0,a1,a2,a3,a4,a5,a6,a7; do
  python3 bench/serve_load.py run --url "http://127.0.0.1:$port" --models "$models" \
      --concurrency "${SERVE_CONCURRENCY:-1,16,32}" --requests 16 --prompt-len 32 --max-tokens 64 \
      --vocab 128000 >"$OUT/serve-$models.jsonl" 2>>"$OUT/serve.log"
  while read -r l; do
    note "serve 1B models=$models: $(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print("c=%s %.1f tok/s, %s errors, TTFT p50 %s ms, ITL p50/p99 %s/%s ms" % (r.get("concurrency"), r.get("output_tokens_per_s", 0), r.get("errors"), r.get("ttft_p50_ms"), r.get("itl_p50_ms"), r.get("itl_p99_ms")))' "$l")"
  done <"$OUT/serve-$models.jsonl"
done
kill -TERM $pid; wait $pid
note "serve 1B: SIGTERM exit code $?"
}

# STEPS_TO_RUN: which steps, in which order (GPU time is scarce: the most
# wanted first, so a run cut off at its limit loses the least).
for n in ${STEPS_TO_RUN:-1 2 3 4 5 6 7 8 9}; do
  "step$n"
done

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
