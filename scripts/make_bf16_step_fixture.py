#!/usr/bin/env python3
"""Build the bf16 LoRA step fixture the Rust test `tests/tests/llama_bf16.rs`
compares with: one SGD step of a PEFT adapter on a bf16 Llama, as PyTorch
and PEFT take it, and the same step computed in f64 on the same values.

Run by hand (not by CI) where PyTorch, transformers and PEFT are
installed (e.g. `pip install --target DIR torch==2.9.1
transformers==5.24.0 peft==0.21.2 safetensors`, then `PYTHONPATH=DIR`);
it needs no GPU and no network:

    python3 scripts/make_bf16_step_fixture.py [--study]

It reads the `gqa_llama3` fixture model and its adapter (written by
`make_llama_fixtures.py`) and writes
tests/fixtures/llama/gqa_llama3/bf16_step.safetensors:

  input_ids                  the fixture's two rows of 9 tokens (i32)
  bf16.loss, bf16.logits     the first step's loss (f32, as HF's causal-LM
                             loss returns it from bf16 logits) and logits
                             (bf16 values, stored as f32)
  bf16.sgd.<PEFT key>        the adapter after one SGD step (lr 0.05)
  f64.loss, f64.logits,      the same, computed in f64 from the same bf16
  f64.sgd.<PEFT key>         weights and f32 adapter (stored as f32): the
                             exact value both bf16 programs round towards

The base weights are the fixture's f32 weights rounded to bf16 (what
`from_pretrained(dtype=torch.bfloat16)` and hlo-train's `--dtype bf16`
both do); the adapter stays in f32, as PEFT keeps it on a bf16 base
(`autocast_adapter_dtype=True`, its default) and hlo-train trains it.
Attention is HF's eager form (softmax in f32, the rest in bf16), the one
hlo-train's naive attention computes.

`--study` also prints how far PyTorch's own bf16 step moves when one
RMSNorm runs in bf16 instead of f32: the error the Rust test must catch.
"""

import os
import sys

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
LR = 0.05


def load(dtype, norm_in_bf16=False):
    """The fixture model in `dtype` (eager attention) with its adapter,
    trainable; `norm_in_bf16` makes every RMSNorm compute in its input's
    dtype (the mistake the test guards against)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    model = LlamaForCausalLM.from_pretrained(DIR, dtype=dtype, attn_implementation="eager")
    if dtype == torch.float64:
        # The bf16 program's values, computed exactly: weights rounded to
        # bf16 first.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float64))
    if norm_in_bf16:
        def forward(self, h):
            var = h.pow(2).mean(-1, keepdim=True)
            return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))
        for m in model.modules():
            if isinstance(m, modeling_llama.LlamaRMSNorm):
                m.forward = forward.__get__(m)
    peft_model = PeftModel.from_pretrained(model, os.path.join(DIR, "adapter"), is_trainable=True)
    if dtype == torch.float64:
        peft_model.to(torch.float64)
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            want = torch.float64 if dtype == torch.float64 else torch.float32
            assert p.dtype == want, (n, p.dtype)
    return peft_model


def step(peft_model, ids):
    """The first step's loss and logits, and the adapter after one SGD
    step on HF's causal-LM loss of `ids` (every next token learned)."""
    peft_model.train()  # lora_dropout is 0: train mode changes nothing else
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    opt.zero_grad()
    out = peft_model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    adapter = {
        n.replace(".default", ""): p.detach().clone()
        for n, p in peft_model.named_parameters()
        if p.requires_grad
    }
    return out.loss.detach(), out.logits.detach(), adapter


def tensors(prefix, loss, logits, adapter):
    out = {f"{prefix}.loss": loss.float().reshape(()), f"{prefix}.logits": logits.float()}
    out.update({f"{prefix}.sgd.{k}": v.float() for k, v in adapter.items()})
    return out


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def main():
    torch.manual_seed(0)
    ids = load_file(os.path.join(DIR, "expected.safetensors"))["input_ids"].long()
    bf16 = step(load(torch.bfloat16), ids)
    exact = step(load(torch.float64), ids)
    out = {"input_ids": ids.to(torch.int32)}
    out.update(tensors("bf16", *bf16))
    out.update(tensors("f64", *exact))
    path = os.path.join(DIR, "bf16_step.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path)
    os.chmod(path, 0o644)  # safetensors writes it owner-only, unlike the other fixtures
    import peft
    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
    print(f"bf16 loss {bf16[0].item():.6f}, f64 loss {exact[0].item():.6f}, "
          f"max |logit| {exact[1].abs().max().item():.3f}")
    report("PyTorch bf16", bf16, exact)
    if "--study" in sys.argv:
        report("PyTorch bf16, norms in bf16", step(load(torch.bfloat16, norm_in_bf16=True), ids), exact)


def report(what, got, exact):
    """How far `got` (loss, logits, adapter) is from the f64 step."""
    loss, logits, adapter = got
    worst = max(max_diff(adapter[k] - exact_start(k), exact[2][k] - exact_start(k)) for k in adapter)
    print(f"{what}: |loss - f64| {abs(loss.item() - exact[0].item()):.2e}, "
          f"max |logits - f64| {max_diff(logits, exact[1]):.3e}, "
          f"max |update - f64's| {worst:.3e}")


_start = {}


def exact_start(key):
    """The adapter tensor `key` before the step (f32, from the fixture)."""
    if not _start:
        raw = load_file(os.path.join(DIR, "adapter", "adapter_model.safetensors"))
        _start.update({k: v.double() for k, v in raw.items()})
    return _start[key].to(torch.float64)


if __name__ == "__main__":
    main()
