#!/usr/bin/env python3
"""Build the QLoRA (NF4) fixtures of the mixture-of-experts families whose
nn.Linears bitsandbytes quantizes beyond q/k/v/o/gate/up/down: Qwen2-MoE
(its one-row `shared_expert_gate`) and DeepSeek-V3 (latent attention's
q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj). The sibling of
make_qlora_fixtures.py.

Run by hand (not by CI) where PyTorch, HF transformers, PEFT, bitsandbytes
(>= 0.45, whose 4-bit code runs on the CPU) and safetensors are installed;
it needs no GPU and no network:

    python3 scripts/make_qlora_moe_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures. For each of qwen2_moe and deepseek_v3
it writes qlora/<name>/:
  config.json, model.safetensors   a tiny random model, the ORIGINAL f32
                                   weights (every quantized projection's
                                   in_features a multiple of 128: two
                                   blocks of 64 a row)
  adapter/                         a PEFT LoRA adapter (B != 0) on the
                                   attention (Qwen2-MoE: q/k/v/o and the
                                   shared expert's gate/up/down; DeepSeek-V3:
                                   the latent projections and o_proj)
  expected.safetensors,            logits and greedy tokens without and
  train_step.safetensors           with the adapter, and one SGD and one
                                   AdamW step of it, of the model whose
                                   quantized projections are what
                                   transformers + bitsandbytes hold (nf4,
                                   blocks of 64, no double quant),
                                   dequantized; the experts, routers and
                                   norms as they are (bitsandbytes leaves
                                   them)
  expected_bnb.safetensors         logits of transformers' own 4-bit model
                                   (Linear4bit, f32 compute, its CPU bf16
                                   kernel off), and the names of the
                                   modules it quantized
Seeded: a rerun writes identical files.
"""

import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch

from fixture_steps import adapter_fixture, contiguous, finish, step, train_steps

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")
Q = os.path.join(OUT, "qlora")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
              experts_implementation="eager", tie_word_embeddings=False, max_position_embeddings=64)
MODELS = {
    # Both layers sparse: 4 experts, 2 a token, a shared expert of 128
    # behind its gate.
    "qwen2_moe": ("Qwen2Moe", ATTN + ["gate_proj", "up_proj", "down_proj"], dict(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, norm_topk_prob=False, rope_theta=10000.0)),
    # Layer 0 dense, layer 1 sparse (4 experts in 2 groups, the best kept,
    # 2 a token, 2 shared experts of 64); latent attention with a query
    # bottleneck and latent of 128, heads of 32 + 32 (interleaved) and
    # values of 64.
    "deepseek_v3": ("DeepseekV3", MLA, dict(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=64, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_theta=10000.0)),
}


def versions():
    import bitsandbytes, peft, transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__}


def bnb_model(d):
    """transformers' own NF4 model of the folder: (model, {weight name:
    dequantized weight}) over every Linear4bit, its bf16 CPU kernel off."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                            bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
    model = AutoModelForCausalLM.from_pretrained(d, quantization_config=qc, device_map="cpu",
                                                 attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    deq = {}
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False
            deq[name + ".weight"] = F.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float()
    return model, deq


def build(i, name, family, targets, kw):
    import transformers
    from peft import LoraConfig
    from safetensors.torch import save_file
    d = os.path.join(Q, name)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(900 + i)
    config = getattr(transformers, f"{family}Config")(**kw, **COMMON)
    model_class = getattr(transformers, f"{family}ForCausalLM")
    model = model_class(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:  # 0.1 at a width of 128, as the Llama QLoRA fixture
                p.normal_(0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    model.save_pretrained(d, safe_serialization=True)
    ids = torch.randint(0, kw["vocab_size"], (2, 9))
    quantized, deq = bnb_model(d)
    print(f"{name}: bitsandbytes quantized", sorted({n.split('.')[-2] for n in deq}))
    with torch.no_grad():
        bnb_logits = quantized(input_ids=ids).logits.float()
    # The f32 model whose quantized projections are bitsandbytes' values.
    plain = model_class.from_pretrained(d, attn_implementation="eager", experts_implementation="eager").eval()
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for n, w in deq.items():
            assert params[n].shape[1] % 128 == 0, n
            params[n].copy_(w)
        diff = float((plain(input_ids=ids).logits - bnb_logits).abs().max())
    print(f"  bnb's 4-bit logits vs the dequantized model's: {diff:.3e}")
    save_file(contiguous({"input_ids": ids.to(torch.int32), "logits": bnb_logits}),
              os.path.join(d, "expected_bnb.safetensors"),
              metadata={"format": "pt", "quantized": ",".join(sorted(deq)), **versions()})
    torch.manual_seed(950 + i)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")
    peft_model = adapter_fixture(plain, ids, 5, 16, lora, d)
    train_steps(peft_model, ids, d)


@step("models")
def build_models():
    for i, (name, (family, targets, kw)) in enumerate(MODELS.items()):
        build(i, name, family, targets, kw)


if __name__ == "__main__":
    print(versions())
    build_models()
    finish()
