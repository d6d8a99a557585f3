#!/usr/bin/env python3
"""Fixtures for training from scratch (`train --full --init random`),
made by transformers' own `Trainer`.

A small Llama config, `hlo-train init` of it (the weights `train --init
random --seed 5` starts from), and two steps of transformers 5.24's Trainer
on them (AdamW with weight decay 0.1, which the Trainer applies to every
parameter but the biases and norms, gradient clipping at 0.5, a constant
learning rate, the rows in file order): the loss and gradient norm of each
step and every weight after each step.

Writes tests/fixtures/scratch/: config.json, data.jsonl, init.safetensors,
step1.safetensors, step2.safetensors (and the same two steps in float64,
step1_f64 and step2_f64: the exact answer), expected.json.

Run from the repository root after `cargo build --release`:
    PYTHONPATH=/path/to/refenv python3 scripts/make_scratch_fixtures.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

OUT = "tests/fixtures/scratch"
BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/hlo-train"
SEED = 5
SEQ, ROWS, BATCH = 32, 8, 4

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

HYPER = {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 0.5, "steps": 2}


class Snapshots(TrainerCallback):
    """Every weight after each optimizer step."""

    def __init__(self, model):
        self.model = model
        self.after = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append({k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()})


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/config.json", "w") as f:
        json.dump(CONFIG, f, indent=2)
    rng = np.random.default_rng(11)
    rows = rng.integers(3, CONFIG["vocab_size"], size=(ROWS, SEQ)).tolist()
    with open(f"{OUT}/data.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")

    tmp = tempfile.mkdtemp()
    init = f"{tmp}/init"
    subprocess.run([BIN, "init", "--config", f"{OUT}/config.json", "--seed", str(SEED), "--out", init], check=True)
    shutil.copy(f"{init}/model.safetensors", f"{OUT}/init.safetensors")

    runs = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = LlamaForCausalLM.from_pretrained(init, dtype=dtype, attn_implementation="eager")
        data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r), "attention_mask": torch.ones(SEQ, dtype=torch.long)} for r in rows]
        args = TrainingArguments(
            output_dir=f"{tmp}/trainer", per_device_train_batch_size=BATCH, max_steps=HYPER["steps"],
            learning_rate=HYPER["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=HYPER["weight_decay"], max_grad_norm=HYPER["max_grad_norm"], optim="adamw_torch",
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            train_sampling_strategy="sequential", dataloader_num_workers=0,
        )
        snapshots = Snapshots(model)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[snapshots])
        decayed = set(trainer.get_decay_parameter_names(model))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == HYPER["steps"] and len(snapshots.after) == HYPER["steps"], (logs, len(snapshots.after))
        runs[dtype] = (logs, snapshots.after)

    # The f32 run as the fixture; the f64 run beside it, the exact answer an
    # f32 step is judged against where AdamW's update is ill-conditioned
    # (a gradient entry near eps, 1e-8, where f32 summation noise moves the
    # update by a visible share of the learning rate).
    logs, after = runs[torch.float32]
    logs64, after64 = runs[torch.float64]
    for k, (w32, w64) in enumerate(zip(after, after64), start=1):
        save_file(w32, f"{OUT}/step{k}.safetensors")
        save_file(w64, f"{OUT}/step{k}_f64.safetensors")
        worst = max((w32[n].double() - w64[n]).abs().max().item() for n in w32)
        print(f"step {k}: PyTorch's f32 against its f64, worst weight {worst:.3e}")
    names = sorted(load_file(f"{OUT}/init.safetensors"))
    expected = {
        "seed": SEED, "seq": SEQ, "batch": BATCH, **HYPER,
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "loss_f64": [h["loss"] for h in logs64],
        "grad_norm_f64": [h["grad_norm"] for h in logs64],
        "not_decayed": sorted(n for n in names if n not in decayed),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    with open(f"{OUT}/expected.json", "w") as f:
        json.dump(expected, f, indent=2)
    print(json.dumps({k: expected[k] for k in ("loss", "grad_norm", "not_decayed")}, indent=1))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
