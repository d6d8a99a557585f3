#!/usr/bin/env python3
"""Build the mixture-of-experts fixtures (Qwen3-MoE, Mixtral, gpt-oss,
Qwen2-MoE) the
Rust tests compare with (the sibling of make_family_fixtures.py).

Run by hand (not by CI) where HF transformers, PEFT, safetensors and
PyTorch are installed; it needs no GPU and no network:

    python3 scripts/make_moe_fixtures.py [FIXTURES_DIR]

FIXTURES_DIR defaults to tests/fixtures. It writes, for each of qwen3_moe,
mixtral, gpt_oss and qwen2_moe:
  families/<name>/config.json, model.safetensors, generation_config.json
                                   a tiny random MoE model (save_pretrained),
                                   every weight non-trivial, routers drawn
                                   N(0, 0.2) so routing is far from ties;
                                   the config has output_router_logits true
                                   and router_aux_loss_coef 0.05
  families/<name>/adapter/         a PEFT LoRA adapter on q/k/v/o_proj (and
                                   qwen2_moe's gate/up/down_proj), B != 0
  families/<name>/expected.safetensors
                                   input_ids [4, 11], logits without and with
                                   the adapter (f32), greedy tokens (HF
                                   generate, KV cache) from a 7-token prompt,
                                   and the base model's scalar aux_loss (the
                                   load-balancing loss) and ce_loss on the rows
  families/<name>/train_step.safetensors
                                   one SGD and one AdamW step of the adapter
                                   (PyTorch + PEFT) on the four rows; HF's loss,
                                   so ce + 0.05 * aux
  families/<name>/adapter_experts/ a PEFT LoRA adapter on q/k/v/o_proj and on
                                   the fused 3-D expert parameters
                                   (target_parameters mlp.experts.gate_up_proj
                                   and mlp.experts.down_proj)
  families/<name>/expected_experts.safetensors
                                   input_ids, logits_adapter_experts,
                                   greedy_adapter_experts
  families/<name>/train_step_experts.safetensors
                                   one SGD and one AdamW step of that adapter
  families/<name>/fused/           config.json and model.safetensors with the
                                   model's own state_dict keys (fused 3-D
                                   experts), for the models whose
                                   save_pretrained layout is per-expert
and
  families/MOE.md                  the key layouts, the adapter keys and
                                   shapes, PEFT's fused-expert LoRA delta, the
                                   gpt-oss forward, the losses
  families/moe_param_counts.json   total (transformers, meta device) and
                                   active-per-token parameter counts of Hub
                                   MoE configs

What transformers 5.24 save_pretrained writes: qwen3_moe per-expert
(model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight), mixtral
per-expert in the original Mixtral names
(model.layers.N.block_sparse_moe.experts.E.w{1,2,3}.weight, gate
block_sparse_moe.gate.weight), gpt_oss fused, as its state_dict
(model.layers.N.mlp.experts.gate_up_proj [E, H, 2I] and friends); the
script prints and checks it. The models run with eager attention and the
eager (per-expert loop) experts implementation. Everything is seeded and
the script re-executes itself with PYTHONHASHSEED=0 (PEFT writes
target_modules from a set), so a rerun writes byte-identical files.
"""

import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import copy
import json
import math
import shutil
import tempfile
import traceback

import torch

import fixture_steps
from fixture_steps import adapter_fixture, contiguous, finish, step, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures")
FAMILIES = os.path.join(OUT, "families")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
AUX_COEF = 0.05
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
              experts_implementation="eager", output_router_logits=True, router_aux_loss_coef=AUX_COEF)

MODELS = {
    # Layer 1 a dense MLP (mlp_only_layers), q/k norms, head_dim 12
    # (hidden/heads would be 10), top-3 of 8 renormalised.
    "qwen3_moe": ("Qwen3Moe", dict(
        vocab_size=120, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, intermediate_size=36,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1e6,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )),
    # Top-2 of 4, always renormalised, no window, no jitter.
    "mixtral": ("Mixtral", dict(
        vocab_size=104, hidden_size=48, intermediate_size=28, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, router_jitter_noise=0.0,
    )),
    # A sliding and a full layer (window 4), attention biases and sinks,
    # router bias, expert biases, clamped SwiGLU, yarn rope as GptOssConfig's
    # default; not quantized. Two layers, not four, to keep the files under
    # 2 MB.
    "gpt_oss": ("GptOss", dict(
        vocab_size=112, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )),
    # A shared expert behind its sigmoid gate on each sparse layer, q/k/v
    # biases, layer 1 dense (mlp_only_layers), top-2 of 6 not renormalised
    # (the class default), and Qwen2MoeConfig's sliding rule: with
    # use_sliding_window, the even layers below max_window_layers (layer 0
    # here) slide, window 4.
    "qwen2_moe": ("Qwen2Moe", dict(
        vocab_size=116, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        intermediate_size=36, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, qkv_bias=True,
        use_sliding_window=True, sliding_window=4, max_window_layers=2, rope_theta=1e6,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )),
    # Sigmoid routing with the selection bias (drawn N(0, 0.5): the
    # buffer HF initialises to zeros) and groups: 8 experts in 4 groups,
    # the best 2 groups kept, 3 experts a token, renormalised and scaled
    # by 2.5; two shared experts as one MLP; layer 0 dense
    # (first_k_dense_replace 1); q/k/v biases, q/k norms, the class's
    # partial rotary (0.5 of head_dim 16).
    "glm4_moe": ("Glm4Moe", dict(
        vocab_size=112, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=16,
        n_shared_experts=2, intermediate_size=40, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )),
    # Multi-head latent attention (a query bottleneck of 24, a latent of
    # 16, heads of 8 unrotated + 4 interleaved rotary dimensions, values of
    # 6, padded inside the attention), yarn with DeepSeek's two mscales
    # (unequal, so both the cos/sin factor and the scores' factor are not
    # 1), GLM-4.5's router (8 experts in 4 groups, the best 2 kept, 2 a
    # token), one shared expert, layer 0 dense.
    "deepseek_v3": ("DeepseekV3", dict(
        vocab_size=104, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=12,
        n_shared_experts=1, intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707),
    )),
}
# Latent attention's projections, which its adapters target.
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# The modules each model's adapters target: Qwen2-MoE's adapter/ also the
# shared expert's gate/up/down_proj (and the dense layer's). GLM-4.5's
# adapter_experts/ names gate/up/down_proj among its target_modules:
# PEFT (transformers 5's fused experts) turns those into the experts'
# target_parameters with gate_up_proj's rank and alpha doubled
# (rank_pattern and alpha_pattern `.*\.gate_up_proj`), and LoRA on no
# gate/up/down_proj module (the shared experts' and the dense layer's
# stay frozen).
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {"qwen2_moe": ATTN + MLP, "deepseek_v3": MLA}
EXPERT_TARGETS = {"glm4_moe": ATTN + MLP, "deepseek_v3": MLA}
# The families whose models compute no load-balancing loss.
NO_AUX = {"Glm4Moe", "DeepseekV3"}

# Hub MoE configs (the fields their config.json files give; transformers'
# defaults otherwise): Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
# mistralai/Mixtral-8x7B-v0.1, openai/gpt-oss-20b, openai/gpt-oss-120b.
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False)
PRESETS = {
    "qwen3-30b-a3b": ("Qwen3Moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                       tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("Qwen3Moe", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                         moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                                         num_key_value_heads=4, head_dim=128, num_experts=128,
                                         num_experts_per_tok=8, tie_word_embeddings=False)),
    "mixtral-8x7b": ("Mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    "gpt-oss-20b": ("GptOss", GPT_OSS_20B),
    "gpt-oss-120b": ("GptOss", dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)),
    # Qwen/Qwen1.5-MoE-A2.7B, zai-org/GLM-4.5, deepseek-ai/DeepSeek-V3,
    # moonshotai/Kimi-K2-Instruct (as DeepseekV3Config: its own class is
    # remote code with the same fields).
    "qwen1.5-moe-a2.7b": ("Qwen2Moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                           num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                           moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                           num_experts=60, num_experts_per_tok=4, tie_word_embeddings=False)),
    "glm-4.5": ("Glm4Moe", dict(vocab_size=151552, hidden_size=5120, intermediate_size=12288, num_hidden_layers=92,
                                num_attention_heads=96, num_key_value_heads=8, head_dim=128, use_qk_norm=True,
                                attention_bias=True, moe_intermediate_size=1536, n_routed_experts=160,
                                n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                                tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3", dict()),
    "kimi-k2": ("DeepseekV3", dict(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
                                   n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1)),
}

# MOE.md, filled in by the steps.
report = {name: [] for name in MODELS}


def classes(family):
    import transformers
    return getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")


def shapes(path):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in sorted(f.keys())}


def key_lines(keys):
    return ["```"] + [f"{k} {v}" for k, v in keys.items()] + ["```"]


def layout(keys):
    if any(".experts.0." in k for k in keys):
        return "per-expert"
    if any(k.endswith("experts.gate_up_proj") for k in keys):
        return "fused"
    return "unknown"


def fused_of_saved(saved, family, layer, expert):
    """The state_dict (fused) slices the per-expert saved tensors are."""
    if family == "Mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return saved[p + "w1.weight"], saved[p + "w3.weight"], saved[p + "w2.weight"]
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return saved[p + "gate_proj.weight"], saved[p + "up_proj.weight"], saved[p + "down_proj.weight"]


def expert_delta(lora_a, lora_b, num_experts, scaling, transposed):
    """PEFT's LoRA delta of a fused [E, d1, d2] expert parameter, written
    out per expert: rows e*r..(e+1)*r of lora_A, columns e, e+E, ... of
    lora_B; B_e @ A_e is [out, in] ([d1, d2] unless the experts are stored
    transposed, [E, in, out], when the delta is its transpose)."""
    r = lora_a.shape[0] // num_experts
    deltas = []
    for e in range(num_experts):
        a_e = lora_a[e * r:(e + 1) * r]
        b_e = lora_b[:, e::num_experts]
        d = scaling * (b_e @ a_e)
        deltas.append(d.T if transposed else d)
    return torch.stack(deltas)


def merged_model(base, adapter_path, scaling):
    """A copy of `base` with the adapter's deltas added to its weights by
    the formulas of MOE.md (not PEFT's code)."""
    from safetensors.torch import load_file
    sd = load_file(adapter_path)
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in sorted(sd):
            if ".lora_A." not in k:
                continue
            a, b = sd[k], sd[k.replace(".lora_A.", ".lora_B.")]
            path = k.removeprefix("base_model.model.").replace(".lora_A.weight", "")
            if path.endswith(".experts.base_layer") or path.endswith(".experts"):
                experts_path = path.removesuffix(".base_layer")
                name = "gate_up_proj" if path.endswith(".base_layer") else "down_proj"
                experts = model.get_submodule(experts_path)
                w = getattr(experts, name)
                w += expert_delta(a, b, w.shape[0], scaling, getattr(experts, "is_transposed", False))
            else:
                params[path + ".weight"] += scaling * (b @ a)
    return model


def lora_config(name, target_parameters=None):
    from peft import LoraConfig
    extra = {} if target_parameters is None else dict(target_parameters=target_parameters)
    targets = (TARGETS if target_parameters is None else EXPERT_TARGETS).get(name, ATTN)
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", **extra)


def experts_fixture(base, ids, d):
    """adapter_fixture and train_steps for a LoRA adapter that also targets
    the fused expert parameters, on a fresh copy of `base`: the adapter to
    d/adapter_experts, logits and greedy tokens to
    d/expected_experts.safetensors, the two steps to
    d/train_step_experts.safetensors. Returns the PEFT model."""
    from safetensors.torch import load_file, save_file
    model = copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as tmp:
        t = os.path.join(tmp, os.path.basename(d) + "+experts")
        os.makedirs(t)
        peft_model = adapter_fixture(model, ids, 7, 24, lora_config(os.path.basename(d), EXPERT_PARAMS), t)
        expected = load_file(os.path.join(t, "expected.safetensors"))
        dest = os.path.join(d, "adapter_experts")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(os.path.join(t, "adapter"), dest)
        save_file({"input_ids": expected["input_ids"], "logits_adapter_experts": expected["logits_adapter"],
                   "greedy_adapter_experts": expected["greedy_adapter"]},
                  os.path.join(d, "expected_experts.safetensors"))
        train_steps(peft_model, ids, t)
        shutil.move(os.path.join(t, "train_step.safetensors"), os.path.join(d, "train_step_experts.safetensors"))
    return peft_model, expected


def losses(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids.long())
        ce = model(input_ids=ids, labels=ids.long(), output_router_logits=False).loss
    total, aux = out.loss, getattr(out, "aux_loss", None)
    if aux is None:  # no load-balancing loss (DeepSeek-V3, GLM-4.5)
        aux = torch.zeros(())
    assert torch.allclose(total, ce + AUX_COEF * aux, rtol=1e-6, atol=0), (total, ce, aux)
    return float(ce), float(aux), float(total), aux.detach().float().reshape(()), ce.detach().float().reshape(())


def build(i, name, family, kw):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    md = report[name]
    torch.manual_seed(300 + i)
    d = os.path.join(FAMILIES, name)
    os.makedirs(d, exist_ok=True)
    config_class, model_class = classes(family)
    model = model_class(config_class(**kw, **COMMON)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:  # kernels, embeddings, routers, biases, sinks; larger than HF's init
                p.normal_(0.0, 0.2)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    state = contiguous(model.state_dict())
    model.save_pretrained(d, safe_serialization=True)
    saved = shapes(os.path.join(d, "model.safetensors"))
    kind = layout(saved)
    print(f"{name}: save_pretrained writes the {kind} layout, e.g.",
          [k for k in saved if ".experts." in k][:3])
    c = model.config
    md += [f"## {name} ({model_class.__name__})", "",
           "Config (config.json): " + ", ".join(f"{k}={v}" for k, v in kw.items()) +
           f"; router_aux_loss_coef={AUX_COEF}, output_router_logits=true; bos 1, eos 2, pad 0.", "",
           f"### model.safetensors: save_pretrained's **{kind}** layout", ""]

    # The saved tensors against the state_dict: per-expert slices of the
    # fused parameters, or the state_dict itself.
    sd_saved = load_file(os.path.join(d, "model.safetensors"))
    if kind == "per-expert":
        moe_layers = sorted({int(k.split(".")[2]) for k in state if k.endswith("experts.gate_up_proj")})
        inter = state[f"model.layers.{moe_layers[0]}.mlp.experts.down_proj"].shape[-1]
        for layer in moe_layers:
            gu = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            dn = state[f"model.layers.{layer}.mlp.experts.down_proj"]
            for e in range(gu.shape[0]):
                g, u, dw = fused_of_saved(sd_saved, family, layer, e)
                assert torch.equal(gu[e, :inter], g) and torch.equal(gu[e, inter:], u) and torch.equal(dn[e], dw)
        names = ("w1", "w3", "w2") if family == "Mixtral" else ("gate_proj", "up_proj", "down_proj")
        prefix = "block_sparse_moe" if family == "Mixtral" else "mlp"
        md += [f"Checked: `mlp.experts.gate_up_proj[e] = cat({prefix}.experts.e.{names[0]}.weight, "
               f"{prefix}.experts.e.{names[1]}.weight)` along dim 0 (gate rows 0..I, up rows I..2I), "
               f"`mlp.experts.down_proj[e] = {prefix}.experts.e.{names[2]}.weight`"
               + (", router `mlp.gate.weight` = `block_sparse_moe.gate.weight`." if family == "Mixtral" else "."),
               ""]
    else:
        assert sorted(sd_saved) == sorted(state) and all(torch.equal(sd_saved[k], state[k]) for k in state)
        md += ["Checked: the file is the model's state_dict, keys and values; so no `fused/` folder "
               "is written for this model (model.safetensors already is the fused layout).", ""]
    md += key_lines(saved) + [""]

    ids = torch.randint(0, kw["vocab_size"], (4, 11))
    ce, aux, total, aux_t, ce_t = losses(model, ids)
    print(f"  base loss: ce {ce:.6f}, aux {aux:.6f}, ce + {AUX_COEF} * aux = {total:.6f} "
          f"(aux adds {total - ce:.6f})")
    md += ["### Losses (base model, eval, the four rows, no attention mask)", "",
           f"ce_loss {ce:.6f}, aux_loss {aux:.6f}, HF loss = ce + {AUX_COEF} * aux = {total:.6f}. "
           "`aux_loss` and `ce_loss` are in expected.safetensors; train_step*.safetensors use HF's loss "
           "(aux included).", ""]

    # The fused layout, and that transformers loads both to the same logits.
    reload = dict(attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(d, **reload).eval()
        diff = float((loaded(input_ids=ids).logits - base_logits).abs().max())
    assert diff == 0, diff
    if kind == "per-expert":
        f = os.path.join(d, "fused")
        os.makedirs(f, exist_ok=True)
        save_file(state, os.path.join(f, "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(os.path.join(d, "config.json"), os.path.join(f, "config.json"))
        with torch.no_grad():
            fused, info = AutoModelForCausalLM.from_pretrained(f, output_loading_info=True, **reload)
            assert not any(info.values()), info
            fdiff = float((fused.eval()(input_ids=ids).logits - loaded(input_ids=ids).logits).abs().max())
        assert fdiff == 0, fdiff
        print(f"  fused/: from_pretrained loads it, max |logits - per-expert folder's logits| = {fdiff}")
        md += ["### fused/", "",
               "The same weights under the model's own state_dict keys (safetensors save_file, metadata "
               f"format pt), config.json copied. from_pretrained loads it with no missing or unexpected keys "
               f"and its logits equal the per-expert folder's (max abs diff {fdiff}).", ""]
        md += key_lines({k: list(v.shape) for k, v in sorted(state.items()) if ".experts." in k}) + [""]

    base = copy.deepcopy(model)  # adapter_fixture wraps `model` in place
    peft_model = adapter_fixture(model, ids, 7, 24, lora_config(name), d)
    expected = load_file(os.path.join(d, "expected.safetensors"))
    expected.update(aux_loss=aux_t, ce_loss=ce_t)
    save_file(expected, os.path.join(d, "expected.safetensors"))
    train_steps(peft_model, ids, d)
    with torch.no_grad():
        peft_model.train()
        with_aux = float(peft_model(input_ids=ids, labels=ids.long()).loss)
        without = float(peft_model(input_ids=ids, labels=ids.long(), output_router_logits=False).loss)
        peft_model.eval()
    print(f"  adapter, train mode: loss with aux {with_aux:.6f}, without {without:.6f}")

    torch.manual_seed(400 + i)
    try:
        experts_model, exp = experts_fixture(base, ids, d)
    except Exception as e:
        failures_note(name, "adapter_experts", e)
        return
    assert torch.equal(exp["logits"], expected["logits"])
    adapter_keys = shapes(os.path.join(d, "adapter_experts", "adapter_model.safetensors"))
    print("  adapter_experts keys:")
    for k, v in adapter_keys.items():
        if ".experts." in k:
            print("   ", k, v)
    # PEFT's own deltas against the written-out formula, then the logits of
    # the weights merged by that formula against PEFT's.
    from peft.tuners.lora.layer import ParamWrapper
    for mod_name, mod in experts_model.named_modules():
        if isinstance(mod, ParamWrapper):
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            experts = mod.get_base_layer()
            ours = expert_delta(a, b, mod.num_experts, mod.scaling["default"], getattr(experts, "is_transposed", False))
            assert torch.allclose(ours, mod.get_delta_weight("default"), atol=1e-6, rtol=1e-5), mod_name
    merged = merged_model(base, os.path.join(d, "adapter_experts", "adapter_model.safetensors"), 8 / 4)
    with torch.no_grad():
        mdiff = float((merged(input_ids=ids).logits - exp["logits_adapter"]).abs().max())
    assert mdiff < 1e-4, mdiff
    print(f"  merged by the MOE.md formula: max |logits - PEFT's| = {mdiff:.2e}")
    first_sparse = min(int(k.split(".")[2]) for k in state if k.endswith("experts.gate_up_proj"))
    experts = base.get_submodule(f"model.layers.{first_sparse}.mlp.experts")
    transposed = getattr(experts, "is_transposed", False)
    num_e = experts.gate_up_proj.shape[0]
    gu, dn = list(experts.gate_up_proj.shape), list(experts.down_proj.shape)
    md += ["### adapter_experts/", "",
           "`LoraConfig(r=4, lora_alpha=8, target_modules=[q_proj, k_proj, v_proj, o_proj], "
           "target_parameters=[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"], lora_dropout=0.0, "
           "bias=\"none\", task_type=\"CAUSAL_LM\")`, all lora weights N(0, 0.1). PEFT nests two "
           "ParamWrappers on `mlp.experts`, in the module's parameter order: the inner one "
           "(`mlp.experts.base_layer.lora_*`) is **gate_up_proj**, the outer one (`mlp.experts.lora_*`) is "
           "**down_proj**.", "",
           f"Experts stored {'transposed, [E, in, out] (x @ W[e])' if transposed else '[E, out, in] (W[e] @ x)'}: "
           f"gate_up_proj {gu}, down_proj {dn}, E = {num_e}, r = 4, scaling = 8/4 = 2. "
           f"The delta formula of \"PEFT's LoRA on fused expert parameters\" above, applied to the base "
           f"weights, reproduces PEFT's logits (max abs diff {mdiff:.1e}); PEFT's get_delta_weight equals it.", ""]
    md += key_lines(adapter_keys) + [""]


def failures_note(name, what, e):
    traceback.print_exc()
    fixture_steps.failures.append(f"{name}/{what}")
    report[name] += [f"### {what}: FAILED", "", "```", f"{type(e).__name__}: {e}", "```", ""]


@step("models")
def build_models():
    for i, (name, (family, kw)) in enumerate(MODELS.items()):
        try:
            build(i, name, family, kw)
        except Exception as e:
            failures_note(name, "build", e)


def plain_choice(scores, bias, k, groups):
    """The top k of the biased scores kept to the best `groups` groups of
    four (none dropped when `groups` is None), sorted."""
    choice = scores + bias
    if groups is not None:
        g = choice.view(choice.shape[0], -1, choice.shape[1] // groups[0])
        best = g.topk(2, dim=-1)[0].sum(-1).topk(groups[1], dim=-1)[1]
        mask = torch.zeros_like(g[..., 0]).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(g.shape[-1], 1), float("-inf"))
    return choice.topk(k, dim=-1)[1].sort(dim=-1)[0]


@step("sigmoid_routers")
def sigmoid_routers():
    """families/<name>/router.safetensors for the sigmoid-routed models:
    each sparse layer's router input (`layers.<l>.hidden` [44, H]) and HF's
    choice (`layers.<l>.indices`, sorted, and `layers.<l>.weights`, in the
    same order), on the fixture's rows; counts of the tokens whose choice
    the groups and the selection bias change."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    for name, (family, kw) in MODELS.items():
        if family not in NO_AUX:
            continue
        d = os.path.join(FAMILIES, name)
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                     experts_implementation="eager").eval()
        ids = load_file(os.path.join(d, "expected.safetensors"))["input_ids"].long()
        seen, out, by_groups, by_bias = {}, {}, 0, 0
        hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, (i[0], o)))
                 for n, m in model.named_modules() if n.endswith("mlp.gate")]
        with torch.no_grad():
            model(input_ids=ids)
        for h in hooks:
            h.remove()
        groups = (kw["n_group"], kw["topk_group"])
        for n, (hidden, (logits, weights, indices)) in sorted(seen.items()):
            layer = n.split(".")[2]
            order = indices.sort(dim=-1)
            gate = model.get_submodule(n)
            scores, bias = logits.sigmoid(), gate.e_score_correction_bias
            k = indices.shape[-1]
            assert torch.equal(plain_choice(scores, bias, k, groups), order[0])
            by_groups += int((plain_choice(scores, bias, k, None) != order[0]).any(-1).sum())
            by_bias += int((plain_choice(scores, 0 * bias, k, groups) != order[0]).any(-1).sum())
            out[f"layers.{layer}.hidden"] = hidden.reshape(-1, hidden.shape[-1]).float()
            out[f"layers.{layer}.indices"] = order[0].int()
            out[f"layers.{layer}.weights"] = weights.gather(1, order[1]).float()
        assert by_groups > 0 and by_bias > 0, (name, by_groups, by_bias)
        save_file(contiguous(out), os.path.join(d, "router.safetensors"))
        tokens = ids.numel() * len(seen)
        print(f"{name}: of {tokens} routed tokens, the groups change {by_groups} choices, the bias {by_bias}")
        report[name] += ["### router.safetensors", "",
                         f"Each sparse layer's router input and HF's choice on the four rows (44 tokens a layer, "
                         f"{tokens} in all): the group limit changes the chosen experts of {by_groups} of them (against "
                         f"the top {k} of all biased scores), the selection bias of {by_bias} (against unbiased "
                         f"scores, groups kept).", ""]


def gpt_oss_rope_note():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    c = GptOssConfig(**MODELS["gpt_oss"][1], **COMMON)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](c)
    return c.rope_parameters, [f"{x:.9g}" for x in inv_freq.tolist()], scaling


FORMULAS = r"""
## PEFT's LoRA on fused expert parameters (PEFT 0.21.2, `lora.ParamWrapper`)

A 3-D parameter `W` of shape `[E, d1, d2]`. The experts module says whether
it is stored transposed (`is_transposed`, set by transformers'
`use_experts_implementation`; gpt-oss: true, Qwen3-MoE and Mixtral: false).

* not transposed (Qwen3-MoE, Mixtral; `W[e]` is `[out, in]`, used as
  `W[e] @ x`): `in = d2`, `out = d1`.
* transposed (gpt-oss; `W[e]` is `[in, out]`, used as `x @ W[e]`): `in = d1`,
  `out = d2`.

`lora_A.weight` is `[E*r, in]`, `lora_B.weight` is `[out, E*r]`
(`nn.Linear(in, r*E)` and `nn.Linear(r*E, out)`). For expert `e`:

    A_e = lora_A[e*r : (e+1)*r, :]               # [r, in]: a contiguous block of rows
    B_e = lora_B[:, e::E]                          # [out, r]: columns e, e+E, e+2E, ... (strided!)
                                                   # (column j*E + e is B_e[:, j])
    s   = lora_alpha / r                           # (lora_alpha / sqrt(r) with use_rslora)
    not transposed:  W_eff[e] = W[e] + s * B_e @ A_e          # [out, in]
    transposed:      W_eff[e] = W[e] + s * (B_e @ A_e)^T      # [in, out]

(`get_delta_weight`: `A.reshape(E, r, in)`, `B.reshape(out, r, E)`,
`einsum("o r e, e r i -> e o i")` not transposed, `"-> e i o"`
transposed.) The forward runs the experts module with `W_eff` in place of
`W` (torch parametrization), so the delta of `gate_up_proj` covers gate and
up together: Qwen3-MoE/Mixtral rows `0..I` of `W_eff[e]` are the gate, rows
`I..2I` the up projection; gpt-oss columns `0::2` are the gate, `1::2` the
up projection. Expert biases (gpt-oss) are not adapted. lora_dropout must
be 0 (ParamWrapper refuses dropout, DoRA, lora_bias, fan_in_fan_out).

## Load-balancing aux loss (transformers `load_balancing_loss_func`)

Over the router logits `z` of every MoE layer (the router's raw output,
gpt-oss's bias included), all layers' tokens pooled (`R` = layers x
tokens, no attention mask here):

    p = softmax(z) over all E experts (per row)
    f_e = (number of (row, slot) with e among the top-k of p) / R
    P_e = (sum over rows of p_e) / R
    aux = E * sum_e f_e * P_e
    loss = CE + router_aux_loss_coef * aux      (with labels and output_router_logits)

## Routing

* Qwen3-MoE: `p = softmax(x W_g^T)` (f32), top-k of `p`, renormalised to
  sum 1 when `norm_topk_prob` (true here); expert `e`:
  `down[e] @ (silu(gate) * up)` with `gate, up = chunk(gate_up[e] @ x, 2)`.
  Dense layers (`mlp_only_layers`, or `(layer+1) % decoder_sparse_step != 0`)
  use `mlp.{gate,up,down}_proj` of `intermediate_size`.
* Mixtral: the same with renormalisation always; no jitter (0) here.
* Qwen2-MoE: Qwen3-MoE's routed experts (renormalised only with
  `norm_topk_prob`, false here), plus on every sparse layer a shared
  expert, a dense SwiGLU MLP of `shared_expert_intermediate_size`
  (`mlp.shared_expert.{gate,up,down}_proj`), scaled by
  `sigmoid(x @ mlp.shared_expert_gate.weight^T)` (`[1, H]`, one logit a
  token) and added: `moe(x) = routed(x) + sigmoid(g(x)) * shared(x)`.
  Its adapters also target gate/up/down_proj: the shared expert's and the
  dense layer's.
"""

GPT_OSS = r"""
## gpt-oss forward (transformers 5.24 `modeling_gpt_oss.py`, eager)

Not quantized: plain f32 weights (no MXFP4 blocks/scales, no
`quantization_config`).

* Decoder layer: `h = x + attn(rmsnorm(x))`, `out = h + moe(rmsnorm(h))`;
  final `rmsnorm`, untied `lm_head`. RMSNorm: `w * (x / sqrt(mean(x^2) +
  eps))` computed in f32, eps 1e-5.
* Attention: q/k/v/o projections with biases (`attention_bias` true),
  head_dim 12, 4 query heads sharing 2 kv heads, scale `head_dim^-0.5`.
  Layer types alternate `sliding_attention`, `full_attention` (layer 0
  sliding). Sliding layers: query `i` sees key `j` iff `i - 4 < j <= i`
  (HF `kv_idx > q_idx - sliding_window`, window 4); full layers are causal.
* Attention sinks: one learned logit `s_h` per query head
  (`self_attn.sinks [heads]`). Per row, `softmax([scores..., s_h])` (after
  subtracting the row max) and the sink column dropped, so the weights
  sum to less than 1: `w_j = exp(a_j) / (sum_k exp(a_k) + exp(s_h))`.
* RoPE: split-halves rotation (`x1, x2 = chunk(x, 2)`;
  `[x1 cos - x2 sin, x2 cos + x1 sin]`), cos/sin of `position * inv_freq`
  (head_dim/2 frequencies) multiplied by `attention_scaling`.
* MoE: router logits `z = x W_r^T + b_r` (`mlp.router.weight [E, H]`,
  `mlp.router.bias [E]`); top-k on the **logits**, weights
  `softmax(top-k logits)` (softmax over the k selected only). Expert `e`
  (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, stored transposed,
  used as `x @ W`):

      gu   = x @ gate_up_proj[e] + gate_up_proj_bias[e]      # [2I]
      gate = gu[0::2]   ; up = gu[1::2]                       # interleaved columns
      gate = min(gate, limit)                                 # clamp above only
      up   = clamp(up, -limit, limit)
      glu  = gate * sigmoid(alpha * gate)
      y_e  = ((up + 1) * glu) @ down_proj[e] + down_proj_bias[e]
      moe(x) = sum over the k selected e of weight_e * y_e

  with `alpha = swiglu_alpha = 1.702`, `limit = swiglu_limit = 7.0`.
* Aux loss: as above, `softmax` over all E router logits (bias included).
"""


@step("moe_md")
def moe_md():
    import peft
    import transformers
    lines = ["# Mixture-of-experts fixtures", "",
             "Written by `scripts/make_moe_fixtures.py` (do not edit by hand) with torch "
             f"{torch.__version__.split('+')[0]}, transformers {transformers.__version__}, peft {peft.__version__}. "
             "Every model: eager attention, eager (per-expert loop) experts, norms uniform(0.5, 1.5), every other "
             "weight (routers, biases, sinks included) N(0, 0.2); input_ids [4, 11] drawn from the vocabulary; "
             "greedy decoding of 24 tokens from the first 7 of row 0 (no stop token); LoRA r 4, alpha 8, weights "
             "N(0, 0.1). `adapter/` targets q/k/v/o_proj only; `adapter_experts/` adds the fused experts.", "",
             "Note: qwen3_moe's gate_up_proj is [8, 40, 40] and gpt_oss's [4, 48, 48] (2I = H in both), square per "
             "expert: only values, not shapes, tell a transposed gate_up delta apart there (mixtral's [4, 56, 48] "
             "is not square).", ""]
    lines += FORMULAS.strip("\n").split("\n") + [""]
    for name in MODELS:
        lines += report[name]
    lines += GPT_OSS.strip("\n").split("\n") + [""]
    try:
        rope, inv_freq, scaling = gpt_oss_rope_note()
        lines += ["### gpt-oss rope (GptOssConfig's default, kept)", "",
                  "`rope_parameters` " + json.dumps(rope, sort_keys=True) + ": yarn with factor 32, beta_fast 32, "
                  "beta_slow 1, original_max_position_embeddings 4096, truncate false (the correction range "
                  "`low, high` is not floored/ceiled), rope_theta 150000. With `d = head_dim` and "
                  "`c(beta) = d * ln(4096 / (beta * 2 pi)) / (2 ln theta)`: `low = max(c(beta_fast), 0)`, "
                  "`high = min(c(beta_slow), d - 1)`; for `i = 0 .. d/2 - 1`, `pos_freq_i = theta^(2i/d)`, "
                  "`ramp_i = clamp((i - low) / (high - low), 0, 1)`, "
                  "`inv_freq_i = ramp_i / (factor * pos_freq_i) + (1 - ramp_i) / pos_freq_i`; "
                  "`attention_scaling = 0.1 ln(factor) + 1` multiplies cos and sin, so q and k both carry it "
                  "and the q.k scores carry its square.", "",
                  f"For head_dim 12: inv_freq = [{', '.join(inv_freq)}], attention_scaling = {scaling:.9g}.", ""]
    except Exception as e:
        lines += ["### gpt-oss rope: FAILED", "", "```", f"{type(e).__name__}: {e}", "```", ""]
    with open(os.path.join(FAMILIES, "MOE.md"), "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")


def active_and_total(family, c):
    """(active per token, total) parameters from the config's fields."""
    h, v, layers = c.hidden_size, c.vocab_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    bias = bool(getattr(c, "attention_bias", False))
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if bias else 0)
    if family == "Qwen3Moe":
        attn += 2 * hd  # q_norm, k_norm
    if family == "GptOss":
        attn += c.num_attention_heads  # sinks
    e, k = c.num_local_experts, c.num_experts_per_tok
    if family == "GptOss":
        i = c.intermediate_size
        expert, router = 2 * h * i + 2 * i + i * h + h, e * h + e
    else:
        i = c.moe_intermediate_size if family == "Qwen3Moe" else c.intermediate_size
        expert, router = 3 * h * i, e * h
    active = total = 2 * v * h + h  # embedding, lm_head (untied), final norm
    for layer in range(layers):
        sparse = family != "Qwen3Moe" or (layer not in c.mlp_only_layers and (layer + 1) % c.decoder_sparse_step == 0)
        dense = 3 * h * c.intermediate_size
        active += attn + 2 * h + (router + k * expert if sparse else dense)
        total += attn + 2 * h + (router + e * expert if sparse else dense)
    return active, total


def active_of_modules(m, config):
    """The parameters one token uses, from the model's modules: all but
    the experts it is not routed to in each layer that has them."""
    total = sum(p.numel() for p in m.parameters())
    k = config.num_experts_per_tok
    for layer in m.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            e = experts.gate_up_proj.shape[0]
            per_expert = sum(p.numel() for p in experts.parameters()) // e
            total -= (e - k) * per_expert
    return total


@step("moe_param_counts")
def moe_param_counts():
    counts, active = {}, {}
    for name, (family, kw) in PRESETS.items():
        config_class, model_class = classes(family)
        config = config_class(**kw)
        with torch.device("meta"):
            m = model_class(config)
        counts[name] = sum(p.numel() for p in m.parameters())
        if family in ("Qwen3Moe", "Mixtral", "GptOss"):
            active[name], total = active_and_total(family, config)
            assert total == counts[name], (name, total, counts[name])
            assert active[name] == active_of_modules(m, config), name
        else:
            active[name] = active_of_modules(m, config)
        print(name, counts[name], "active", active[name])
    os.makedirs(FAMILIES, exist_ok=True)
    with open(os.path.join(FAMILIES, "moe_param_counts.json"), "w") as f:
        json.dump(dict(counts, active=active), f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    import peft
    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
    build_models()
    sigmoid_routers()
    moe_md()
    moe_param_counts()
    finish()
