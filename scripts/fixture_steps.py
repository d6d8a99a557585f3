"""What the fixture scripts share: steps that record their failure and go
on (so one run reports every broken fixture), a state dict copied into
plain contiguous tensors (as safetensors writes them), a model's expected
outputs with and without a PEFT adapter, and one SGD and one AdamW step
of the adapter as PyTorch takes them."""

import os

import sys
import traceback

failures = []


def trl_environment():
    """What the TRL fixture scripts need before torch, datasets and TRL are
    imported: a fixed hash seed (PEFT writes target_modules from a Python
    set, so adapter_config.json comes out byte-identical on every run; the
    script is re-executed with it), no progress bars, and a datasets
    fingerprint that works here (datasets 5.2.0 cannot hash a pyarrow table
    here, dill: "Can't pickle <class 'MonthDayNano'>", which breaks
    Dataset.from_list; the fingerprint only names cache files, so a hash of
    the rows does, with caching off)."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import hashlib
    import json
    import datasets
    import datasets.arrow_dataset as ad
    datasets.disable_caching()
    ad.generate_fingerprint = lambda ds: hashlib.sha256(
        json.dumps(ds._data.to_pylist(), sort_keys=True).encode()).hexdigest()[:16]


def step(name):
    """Runs the decorated function, recording `name` if it raises."""
    def wrap(f):
        def run(*a, **k):
            try:
                return f(*a, **k)
            except Exception:
                failures.append(name)
                traceback.print_exc()
        return run
    return wrap


def contiguous(sd):
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def finish():
    """Exits non-zero, naming them, if any step failed."""
    if failures:
        print("FAILED:", failures)
        sys.exit(1)


def train_steps(peft_model, ids, d):
    """One SGD (lr 0.05) and one AdamW (lr 1e-3, PyTorch's defaults
    otherwise) step of the adapter from the same start on HF's causal-LM
    loss of `ids` (every next token learned), written to
    d/train_step.safetensors as `<opt>.loss` and `<opt>.<PEFT key>`."""
    import torch
    from safetensors.torch import save_file

    start = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    out = {}
    for opt_name in ["sgd", "adamw"]:
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if n in start:
                    p.copy_(start[n])
        params = [p for n, p in peft_model.named_parameters() if p.requires_grad]
        if opt_name == "sgd":
            opt = torch.optim.SGD(params, lr=0.05)
        else:
            opt = torch.optim.AdamW(params, lr=1e-3)
        peft_model.train()
        opt.zero_grad()
        loss = peft_model(input_ids=ids, labels=ids.long()).loss
        loss.backward()
        out[f"{opt_name}.loss"] = loss.detach().reshape(())
        opt.step()
        for n, p in peft_model.named_parameters():
            if n in start:
                # PEFT's saved key: without the adapter name.
                out[f"{opt_name}.{n.replace('.default', '')}"] = p.detach().clone()
    peft_model.eval()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if n in start:
                p.copy_(start[n])
    save_file(contiguous(out), os.path.join(d, "train_step.safetensors"))
    print("  train steps: sgd loss", float(out["sgd.loss"]), "adamw loss", float(out["adamw.loss"]))


def adapter_fixture(model, ids, prompt_len, max_new, lora, d):
    """HF's logits of `ids` and greedy tokens of `ids[:1, :prompt_len]`
    (`max_new` of them, no stop token) from `model` (already saved in `d`),
    then the same with a PEFT adapter of `lora` whose A and B are drawn
    from N(0, 0.1) (so B != 0): the adapter written to d/adapter, the
    tensors to d/expected.safetensors. Returns the PEFT model."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import save_file

    with torch.no_grad():
        base = model(input_ids=ids).logits.float()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = ids[:1, :prompt_len]
    # Every prompt token counts, the pad id too (generate would mask it).
    every = torch.ones_like(prompt)
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=every, max_new_tokens=max_new, do_sample=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits.float()
        greedy_adapter = peft_model.generate(input_ids=prompt, attention_mask=every, max_new_tokens=max_new,
                                             do_sample=False)
    peft_model.save_pretrained(os.path.join(d, "adapter"))
    card = os.path.join(d, "adapter", "README.md")  # PEFT's model card
    if os.path.exists(card):
        os.remove(card)
    save_file({"input_ids": ids.to(torch.int32), "logits": base, "logits_adapter": adapted,
               "greedy": greedy.to(torch.int32), "greedy_adapter": greedy_adapter.to(torch.int32)},
              os.path.join(d, "expected.safetensors"))
    print(f"{os.path.basename(d)}: max |logit| {base.abs().max():.3f}, adapter changes logits by "
          f"{(adapted - base).abs().max():.3f}")
    return peft_model


def tiny_llama(model_dir, dtype):
    """A fixture Llama as the TRL fixture scripts load it: eager attention,
    no name (so nothing is fetched by name)."""
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype)
    m.name_or_path = None
    return m


def q_v_lora(targets):
    """The TRL fixtures' LoRA: r 4, alpha 8 (scale 2) on `targets`, no
    dropout, no bias."""
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")


def hand_step(params, grads, opt, lr, k_step, adam):
    """One optimizer step by hand, in place, on the tensors `params` (a
    dict by key) with `grads` (same keys): SGD without momentum, or AdamW
    without weight decay (betas 0.9/0.999, eps 1e-8; `adam` holds each
    key's (m, v), zeros before step 1) at step `k_step` from 1."""
    import math
    import torch
    with torch.no_grad():
        for k, p in params.items():
            g = grads[k]
            if opt == "sgd":
                p -= lr * g
            else:
                m, v = adam[k]
                m.mul_(0.9).add_(0.1 * g)
                v.mul_(0.999).add_(0.001 * g * g)
                bc1, bc2 = 1 - 0.9 ** k_step, 1 - 0.999 ** k_step
                p -= (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + 1e-8)
