#!/usr/bin/env python3
"""Build the QLoRA (NF4) fixtures the Rust tests compare with.

Run by hand (not by CI) where PyTorch, HF transformers, PEFT, bitsandbytes
(>= 0.45, whose 4-bit code runs on the CPU) and safetensors are installed;
it needs no GPU and no network:

    python3 scripts/make_qlora_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures. It writes:
  qlora/llama/config.json, model.safetensors      tiny random LlamaForCausalLM,
                                                  the ORIGINAL f32 weights (every
                                                  projection's in_features a
                                                  multiple of 64)
  qlora/llama/adapter/adapter_config.json,
                  adapter_model.safetensors       a PEFT LoRA adapter on all seven
                                                  projections, B != 0
  qlora/llama/expected.safetensors                input_ids, logits and greedy
                                                  tokens without and with the
                                                  adapter, of the model whose
                                                  projections are the dequantized
                                                  ones (f32)
  qlora/llama/train_step.safetensors              one SGD and one AdamW step of
                                                  the adapter on that model
  qlora/llama/expected_double_quant.safetensors   logits with the projections
                                                  NF4 round-tripped with double
                                                  quantization (compress_statistics)
  qlora/llama/expected_bnb.safetensors            logits that transformers' own
                                                  4-bit model (bitsandbytes
                                                  Linear4bit, f32 compute, its
                                                  CPU bf16 kernel off) gives,
                                                  without (`logits`) and with
                                                  (`logits_double_quant`) double
                                                  quant
  qlora/llama_bnb4bit/config.json,
                      model.safetensors           the model quantized by
                                                  transformers + bitsandbytes
                                                  (nf4, uint8 storage) and saved
                                                  as HF writes it
  qlora/llama_bnb4bit_dq/...                      the same with double quant
Everything is seeded; the files are small enough to commit. The versions
used are in each safetensors file's metadata this script writes itself.
"""

import json
import os
import sys

import torch

from fixture_steps import adapter_fixture, contiguous, finish, step, train_steps

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")
Q = os.path.join(OUT, "qlora")
D = os.path.join(Q, "llama")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCKSIZE = 64

# Every projection's rows hold at least two blocks of 64, so the block
# scales split over a mesh axis of 2 as the weights do.
MODEL = dict(
    vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
)

state = {}


def versions():
    import bitsandbytes, peft, safetensors, transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__, "safetensors": safetensors.__version__}


def save(tensors, path, **meta):
    from safetensors.torch import save_file
    save_file(contiguous(tensors), path, metadata={"format": "pt", **versions(), **meta})


def stamp(path, **meta):
    """Rewrites a safetensors file written by fixture_steps with the versions in its metadata."""
    from safetensors.torch import load_file
    save(load_file(path), path, **meta)


def is_projection(name):
    return name.endswith(".weight") and any(f".{t}." in name for t in TARGETS)


def nf4_roundtrip(w, double_quant):
    import bitsandbytes.functional as F
    q, s = F.quantize_4bit(w.detach().float().contiguous(), blocksize=BLOCKSIZE,
                           compress_statistics=double_quant, quant_type="nf4")
    return F.dequantize_4bit(q, s).float()


def fresh_model(sd):
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(D)).eval()
    model.load_state_dict(sd)
    return model


def load_roundtripped(double_quant):
    """A model with the ORIGINAL weights but every projection NF4 round-tripped."""
    model = fresh_model(state["original"])
    deq = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_projection(n):
                assert p.shape[1] % BLOCKSIZE == 0, n
                deq[n] = nf4_roundtrip(p, double_quant)
                p.copy_(deq[n])
    assert len(deq) == 7 * MODEL["num_hidden_layers"], sorted(deq)
    return model, deq


@step("base")
def build_base():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(200)
    os.makedirs(D, exist_ok=True)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False,
                         hidden_act="silu", attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's 0.02 init, so layers matter
            # 0.2 at the Llama fixtures' width of 32, scaled by 1/sqrt(width)
            # so activations and logits keep their size at 128.
            p.normal_(0.0, 0.1)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(D, safe_serialization=True)
    state["original"] = contiguous(model.state_dict())
    state["ids"] = torch.randint(0, MODEL["vocab_size"], (2, 9))


@step("dequantized")
def build_dequantized():
    from peft import LoraConfig
    model, deq = load_roundtripped(double_quant=False)
    torch.manual_seed(201)  # the adapter's A and B (building the model above drew from the RNG)
    ids = state["ids"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")
    peft_model = adapter_fixture(model, ids, 5, 16, lora, D)
    train_steps(peft_model, ids, D)
    stamp(os.path.join(D, "expected.safetensors"), base="nf4 dequantized, blocksize 64, no double quant")
    stamp(os.path.join(D, "train_step.safetensors"), base="nf4 dequantized, blocksize 64, no double quant")
    from safetensors.torch import load_file
    state["logits"] = load_file(os.path.join(D, "expected.safetensors"))["logits"]
    diff = max((deq[n] - state["original"][n]).abs().max().item() for n in deq)
    print(f"  nf4 round trip moves projection weights by up to {diff:.4f}")


@step("double_quant")
def build_double_quant():
    model, deq = load_roundtripped(double_quant=True)
    with torch.no_grad():
        logits = model(input_ids=state["ids"]).logits.float()
    save({"input_ids": state["ids"].to(torch.int32), "logits": logits},
         os.path.join(D, "expected_double_quant.safetensors"), quant_type="nf4", blocksize=str(BLOCKSIZE),
         double_quant="true")
    state["logits_dq"] = logits
    if "logits" in state:
        print(f"  double quant changes logits by {(logits - state['logits']).abs().max():.5f}")


@step("bnb_checkpoints")
def build_bnb():
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    out = {"input_ids": state["ids"].to(torch.int32)}
    for dq, name, key in [(False, "llama_bnb4bit", "logits"), (True, "llama_bnb4bit_dq", "logits_double_quant")]:
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq,
                                bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
        model = AutoModelForCausalLM.from_pretrained(D, quantization_config=qc, device_map="cpu",
                                                     attn_implementation="eager").eval()
        d = os.path.join(Q, name)
        model.save_pretrained(d, safe_serialization=True)
        card = os.path.join(d, "README.md")
        if os.path.exists(card):
            os.remove(card)
        # On a CPU with AVX512-BF16, bitsandbytes' inference forward repacks the
        # weight and runs a bf16 kernel (~1e-2 off); turned off, it dequantizes
        # to the f32 compute dtype and multiplies, as on a GPU.
        n4 = 0
        for mod in model.modules():
            if isinstance(mod, bnb.nn.Linear4bit):
                mod.support_avx512bf16_for_cpu = False
                n4 += 1
        assert n4 == 7 * MODEL["num_hidden_layers"], n4
        with torch.no_grad():
            out[key] = model(input_ids=state["ids"]).logits.float()
        ref = state.get("logits_dq" if dq else "logits")
        if ref is not None:
            print(f"  {name}: bnb 4-bit logits vs dequantized-base logits: max |diff| "
                  f"{(out[key] - ref).abs().max():.3e}")
    save(out, os.path.join(D, "expected_bnb.safetensors"), quant_type="nf4", blocksize=str(BLOCKSIZE))


if __name__ == "__main__":
    print(json.dumps(versions()))
    build_base()
    build_dequantized()
    build_double_quant()
    build_bnb()
    finish()
