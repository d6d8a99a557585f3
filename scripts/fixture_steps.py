"""What the fixture scripts share: steps that record their failure and go
on (so one run reports every broken fixture), a state dict copied into
plain contiguous tensors (as safetensors writes them), and one SGD and one
AdamW step of a PEFT adapter as PyTorch takes them."""

import os

import sys
import traceback

failures = []


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
