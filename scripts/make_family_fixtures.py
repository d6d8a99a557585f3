#!/usr/bin/env python3
"""Build the Qwen2, Qwen3, Mistral and Gemma 3 fixtures the Rust tests
compare with (the sibling of make_llama_fixtures.py).

Run by hand (not by CI) where HF transformers, PEFT, tokenizers, safetensors
and PyTorch are installed; it needs no GPU and no network:

    python3 scripts/make_family_fixtures.py [FIXTURES_DIR]

FIXTURES_DIR defaults to tests/fixtures. It writes, for each family:
  families/<name>/config.json, model.safetensors, generation_config.json
                                   a tiny random model of odd sizes, every
                                   weight non-trivial (biases, norms, q/k
                                   norms), sliding windows shorter than the
                                   prompts
  families/<name>/adapter/         a PEFT LoRA adapter on all projections, B != 0
  families/<name>/expected.safetensors
                                   input_ids [4, 11], logits without and with
                                   the adapter (f32), greedy tokens (HF
                                   generate, KV cache) from a 7-token prompt
  families/<name>/train_step.safetensors
                                   one SGD and one AdamW step of the adapter
                                   (PyTorch + PEFT) on the four rows
  families/param_counts.json       parameter counts of the presets' Hub
                                   configs (transformers, meta device)
  families/config_cases.json       config.json variants (absent fields,
                                   older spellings) as transformers
                                   resolves them
  chat/families.json               the chat templates in chat/<model>/
                                   (copied from the models' Hub repos)
                                   rendered by transformers'
                                   apply_chat_template on fixture
                                   conversations
Everything is seeded; the files are small enough to commit.
"""

import json
import os
import sys

import torch

from fixture_steps import adapter_fixture, finish, step, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")

# Sizes are odd (not powers of two, head_dim apart from hidden/heads) but
# even where a 2x2x2 mesh splits them.
MODELS = {
    # Qwen2.5 shape: q/k/v biases, theta 1e6, tied; Qwen2's own sliding
    # window switched on from layer 1 (max_window_layers), window 4.
    "qwen2": ("Qwen2", dict(
        vocab_size=136, hidden_size=48, intermediate_size=88, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=64, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=4, max_window_layers=1,
    )),
    # Qwen3: q/k norms, head_dim 12 (hidden/heads would be 10), untied.
    "qwen3": ("Qwen3", dict(
        vocab_size=120, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=64, tie_word_embeddings=False,
        attention_bias=False,
    )),
    # Mistral: every layer sliding, window 5.
    "mistral": ("Mistral", dict(
        vocab_size=104, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=64, tie_word_embeddings=False, sliding_window=5,
    )),
    # Gemma 3 text: local/global layers (own rope bases, window 4), linear
    # rope scaling on the global ones, q/k norms, head_dim 16 (not 12),
    # query_pre_attn_scalar 20, the final logits soft-capped, tied. The
    # attention cap is set too: transformers' Gemma 3 keeps it in its
    # config but never applies it, and the test shows we do the same.
    "gemma3": ("Gemma3", dict(
        vocab_size=144, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
        query_pre_attn_scalar=20, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
        hidden_activation="gelu_pytorch_tanh",
    )),
}

# The presets' architectures as their Hub config.json files give them
# (base models): Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-7B, Qwen/Qwen3-0.6B,
# Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.3, google/gemma-3-270m,
# google/gemma-3-1b-pt.
PRESETS = {
    "qwen2.5-0.5b": ("Qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2.5-7b": ("Qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen3-0.6b": ("Qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "qwen3-8b": ("Qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "mistral-7b": ("Mistral", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                  sliding_window=None)),
    "gemma3-270m": ("Gemma3", dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)),
    "gemma3-1b": ("Gemma3", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)),
}


def classes(family):
    import transformers
    config = "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config"
    return getattr(transformers, config), getattr(transformers, f"{family}ForCausalLM")


@step("models")
def build_models():
    from peft import LoraConfig
    for i, (name, (family, kw)) in enumerate(MODELS.items()):
        torch.manual_seed(200 + i)
        d = os.path.join(OUT, "families", name)
        os.makedirs(d, exist_ok=True)
        config_class, model_class = classes(family)
        config = config_class(**kw, **COMMON)
        model = model_class(config).eval()
        gemma = family == "Gemma3"
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    # Gemma's norms scale by 1 + w: the same 0.5..1.5 span.
                    p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)
                else:  # kernels, embeddings and biases; larger than HF's init
                    p.normal_(0.0, 0.2)
        model.save_pretrained(d, safe_serialization=True)
        ids = torch.randint(0, kw["vocab_size"], (4, 11))
        # Greedy decoding runs beyond every window.
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM", use_rslora=(name == "qwen3"))
        peft_model = adapter_fixture(model, ids, 7, 24, lora, d)
        train_steps(peft_model, ids, d)


@step("param_counts")
def param_counts():
    counts = {}
    for name, (family, kw) in PRESETS.items():
        config_class, model_class = classes(family)
        with torch.device("meta"):
            m = model_class(config_class(**kw))
        counts[name] = sum(p.numel() for p in m.parameters())
        print(name, counts[name])
    os.makedirs(os.path.join(OUT, "families"), exist_ok=True)
    with open(os.path.join(OUT, "families", "param_counts.json"), "w") as f:
        json.dump(counts, f, indent=1)


# config.json variants (absent fields, older spellings) and how
# transformers resolves them: what hlo-train must read the same way.
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=32)
CONFIG_CASES = [
    ("mistral, no sliding_window key", "mistral", dict(SMALL)),
    ("mistral, sliding_window null", "mistral", dict(SMALL, sliding_window=None)),
    ("mistral v0.1 style", "mistral", dict(SMALL, num_key_value_heads=2, sliding_window=4096, rope_theta=1e4)),
    ("qwen2, window off", "qwen2", dict(SMALL, use_sliding_window=False, sliding_window=32768, max_window_layers=2)),
    ("qwen2, window on", "qwen2", dict(SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    ("qwen2, window on, no max_window_layers", "qwen2", dict(SMALL, use_sliding_window=True, sliding_window=16)),
    ("qwen3, no head_dim", "qwen3", dict(SMALL)),
    ("qwen3, rope_scaling linear", "qwen3", dict(SMALL, head_dim=8, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ("gemma3, hub spelling", "gemma3_text", dict(SMALL, head_dim=8, num_key_value_heads=2, rope_theta=1000000,
                                                  rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
                                                  sliding_window_pattern=6, query_pre_attn_scalar=8)),
    ("gemma3, pattern 2, linear rope", "gemma3_text", dict(SMALL, head_dim=8, sliding_window_pattern=2,
                                                            rope_scaling={"rope_type": "linear", "factor": 8.0})),
    ("gemma3, defaults", "gemma3_text", dict(SMALL)),
]


@step("config_cases")
def config_cases():
    from transformers import AutoConfig
    out = []
    for name, model_type, fields in CONFIG_CASES:
        c = AutoConfig.for_model(model_type, **fields)
        layer_types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        rope = c.rope_parameters
        by_type = rope if "full_attention" in rope else {t: rope for t in set(layer_types)}
        ropes = {t: {"rope_theta": float(p["rope_theta"]), "rope_type": p["rope_type"], "factor": p.get("factor")}
                 for t, p in by_type.items()}
        window = getattr(c, "sliding_window", None)
        if model_type == "mistral":  # no layer_types: every layer sliding when there is a window
            layer_types = ["sliding_attention" if window else "full_attention"] * c.num_hidden_layers
        out.append({"name": name, "config": dict(fields, model_type=model_type), "resolved": {
            "layer_types": layer_types, "sliding_window": window if "sliding_attention" in layer_types else None,
            "head_dim": head_dim, "num_key_value_heads": c.num_key_value_heads,
            "tie_word_embeddings": c.tie_word_embeddings, "rope": ropes,
            "query_pre_attn_scalar": getattr(c, "query_pre_attn_scalar", None)}})
    with open(os.path.join(OUT, "families", "config_cases.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("config cases:", len(out))


# The chat templates of chat/<model>/ (chat_template.jinja and the special
# tokens of tokenizer_config.json) and the conversations they render.
CHAT_MODELS = ["qwen2.5", "qwen3", "gemma3", "mistral-v0.3"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": " hi "},
     {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "multi\nline"}, {"role": "assistant", "content": "ok"}],
]


@step("chat")
def chat_templates():
    from transformers import PreTrainedTokenizerFast
    cases = []
    for name in CHAT_MODELS:
        d = os.path.join(OUT, "chat", name)
        config = json.load(open(os.path.join(d, "tokenizer_config.json")))
        template = open(os.path.join(d, "chat_template.jinja")).read()
        special = {k: config[k] for k in ["bos_token", "eos_token"] if config.get(k)}
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(OUT, "tokenizer", "tokenizer.json"), **special)
        tok.chat_template = template
        for messages in CONVERSATIONS:
            for gen in (True, False):
                case = {"template": name, "messages": messages, "add_generation_prompt": gen}
                try:
                    case["text"] = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                except Exception as e:  # a template that refuses the conversation
                    case["error"] = str(e)
                cases.append(case)
    with open(os.path.join(OUT, "chat", "families.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("chat:", len(cases), "renderings")


if __name__ == "__main__":
    import peft
    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
    build_models()
    param_counts()
    config_cases()
    chat_templates()
    finish()
