#!/bin/sh
# A mixture-of-experts LoRA step against a dense model of the same active
# parameters, on the CPU, back to back (BENCHMARKS.md, "Mixtures of
# experts"): bench/configs/small-qwen3-moe.json (Qwen3-MoE, 4 layers,
# 32 experts of width 128, 4 a token) and bench/configs/small-qwen3-active.json
# (dense Qwen3 with an MLP of width 512 = 4 × 128: the same parameters per
# token but the router's), LoRA r=8 on every projection the model has,
# f32, 8 rows of 128 tokens; ROUNDS alternating runs of STEPS timed steps
# each, every run's tokens/s printed; then the layer's formulations
# (tests/examples/moe_formulations.rs).
#
# BIN=target/release/hlo-train sh bench/moe.sh
set -eu
BIN=${BIN:-target/release/hlo-train}
ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-10}
for round in $(seq "$ROUNDS"); do
  for model in small-qwen3-moe small-qwen3-active; do
    "$BIN" bench --config "bench/configs/$model.json" --batch 8 --seq 128 \
      --steps "$STEPS" --dtype f32 --json 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(sys.argv[1], sys.argv[2], round(d["tokens_per_s"]), round(d["step_time_s"]*1e3), "ms", d["peak_bytes"], "bytes")' "$round" "$model"
  done
done
cargo run --release --locked -p hlo-e2e --example moe_formulations 512
cargo run --release --locked -p hlo-e2e --example moe_formulations 2048
