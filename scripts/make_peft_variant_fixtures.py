#!/usr/bin/env python3
"""Build PEFT adapter variants of the gqa_llama3 fixture for the Rust tests.

Run by hand (not by CI) where HF transformers, PEFT, safetensors and PyTorch
are installed (made with torch 2.9.1, transformers 5.17.0, peft 0.21.0,
safetensors 0.8.0); it needs no GPU and no network:

    python3 scripts/make_peft_variant_fixtures.py [MODEL_DIR]
    python3 scripts/make_peft_variant_fixtures.py --probe-config   # prints only

MODEL_DIR defaults to tests/fixtures/llama/gqa_llama3 (made by
make_llama_fixtures.py). The base model and the `input_ids` of its
expected.safetensors are read, never written. Each folder below is what
PEFT's save_pretrained writes (adapter_config.json, adapter_model.safetensors)
plus an expected.safetensors (f32 unless said):

  variant_patterns/      r=4, alpha=8, all seven projections,
                         rank_pattern {q_proj: 8, down_proj: 2},
                         alpha_pattern {v_proj: 32, down_proj: 3};
                         expected: logits_adapter, merged_logits, sgd.loss and
                         sgd.<saved key> for every trainable tensor after one
                         SGD step (lr 0.05, HF causal-LM loss, labels=input_ids)
  variant_lm_head/       r=4, alpha=8, modules_to_save=["lm_head"], the trained
                         lm_head copy perturbed; expected as for variant_patterns
  variant_embed/         same with modules_to_save=["embed_tokens"];
                         expected: logits_adapter, merged_logits
  variant_unsupported/<k>/  adapters the Rust loader refuses, k one of
                         lora_bias, trainable_token_indices, layer_replication,
                         layers_to_transform (r=4, alpha=8, q_proj and v_proj);
                         layers_to_transform/expected.safetensors: logits_adapter

LoRA A/B (and every other adapter tensor) are drawn from normal(0, 0.1), so
B != 0; a modules_to_save copy gets normal(0, 0.2) added. `merged_logits` are
the logits of merge_and_unload() of the adapter reloaded from its folder onto
a fresh copy of the base model. Everything is seeded (the script re-runs
itself with PYTHONHASHSEED=0, so adapter_config.json is byte-stable too);
base_model_name_or_path is left null and save_pretrained's boilerplate
README.md model card is removed, as in make_llama_fixtures.py's adapter.
The files are small (tens of KB a folder).

How transformers 5.17.0 reads config.json edge cases of LlamaForCausalLM
(observed with --probe-config; see RotaryEmbeddingConfigMixin.
convert_rope_params_to_dict; the Rust loader mimics or refuses these):
  * rope_parameters AND a non-null legacy rope_scaling: rope_scaling replaces
    rope_parameters WHOLE, silently (`rope_scaling or rope_parameters`).
    Nothing of rope_parameters survives, not even its rope_theta: the theta
    is rope_scaling's own rope_theta, else the top-level rope_theta, else
    10000. So {default, theta 5e5} + rope_scaling {llama3, no theta} gives
    llama3 with theta 1e4; {llama3, theta 5e5} + rope_scaling {"rope_type":
    "default"} gives plain rope with theta 1e4 (llama3 keys dropped).
    rope_scaling null keeps rope_parameters. config.rope_scaling is only an
    alias of config.rope_parameters; config has no rope_theta attribute.
  * top-level rope_theta 500000 vs rope_parameters.rope_theta 10000: 10000
    (setdefault: the top-level value only fills a missing rope_theta); no
    warning.
  * tie_word_embeddings true with a checkpoint holding an lm_head.weight
    different from model.embed_tokens.weight: NOT tied; the logits use the
    stored lm_head.weight (x . lm_head^T exactly) and transformers logs a
    WARNING ("... both are present in the checkpoints with different values,
    so we will NOT tie them ..."); config.tie_word_embeddings stays true.
    Without lm_head.weight in the file the head is tied to embed_tokens.
  * generation_config.json eos_token_id [2, 5] while config.json says 2:
    model.config.eos_token_id is 2, model.generation_config.eos_token_id is
    [2, 5], and greedy generate() stops right after emitting 5.
"""

import json
import os
import sys
import tempfile
import traceback

# PEFT writes target_modules from a Python set: fix the hash seed so that
# adapter_config.json comes out byte-identical on every run.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch
from safetensors.torch import load_file, save_file

from fixture_steps import contiguous, failures, finish, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
MODEL_DIR = ARGS[0] if ARGS else os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model():
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager", dtype=torch.float32).eval()


def input_ids():
    return load_file(os.path.join(MODEL_DIR, "expected.safetensors"))["input_ids"].long()


def make_adapter(lora, seed):
    """A PEFT model on a fresh base, every adapter tensor random (seeded)."""
    from peft import get_peft_model
    torch.manual_seed(seed)
    model = base_model()
    # Else adapter_config.json would record this machine's absolute path as
    # base_model_name_or_path; null, as in the adapter of make_llama_fixtures.py.
    model.name_or_path = None
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n or "trainable_tokens_" in n:
                p.normal_(0.0, 0.1)
            elif "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return peft_model.eval()


def save_adapter(peft_model, d):
    """save_pretrained, less the boilerplate model card (README.md) it adds,
    which holds this machine's path; the adapter of make_llama_fixtures.py
    has none either."""
    peft_model.save_pretrained(d)
    card = os.path.join(d, "README.md")
    if os.path.exists(card):
        os.remove(card)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def merged_logits(adapter_dir, ids, adapter_logits):
    from peft import PeftModel
    reloaded = PeftModel.from_pretrained(base_model(), adapter_dir).eval()
    again = logits_of(reloaded, ids)
    assert torch.allclose(again, adapter_logits, atol=1e-6), "reloaded adapter differs"
    merged = reloaded.merge_and_unload().eval()
    out = logits_of(merged, ids)
    print(f"  merged vs adapter max diff {(out - adapter_logits).abs().max():.2e}")
    return out


def sgd_step(peft_model, ids):
    """One SGD step (lr 0.05) on HF's causal-LM loss, keyed as save_pretrained writes."""
    from peft import get_peft_model_state_dict
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.05)
    peft_model.train()
    opt.zero_grad()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    peft_model.eval()
    saved = get_peft_model_state_dict(peft_model)
    assert len(saved) == len(trainable), (sorted(saved), len(trainable))
    out = {"sgd.loss": loss.detach().reshape(())}
    out.update({f"sgd.{k}": v for k, v in saved.items()})
    print(f"  sgd loss {loss.item():.6f}, {len(saved)} trainable tensors")
    return out


def write_variant(name, lora, seed, sgd):
    ids = input_ids()
    d = os.path.join(MODEL_DIR, name)
    peft_model = make_adapter(lora, seed)
    save_adapter(peft_model, d)
    out = {"logits_adapter": logits_of(peft_model, ids)}
    base = logits_of(base_model(), ids)
    print(f"{name}: adapter changes logits by {(out['logits_adapter'] - base).abs().max():.3f}")
    out["merged_logits"] = merged_logits(d, ids, out["logits_adapter"])
    if sgd:
        out.update(sgd_step(peft_model, ids))
    save_file(contiguous(out), os.path.join(d, "expected.safetensors"))
    keys = load_file(os.path.join(d, "adapter_model.safetensors")).keys()
    print("  saved keys not lora_A/lora_B:", sorted(k for k in keys if "lora_" not in k))


def lora_config(**kw):
    from peft import LoraConfig
    base = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    base.update(kw)
    return LoraConfig(**base)


@step("check_base")
def check_base():
    """The base model as loaded reproduces the fixture's own logits."""
    want = load_file(os.path.join(MODEL_DIR, "expected.safetensors"))["logits"]
    got = logits_of(base_model(), input_ids())
    print(f"base logits vs expected.safetensors: max diff {(got - want).abs().max():.2e}")
    assert torch.allclose(got, want, atol=1e-5)


@step("variant_patterns")
def variant_patterns():
    write_variant("variant_patterns", lora_config(rank_pattern={"q_proj": 8, "down_proj": 2},
                                                  alpha_pattern={"v_proj": 32, "down_proj": 3}), 200, sgd=True)


@step("variant_lm_head")
def variant_lm_head():
    write_variant("variant_lm_head", lora_config(modules_to_save=["lm_head"]), 201, sgd=True)


@step("variant_embed")
def variant_embed():
    write_variant("variant_embed", lora_config(modules_to_save=["embed_tokens"]), 202, sgd=False)


UNSUPPORTED = {
    "lora_bias": dict(lora_bias=True),
    "trainable_token_indices": dict(trainable_token_indices=[3, 5]),
    # Layers [0, 2) then [1, 2): the base becomes layers 0, 1, 1 (shared weights).
    "layer_replication": dict(layer_replication=[[0, 2], [1, 2]]),
    "layers_to_transform": dict(layers_to_transform=[1]),
}


@step("variant_unsupported")
def variant_unsupported():
    ids = input_ids()
    for i, (name, kw) in enumerate(UNSUPPORTED.items()):
        try:
            d = os.path.join(MODEL_DIR, "variant_unsupported", name)
            peft_model = make_adapter(lora_config(target_modules=["q_proj", "v_proj"], **kw), 300 + i)
            save_adapter(peft_model, d)
            keys = sorted(load_file(os.path.join(d, "adapter_model.safetensors")).keys())
            print(f"variant_unsupported/{name}: {len(keys)} tensors, e.g. {keys[:2]}")
            if name == "layers_to_transform":
                save_file({"logits_adapter": logits_of(peft_model, ids)}, os.path.join(d, "expected.safetensors"))
        except Exception:
            failures.append(f"variant_unsupported/{name}")
            traceback.print_exc()


# ---------------------------------------------------------------------------
# --probe-config: how transformers reads contradictory config.json files.
# Writes only to a temporary folder and prints what it sees.

PROBE_BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def rope_inv_freq(theta, dim=8, llama3=None):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if llama3:
        import math
        lo = llama3["original_max_position_embeddings"] / llama3["low_freq_factor"]
        hi = llama3["original_max_position_embeddings"] / llama3["high_freq_factor"]
        out = []
        for f in inv.tolist():
            wl = 2 * math.pi / f
            if wl < hi:
                out.append(f)
            elif wl > lo:
                out.append(f / llama3["factor"])
            else:
                s = (llama3["original_max_position_embeddings"] / wl - llama3["low_freq_factor"]) / (
                    llama3["high_freq_factor"] - llama3["low_freq_factor"])
                out.append((1 - s) * f / llama3["factor"] + s * f)
        inv = torch.tensor(out, dtype=torch.float64)
    return inv.float()


def probe_rope(tmp, label, extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = os.path.join(tmp, label)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**PROBE_BASE, **extra}, f)
    cfg = LlamaConfig.from_pretrained(d)
    print(f"\n[{label}] config.json extra: {json.dumps(extra)}")
    print("  rope_parameters:", getattr(cfg, "rope_parameters", "<none>"))
    print("  rope_scaling:", getattr(cfg, "rope_scaling", "<none>"), " rope_theta attr:",
          getattr(cfg, "rope_theta", "<none>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    inv = model.model.rotary_emb.inv_freq.float()
    print("  inv_freq:", [f"{x:.6g}" for x in inv.tolist()], " rope_type:", model.model.rotary_emb.rope_type,
          " attention_scaling:", model.model.rotary_emb.attention_scaling)
    for name, ref in [("default 1e4", rope_inv_freq(1e4)), ("default 5e5", rope_inv_freq(5e5)),
                      ("llama3 1e4", rope_inv_freq(1e4, llama3=LLAMA3)),
                      ("llama3 5e5", rope_inv_freq(5e5, llama3=LLAMA3))]:
        if torch.allclose(inv, ref, rtol=1e-5, atol=0):
            print("  inv_freq equals", name)


def probe_tied(tmp):
    import logging
    from safetensors.torch import safe_open
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    d = os.path.join(tmp, "tied_with_head")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = True
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = load_file(os.path.join(MODEL_DIR, "model.safetensors"))
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    records = []

    class Keep(logging.Handler):
        def emit(self, r):
            records.append(f"{r.levelname}: {r.getMessage()}")
    h = Keep()
    hf_logging.get_logger().addHandler(h)
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    hf_logging.get_logger().removeHandler(h)
    print("\n[tied_with_head] tie_word_embeddings true, lm_head.weight != embed_tokens.weight in file")
    print("  log records:", records or "none")
    print("  python warnings:", [str(x.message) for x in w] or "none")
    ids = input_ids()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    x = out.hidden_states[-1]  # after the final norm
    by_embed = x @ sd["model.embed_tokens.weight"].T
    by_head = x @ sd["lm_head.weight"].T
    print(f"  max|logits - x.embed^T| {(out.logits - by_embed).abs().max():.3e}  "
          f"max|logits - x.lm_head^T| {(out.logits - by_head).abs().max():.3e}")
    print("  model.lm_head.weight is embed_tokens.weight:",
          model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    print("  config.tie_word_embeddings after load:", model.config.tie_word_embeddings)
    # Same config, lm_head.weight absent from the file: the usual tied checkpoint.
    del sd["lm_head.weight"]
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    model = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    x = out.hidden_states[-1]
    print(f"  without lm_head.weight in the file: max|logits - x.embed^T| "
          f"{(out.logits - x @ sd['model.embed_tokens.weight'].T).abs().max():.3e}, tied:",
          model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())


def probe_eos(tmp):
    import shutil
    from transformers import LlamaForCausalLM
    d = os.path.join(tmp, "eos_list")
    shutil.copytree(MODEL_DIR, d, ignore=lambda *_: [n for n in os.listdir(MODEL_DIR) if n.startswith("variant_")
                                                    or n in ("adapter",)])
    with open(os.path.join(d, "generation_config.json")) as f:
        g = json.load(f)
    g["eos_token_id"] = [2, 5]
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(g, f)
    model = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    print("\n[eos_list] generation_config eos [2, 5], config.json eos 2")
    print("  model.config.eos_token_id:", model.config.eos_token_id,
          " model.generation_config.eos_token_id:", model.generation_config.eos_token_id)
    # Find a prompt whose greedy continuation reaches 5 before 2 (without any stop token).
    free = LlamaForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager", dtype=torch.float32).eval()
    free.generation_config.eos_token_id = None
    free.generation_config.pad_token_id = 0
    torch.manual_seed(1)
    for _ in range(2000):
        prompt = torch.randint(6, 128, (1, 4))
        with torch.no_grad():
            seq = free.generate(prompt, max_new_tokens=24, do_sample=False)[0, 4:].tolist()
        if 5 in seq and (2 not in seq or seq.index(5) < seq.index(2)):
            break
    else:
        print("  no prompt found whose greedy continuation hits 5")
        return
    print("  prompt:", prompt[0].tolist())
    print("  greedy, no stop token:", seq)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    print("  greedy, checkpoint's generation_config:", got)
    print("  stops at 5:", got[-1] == 5 and len(got) == seq.index(5) + 1)


def probe_config():
    import transformers
    print("transformers", transformers.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        probe_rope(tmp, "a1_params_default_scaling_llama3",
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": LLAMA3})
        probe_rope(tmp, "a2_params_llama3_scaling_default",
                   {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0},
                    "rope_scaling": {"rope_type": "default"}})
        probe_rope(tmp, "a3_params_llama3_scaling_default_theta",
                   {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0},
                    "rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}})
        probe_rope(tmp, "a4_params_default_5e5_scaling_llama3_no_theta",
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": LLAMA3})
        probe_rope(tmp, "a5_as_a4_plus_top_theta_5e5",
                   {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                    "rope_scaling": LLAMA3})
        probe_rope(tmp, "a6_params_llama3_5e5_scaling_default_no_theta",
                   {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "rope_scaling": {"rope_type": "default"}})
        probe_rope(tmp, "a7_params_llama3_5e5_scaling_null",
                   {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "rope_scaling": None})
        probe_rope(tmp, "b_top_theta_5e5_params_theta_1e4",
                   {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
        probe_rope(tmp, "b2_top_theta_5e5_params_without_theta",
                   {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default"}})
        probe_rope(tmp, "legacy_only_theta_5e5_scaling_llama3", {"rope_theta": 500000.0, "rope_scaling": LLAMA3})
        probe_tied(tmp)
        probe_eos(tmp)


if __name__ == "__main__":
    import transformers, peft, safetensors
    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__,
          "safetensors", safetensors.__version__)
    if "--probe-config" in sys.argv:
        step("probe_config")(probe_config)()
    else:
        check_base()
        variant_patterns()
        variant_lm_head()
        variant_embed()
        variant_unsupported()
    finish()
