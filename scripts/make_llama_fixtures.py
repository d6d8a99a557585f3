#!/usr/bin/env python3
"""Build the Llama, PEFT and tokenizer fixtures the Rust tests compare with.

Run by hand (not by CI) where HF transformers, PEFT, tokenizers, safetensors
and PyTorch are installed; it needs no GPU and no network:

    python3 scripts/make_llama_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures. It writes:
  llama/<name>/config.json, model.safetensors      tiny random LlamaForCausalLM
  llama/<name>/adapter/adapter_config.json,
                     adapter_model.safetensors     a PEFT LoRA adapter, B != 0
  llama/<name>/expected.safetensors                input_ids, logits without
                                                   and with the adapter (f32)
  llama/<name>/train_step.safetensors              (first model only) one SGD
                                                   and one AdamW step of the
                                                   adapter on a next-token loss
  tokenizer/tokenizer.json, tokenizer/encodings.json
  llama/param_counts.json                          parameter counts of the
                                                   Llama 3.x presets (meta device)
Everything is seeded; the files are small enough to commit.
"""

import json
import os
import sys

import torch

from fixture_steps import adapter_fixture, finish, step, train_steps

torch.manual_seed(0)
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

MODELS = {
    # GQA 4:2, untied, llama3 rope scaling that reaches all three regimes.
    "gqa_llama3": dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=64, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # Plain multi-head attention, tied embeddings, default rope.
    "mha_tied": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
    ),
    # head_dim overridden (24, not hidden/heads = 16), GQA 2:1, three layers.
    "head_dim": dict(
        vocab_size=112, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
    ),
}

PRESETS = {
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "llama3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "llama3.1-405b": dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                          num_attention_heads=128, num_key_value_heads=8, tie_word_embeddings=False),
    # MPT's sizes as Llama configs (hlo-train's mpt-scale presets).
    "mpt-scale-1b": dict(vocab_size=50432, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=128, tie_word_embeddings=True),
    "mpt-scale-3b": dict(vocab_size=50432, hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                         num_attention_heads=20, num_key_value_heads=20, head_dim=128, tie_word_embeddings=True),
    "mpt-scale-7b": dict(vocab_size=50432, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128, tie_word_embeddings=True),
}

@step("models")
def build_models():
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig
    for i, (name, kw) in enumerate(MODELS.items()):
        torch.manual_seed(100 + i)
        d = os.path.join(OUT, "llama", name)
        os.makedirs(d, exist_ok=True)
        config = LlamaConfig(**kw, bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False,
                             hidden_act="silu", attn_implementation="eager")
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():  # larger than HF's 0.02 init, so layers matter
                p.normal_(0.0, 0.2)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(d, safe_serialization=True)
        ids = torch.randint(0, kw["vocab_size"], (2, 9))
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM", use_rslora=(name == "mha_tied"))
        peft_model = adapter_fixture(model, ids, 5, 32, lora, d)
        if i == 0:
            train_steps(peft_model, ids, d)


@step("tokenizer")
def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, processors
    d = os.path.join(OUT, "tokenizer")
    os.makedirs(d, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "reverse the string: hello -> olleh",
        "Llama 3.1 405B LoRA finetuning on eight MI300X",
        "def f(x): return x * 2  # ünïcödé ✓ 日本語",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(os.path.join(d, "tokenizer.json"))
    strings = ["the quick brown fox", "hello -> olleh", "ünïcödé ✓ 日本語 and emoji 🦙", "", "  spaces  and\ttabs\n"]
    enc = [{"text": s, "ids": tok.encode(s).ids, "ids_no_special": tok.encode(s, add_special_tokens=False).ids,
            "decoded": tok.decode(tok.encode(s).ids)} for s in strings]
    with open(os.path.join(d, "encodings.json"), "w") as f:
        json.dump(enc, f, indent=1, ensure_ascii=False)
    print("tokenizer: vocab", tok.get_vocab_size())


@step("param_counts")
def param_counts():
    from transformers import LlamaConfig, LlamaForCausalLM
    counts = {}
    for name, kw in PRESETS.items():
        with torch.device("meta"):
            m = LlamaForCausalLM(LlamaConfig(**kw))
        counts[name] = sum(p.numel() for p in m.parameters())
        print(name, counts[name])
    os.makedirs(os.path.join(OUT, "llama"), exist_ok=True)
    with open(os.path.join(OUT, "llama", "param_counts.json"), "w") as f:
        json.dump(counts, f, indent=1)


if __name__ == "__main__":
    import transformers, peft, tokenizers, safetensors
    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
          "tokenizers", tokenizers.__version__, "safetensors", safetensors.__version__)
    build_models()
    build_tokenizer()
    param_counts()
    finish()
