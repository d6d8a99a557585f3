#!/usr/bin/env bash
# hlo-train on an NVIDIA GPU machine, in one go (../shared/docs/gpu.md).
#
# Such a machine has python3 with JAX's CUDA PJRT plugin but no Rust, so build
# here first and carry the binaries along:
#   cargo build --release -p hlo-train -p hlo-runtime --examples --bins
#   mkdir -p .device/bin && cp target/release/hlo-train target/release/examples/plugin_bench .device/bin/
# then, on the GPU machine, from the repository root:
#   bash bench/gpu.sh
# It prints a short table last. Steps that need later issues say so.
set -uo pipefail
BIN=${BIN:-.device/bin}
OUT=${OUT:-/tmp/hlo-train-gpu}
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
summary=()

echo "== 1. devices"
if "$BIN/hlo-train" devices --plugin cuda --json >"$OUT/devices.json"; then
  cat "$OUT/devices.json"
  summary+=("devices: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["platform"], "API", d["api_version"], len(d["devices"]), "x", d["devices"][0]["kind"])' "$OUT/devices.json")")
else
  summary+=("devices: FAILED")
fi
"$BIN/hlo-train" devices --plugin cuda

echo "== how JAX's CUDA plugin package sets itself up (for runtime/discovery.rs)"
init=$(python3 -c 'import jax_plugins.xla_cuda13 as m; print(m.__file__)' 2>/dev/null)
[ -n "$init" ] && grep -nE "environ|XLA_FLAGS|cuda_data_dir|options|register_plugin" "$init" | head -30

echo "== 2. correctness: tiny fixture logits (needs the Llama issue), bf16 train step (needs the train issue): not yet"

echo "== runtime on CUDA: a chain of N x N matmuls + tanh, compiled and run by our PJRT bindings"
for cfg in "4096 8 f32" "8192 8 f32" "8192 8 bf16" "8192 32 bf16"; do
  line=$("$BIN/plugin_bench" cuda $cfg 2>&1 | tail -1)
  echo "$line"
  summary+=("hlo-runtime matmul chain $cfg: ${line##*: }")
done

echo "== reference: PyTorch on the same GPU, the same chain (bf16, f32 with TF32 off)"
python3 - <<'PY' | tee "$OUT/torch.txt"
import time, torch
def chain(n, layers, dtype):
    x = torch.randn(n, n, device="cuda", dtype=dtype) / n**0.5
    ws = [torch.randn(n, n, device="cuda", dtype=dtype) / n**0.5 for _ in range(layers)]
    def run():
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        return h
    for _ in range(3): run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); run(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); med = ts[len(ts)//2]
    print(f"torch {str(dtype).split('.')[-1]} n={n} layers={layers}: run {med:.4f}s = {2*n**3*layers/med/1e9:.1f} GFLOP/s")
torch.backends.cuda.matmul.allow_tf32 = False
chain(8192, 8, torch.float32)
chain(8192, 8, torch.bfloat16)
chain(8192, 32, torch.bfloat16)
PY
while read -r l; do summary+=("$l"); done <"$OUT/torch.txt"

echo "== 3-4. bench for llama3.2-1b / llama3.1-8b and the PyTorch+PEFT peer (need the bench issue): not yet"

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
