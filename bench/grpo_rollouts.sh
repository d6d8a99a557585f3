#!/bin/sh
# GRPO's rollouts against `serve` at the same concurrency, on the CPU, back
# to back (BENCHMARKS.md, "GRPO"). One random-weight model
# (bench/configs/small.json unless CONFIG), one random LoRA adapter (r=8 on
# every projection, the default of `train`), 8 prompts of 32 token ids and
# 8 completions of each (64 rows) of 32 tokens:
#
#  1. `train --objective grpo` for STEPS steps (rewarded by length: random
#     weights rarely say EOS, so every completion runs to 32 tokens): the
#     generation's tokens/s as the run reports it (`rollout/tokens_per_s`,
#     median over steps 2.., the first compiling the generation programs)
#     and the share of the loop's time spent generating (`rollout/seconds`)
#     against training (`step_time_s`);
#  2. `serve` with the same adapter, 64 streamed requests at once of
#     32-token prompts and 32 tokens (`bench/serve_load.py run`, the
#     official openai client from .plugins/python): its output tokens/s,
#     with serve's defaults and with caches and step budget sized as the
#     rollouts'.
#
# BIN=target/release/hlo-train OUT=/tmp/grpo-bench sh bench/grpo_rollouts.sh
set -eu
BIN=${BIN:-target/release/hlo-train}
CONFIG=${CONFIG:-bench/configs/small.json}
OUT=${OUT:-/tmp/grpo-bench}
STEPS=${STEPS:-8}
PORT=${PORT:-8937}
TARGETS=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
mkdir -p "$OUT"
python3 bench/serve_load.py make-adapters --config "$CONFIG" --count 1 --rank 8 \
  --targets "$TARGETS" --out "$OUT/adapters" >/dev/null
VOCAB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$CONFIG")
python3 - "$OUT/prompts.jsonl" "$VOCAB" <<'PY'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"prompt_ids": [random.randrange(3, int(sys.argv[2])) for _ in range(32)]}) + "\n")
PY
rm -rf "$OUT/grpo" "$OUT/grpo.jsonl"
"$BIN" train --objective grpo --config "$CONFIG" --init-adapter "$OUT/adapters/a0000" \
  --data "$OUT/prompts.jsonl" --reward length --num-generations 8 --batch 64 --seq 64 \
  --max-completion-length 32 --steps "$STEPS" --log-every "$STEPS" \
  --out "$OUT/grpo" --metrics "$OUT/grpo.jsonl" > "$OUT/grpo.log" 2>&1
python3 - "$OUT/grpo.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
later = rows[1:]
gen = sum(r["rollout/seconds"] for r in later)
step = sum(r["step_time_s"] for r in later)
print(json.dumps({
    "grpo_rollout_tokens_per_s_median": round(statistics.median(r["rollout/tokens_per_s"] for r in later)),
    "grpo_rollout_s_median": round(statistics.median(r["rollout/seconds"] for r in later), 3),
    "grpo_step_s_median": round(statistics.median(r["step_time_s"] for r in later), 3),
    "grpo_generating_share": round(gen / (gen + step), 3),
    "first_rollout_s (compiles)": round(rows[0]["rollout/seconds"], 2),
    # The figures against the wall clock: the loop's elapsed time at the
    # last step and the sum of every rollout's and every step's time.
    "loop_wall_s": round(rows[-1]["elapsed_s"], 2),
    "sum_rollout_and_step_s": round(sum(r["rollout/seconds"] + r["step_time_s"] for r in rows), 2),
}))
PY
# serve twice: with its defaults (each slot's cache as long as the
# model's positions, 2048; a 128-token step budget), then sized as the
# rollouts are (128-token caches, as the generator's bucket for 32 + 32
# tokens; every prompt of a wave prefilled in one step).
for FLAGS in "" "--max-model-len 128 --max-num-batched-tokens 2048"; do
  # shellcheck disable=SC2086
  "$BIN" serve --config "$CONFIG" --adapter "a0=$OUT/adapters/a0000" --max-batch-size 64 \
    --max-lora-rank 8 --port "$PORT" $FLAGS > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do
    if python3 -c 'import sys, urllib.request; urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2)' "$PORT" 2>/dev/null; then
      break
    fi
    sleep 1
  done
  echo "serve $FLAGS"
  PYTHONPATH=${PYTHONPATH:-.plugins/python} python3 bench/serve_load.py run \
    --url "http://127.0.0.1:$PORT" --models a0 --concurrency 64 --requests 128 \
    --prompt-len 32 --max-tokens 32 --vocab "$VOCAB"
  kill $SERVER
  wait $SERVER 2>/dev/null || true
done
