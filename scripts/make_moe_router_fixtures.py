#!/usr/bin/env python3
"""Build the trainable-router fixtures of the mixture-of-experts models:
for each of families/qwen3_moe, mixtral, gpt_oss and qwen2_moe (made by
make_moe_fixtures.py), a PEFT adapter whose LoRA is on q/k/v/o_proj and
whose `modules_to_save` is the router (`gate` for Qwen3-MoE and Mixtral,
`router` for gpt-oss: a whole trained copy of each layer's router, bias
included), and one SGD and one AdamW step of it.

Run by hand (not by CI) after make_moe_fixtures.py, where HF transformers,
PEFT, safetensors and PyTorch are installed (no GPU, no network):

    python3 scripts/make_moe_router_fixtures.py [FIXTURES_DIR]

It writes, for each model:
  families/<name>/adapter_router/        the adapter (LoRA A and B drawn
                                         N(0, 0.1), the routers' copies the
                                         base's plus N(0, 0.2))
  families/<name>/expected_router.safetensors
                                         input_ids and logits_adapter_router
                                         (f32) of the four fixture rows
  families/<name>/train_step_router.safetensors
                                         one SGD (lr 0.05) and one AdamW (lr
                                         1e-3, decay 0.01 on all but biases
                                         and norms, as transformers' Trainer
                                         groups it) step on HF's loss (the aux
                                         loss in it), `<opt>.loss` and
                                         `<opt>.<saved key>` as
                                         save_pretrained names the tensors
Seeded: a rerun writes identical files.
"""
import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures")
# Qwen2-MoE's `gate` also names its `shared_expert_gate` for PEFT, which
# matches modules_to_save as a suffix of the module's name: both saved.
ROUTER = {"qwen3_moe": "gate", "mixtral": "gate", "gpt_oss": "router", "qwen2_moe": "gate"}
# transformers' Trainer.get_decay_parameter_names: no decay on these.
DECAY_FORBIDDEN = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def contiguous(d):
    return {k: v.detach().contiguous() for k, v in d.items()}


def main():
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers.trainer_pt_utils import get_parameter_names

    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
    for seed, (name, router) in enumerate(ROUTER.items()):
        d = os.path.join(OUT, "families", name)
        torch.manual_seed(700 + seed)
        base = lambda: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
            d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        model = base()
        model.name_or_path = None
        ids = load_file(os.path.join(d, "expected.safetensors"))["input_ids"].long()
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          modules_to_save=[router], lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        pm = get_peft_model(model, lora)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.1)
                elif "modules_to_save" in n:
                    p.add_(torch.randn_like(p) * 0.2)
        pm.eval()
        dest = os.path.join(d, "adapter_router")
        pm.save_pretrained(dest)
        card = os.path.join(dest, "README.md")
        if os.path.exists(card):
            os.remove(card)
        with torch.no_grad():
            logits = pm(input_ids=ids).logits.float()
            plain = base()(input_ids=ids).logits.float()
        print(f"{name}: the adapter moves the logits by {(logits - plain).abs().max():.3f}")
        save_file(contiguous({"input_ids": ids.int(), "logits_adapter_router": logits}),
                  os.path.join(d, "expected_router.safetensors"))
        start = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
        out = {}
        for opt_name in ["sgd", "adamw"]:
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if n in start:
                        p.copy_(start[n])
            params = [p for n, p in pm.named_parameters() if p.requires_grad]
            # AdamW's decay (torch's default 0.01) as transformers' Trainer
            # groups it: not on biases or norms (the router's bias).
            decayed = set(get_parameter_names(pm, [torch.nn.LayerNorm], DECAY_FORBIDDEN))
            groups = [
                {"params": [p for n, p in pm.named_parameters() if p.requires_grad and n in decayed]},
                {"params": [p for n, p in pm.named_parameters() if p.requires_grad and n not in decayed],
                 "weight_decay": 0.0},
            ]
            opt = torch.optim.SGD(params, lr=0.05) if opt_name == "sgd" else torch.optim.AdamW(groups, lr=1e-3)
            pm.train()
            opt.zero_grad()
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            out[f"{opt_name}.loss"] = loss.detach().reshape(())
            opt.step()
            saved = get_peft_model_state_dict(pm)
            assert len(saved) == len(params), (sorted(saved), len(params))
            out.update({f"{opt_name}.{k}": v.clone() for k, v in saved.items()})
            print(f"  {opt_name} loss {loss.item():.6f}; saved keys not LoRA:",
                  sorted(k for k in saved if "lora_" not in k)[:3], "...")
        save_file(contiguous(out), os.path.join(d, "train_step_router.safetensors"))


if __name__ == "__main__":
    main()
