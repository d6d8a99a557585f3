#!/usr/bin/env python3
"""Build the reward-model fixtures (pairwise Bradley-Terry training of a
sequence-classification head) from TRL's own RewardTrainer, for hlo-train's
Rust tests.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets,
accelerate, safetensors and PyTorch are installed (made with torch 2.9.1 run
on CPU, trl 1.16.0, transformers 5.24.0, peft 0.21.2, accelerate 1.15.0,
datasets 5.2.0); it needs no GPU and no network, and takes about 10 seconds:

    python3 scripts/make_reward_fixtures.py

(e.g. `PYTHONPATH=DIR python3 scripts/make_reward_fixtures.py` with the
packages installed under DIR, as for the other TRL fixture scripts.) Two runs
write byte-identical files on the machine that made them; elsewhere the f32
numbers can move by an ulp or so.

It reads, and does not change, the tiny f32 causal model
tests/fixtures/llama/gqa_llama3 (Llama, hidden 32, 2 layers, 4 heads / 2 KV
heads, vocab 128) and the tokenizer tests/fixtures/preference/tokenizer/
(BOS "<|begin_of_text|>" id 0, added in front by its template; EOS
"<|end_of_text|>" id 1, never added; no pad token, so RewardTrainer pads
with EOS, id 1; printable ASCII byte b (33..126) is id b - 31; the strings
below are chosen so that none of its merges applies, every merged token
having an id >= 258, outside the model's vocabulary). It writes
tests/fixtures/reward/ (about 500 KB):

  seqcls/               the sequence-classification model RewardTrainer
                        builds from the causal checkpoint (it calls
                        set_seed(42), then
                        AutoModelForSequenceClassification.from_pretrained(
                        gqa_llama3, num_labels=1, dtype float32)), saved by
                        save_pretrained BEFORE training: config.json
                        (architectures ["LlamaForSequenceClassification"],
                        id2label {"0": "LABEL_0"}, pad_token_id 1 as TRL sets
                        it = the tokenizer's pad = EOS; bos_token_id 1 and
                        eos_token_id 2 are still the causal config's:
                        transformers' Trainer aligns them to the tokenizer's,
                        0 and 1, only when train() starts; use_cache false,
                        set by Trainer.__init__ from args.use_cache; no
                        num_labels key: transformers derives it from
                        id2label) and
                        model.safetensors (the causal weights less lm_head,
                        plus the new random head score.weight [1, 32] =
                        torch.manual_seed(42) then normal_(0, 0.02), checked).
                        Every case starts from this folder (checked equal to
                        TRL's own model, and to an independent set_seed(42) +
                        from_pretrained).
  adapter_fresh/        the PEFT adapter RewardTrainer makes from the cases'
                        peft_config (LoRA r 4, alpha 8, q_proj/v_proj,
                        dropout 0, task_type "SEQ_CLS") on seqcls/, saved
                        before training (README.md removed): lora_A
                        kaiming-uniform from the RNG right after TRL's
                        set_seed(42), lora_B = 0, and the score module (PEFT
                        puts "classifier" and "score" in modules_to_save for
                        SEQ_CLS) saved as base_model.model.score.weight, a
                        copy of seqcls's score.weight. Every LoRA case starts
                        from it (checked); adapter_config.json says
                        task_type "SEQ_CLS", modules_to_save ["classifier",
                        "score"], target_modules ["v_proj", "q_proj"],
                        base_model_name_or_path null.
  pairs_ids.jsonl       8 pre-tokenized pairs {"chosen_ids", "rejected_ids"}
                        (TRL's processed format: with both columns present it
                        skips EOS-adding and tokenization; only the max_length
                        filter runs). Lengths 3..9, every sequence starts with
                        BOS 0; some end with EOS 1 (= the pad id, so the model
                        pools at the token before it), some do not; id 1
                        nowhere else (PAIRS_IDS below).
  pairs_ids_margin.jsonl  the same with a "margin" float per row (MARGINS).
  pairs_text.jsonl      8 string pairs {"prompt", "chosen", "rejected"}
                        (TEXT_ROWS; row 4's chosen already ends with the EOS
                        text, so TRL appends none to it).
  merged/               PEFT merge_and_unload of lora.sgd's model after its
                        last step, saved by save_pretrained (a
                        LlamaForSequenceClassification folder, f32; its score
                        is the trained modules_to_save copy; config
                        bos_token_id 0 / eos_token_id 1 as the Trainer aligned
                        them, pad_token_id 1).
  expected.json         per case (schema below), "scores" and "_meta"
  expected.safetensors  "<case>.step<k>.<key>": the trained state after
                        optimizer step k (f32): for the LoRA cases every
                        tensor of the adapter, keyed as
                        adapter_model.safetensors writes them
                        (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight,
                        ..., base_model.model.score.weight); for full.sgd
                        every parameter under its HF checkpoint name
                        (model.embed_tokens.weight, ..., score.weight; all of
                        them change)
  FORMULAS.md           what TRL 1.16's RewardTrainer computes, exactly
                        (FORMULAS below)

Cases (RewardTrainer on the CPU, f32, eager attention; start seqcls/):
  lora.sgd      pairs_ids.jsonl, LoRA (adapter_fresh), optim "sgd" lr 0.1
  lora.adamw    the same, optim "adamw_torch" (betas (0.9, 0.999), eps
                1e-8) lr 1e-3
  lora.margin   pairs_ids_margin.jsonl, as lora.sgd
  lora.center   center_rewards_coefficient 0.01, as lora.sgd
  lora.text     pairs_text.jsonl (TRL tokenizes it), as lora.sgd
  full.sgd      pairs_ids.jsonl, no PEFT: every weight trained (score
                included), optim "sgd" lr 0.01
Every case: per_device_train_batch_size 4 (pairs; a step's batch is 8 rows,
the 4 chosen then the 4 rejected), gradient_accumulation_steps 1, max_steps 2
(= one epoch of the 8 pairs), train_sampling_strategy "sequential" (NOT the
TrainingArguments default "random": with it the batches are a seeded
permutation, recorded in _meta; "sequential" makes step 1 pairs 0-3 and step
2 pairs 4-7, checked), seed 42, max_grad_norm 0 (no clipping; TRL's default
1.0), lr_scheduler "constant", warmup 0, weight_decay 0, logging_steps 1,
report_to "none", bf16 False (RewardConfig's default is True),
gradient_checkpointing False (default True), disable_dropout True (default),
max_length 1024 (RewardConfig's default; no row is filtered),
center_rewards_coefficient None unless said, pad_to_multiple_of "auto" (None
off Neuron), use_cpu.

expected.json, per case:
  "settings"       trainer, data (file name, relative to
                   tests/fixtures/reward/), margin_column (bool), start
                   (seqcls/), adapter (adapter_fresh/ or null), peft (LoRA
                   settings or null = full finetuning), trained ("lora+score"
                   or "all"), per_device_train_batch_size, max_steps, optim,
                   learning_rate, center_rewards_coefficient, max_length,
                   train_sampling_strategy, seed, max_grad_norm,
                   lr_scheduler_type, warmup_steps, weight_decay,
                   gradient_accumulation_steps, logging_steps, bf16,
                   gradient_checkpointing, disable_dropout, dtype,
                   attn_implementation, pad_token_id
  "order"          per step, the indices (0-based, file order) of the pairs
                   in its batch: [[0, 1, 2, 3], [4, 5, 6, 7]]
  "rewards_start"  {"chosen": [8], "rejected": [8]}: every pair's rewards
                   from seqcls/ before training (f32, TRL's collator, the
                   training batches), file order
  "steps"          one per optimizer step: {"step": k, "loss": what
                   compute_loss returned, "grad_norm": as logged, "logged":
                   EVERY value TRL logged at step k (loss, grad_norm,
                   learning_rate, epoch, num_tokens, min_reward, mean_reward,
                   max_reward, accuracy, margin; no timing key is logged per
                   step in 1.16), "rewards": {"chosen": [4], "rejected": [4]}
                   the f32 rewards of the step's batch in compute_loss
                   (before the step's update), "pooled_index": {"chosen",
                   "rejected"} the position each row is read at,
                   "batch_length": the padded length}
  "tokenized"      (lora.text only) {"chosen_ids": [8 lists],
                   "rejected_ids": [8 lists]}: TRL's ids of each row after
                   its preprocessing (EOS text appended unless present,
                   prompt + completion tokenized as one string, BOS added)
"scores": the trained lora.sgd model (after step 2) on every row of
pairs_ids.jsonl, each row alone (batch 1, unpadded; what `hlo-train score`
should print): {"case", "after_step", "data", "chosen": [8], "rejected": [8],
"merged": {"dir": "merged", "chosen", "rejected"} (the same rows through
AutoModelForSequenceClassification.from_pretrained(merged/)),
"max_abs_diff_merged", "max_abs_diff_batched" (all 16 rows in one padded
batch)}.
"_meta": versions, paths, token ids, the LoRA, RewardConfig /
TrainingArguments defaults (checked against the dataclasses), TRL's
default random order, the adapter's key names and config, the seqcls
config, and the f64 check's largest differences.

Checks, each failing the script: seqcls/ equals TRL's model and an
independent set_seed(42) + from_pretrained (bitwise), and its score equals
manual_seed(42) normal(0, 0.02); adapter_fresh equals an independent
set_seed(42) + get_peft_model and every LoRA case's starting adapter; TRL's
text preprocessing gives BOS + one id per character + EOS (one EOS for row
4); every batch TRL trains on equals the one built by hand from the file
(bitwise: input_ids, attention_mask, margin); no id 1 except trailing; each
case's logged loss equals compute_loss's; the set of logged names is
exactly the recomputed one; and every case is recomputed independently in
f64: HF's LlamaModel in float64 for the hidden states (no PEFT: the LoRA
deltas 2 * B(A x) are added to q_proj / v_proj outputs by forward hooks),
the pooled position and the score product by hand, the loss and metrics of
FORMULAS.md, autograd for the gradient, SGD / AdamW by
fixture_steps.hand_step. The loss, every logged metric, grad_norm, the
rewards of every step and at the start, the state after every step and the
scores must agree with TRL within 1e-5 (|difference| / max(1, |value|); for
tensors the largest entry's), and every chosen/rejected reward difference
is at least 1e-4 from 0 (so the accuracy cannot flip between f32 and f64).
The merged model's scores equal the PEFT model's within 1e-6, as do the
batched ones. HF's Llama in f64 still computes RMSNorm's variance, the RoPE
angles and the softmax partly in f32, so the f64 figures are f64 up to ~1e-8
relative.
"""

import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from fixture_steps import trl_environment

trl_environment()

import torch
from safetensors.torch import load_file, save_file

from fixture_steps import contiguous, finish, hand_step, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
TOKENIZER_DIR = os.path.join(ROOT, "tests", "fixtures", "preference", "tokenizer")
OUT = os.path.join(ROOT, "tests", "fixtures", "reward")
SEQCLS = os.path.join(OUT, "seqcls")
MERGED = os.path.join(OUT, "merged")
ADAPTER_FRESH = os.path.join(OUT, "adapter_fresh")
BOS_ID, EOS_ID = 0, 1
PAD_ID = EOS_ID  # the tokenizer has no pad token: TRL pads with EOS
SEED = 42
BATCH = 4
STEPS = 2
TARGETS = ["q_proj", "v_proj"]
LORA_SCALE = 8 / 4  # lora_alpha / r
TOL = 1e-5
EOS_TEXT = "<|end_of_text|>"

# Lengths 3..9 (chosen 5 9 4 7 4 7 3 8, rejected 6 3 7 8 8 4 5 8); batch 1
# pads to 9, batch 2 to 8. EOS (1) only as the last id, on 9 of 16 rows.
PAIRS_IDS = [
    {"chosen_ids": [0, 40, 41, 42, 1], "rejected_ids": [0, 40, 41, 55, 60, 1]},
    {"chosen_ids": [0, 20, 21, 22, 23, 24, 25, 26, 1], "rejected_ids": [0, 20, 77]},
    {"chosen_ids": [0, 33, 12, 34], "rejected_ids": [0, 33, 12, 35, 36, 37, 1]},
    {"chosen_ids": [0, 70, 71, 72, 73, 74, 1], "rejected_ids": [0, 70, 81, 82, 83, 84, 85, 86]},
    {"chosen_ids": [0, 5, 6, 1], "rejected_ids": [0, 5, 7, 8, 9, 10, 11, 1]},
    {"chosen_ids": [0, 90, 91, 92, 93, 94, 95], "rejected_ids": [0, 90, 3, 1]},
    {"chosen_ids": [0, 44, 1], "rejected_ids": [0, 45, 46, 47, 48]},
    {"chosen_ids": [0, 60, 61, 62, 63, 64, 65, 1], "rejected_ids": [0, 60, 61, 62, 63, 64, 66, 1]},
]
MARGINS = [0.0, 0.5, -0.25, 1.0, 0.75, -0.5, 0.125, 2.0]  # exact in f32
# No merge of the tokenizer applies (checked: one id per character).
TEXT_ROWS = [
    {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    {"prompt": "7*6=", "chosen": "42", "rejected": "41"},
    {"prompt": "ABC?", "chosen": "CBA", "rejected": "X"},
    {"prompt": "Q:", "chosen": "YES" + EOS_TEXT, "rejected": "NO"},
    {"prompt": "{", "chosen": "}", "rejected": "]]"},
    {"prompt": "1<2?", "chosen": "T", "rejected": "F!"},
    {"prompt": "Z", "chosen": "Zz", "rejected": "zZ"},
    {"prompt": "3+3=", "chosen": "6", "rejected": "9"},
]
DATA_FILES = {"ids": "pairs_ids.jsonl", "margin": "pairs_ids_margin.jsonl", "text": "pairs_text.jsonl"}
OPTS = {"sgd": "sgd", "adamw": "adamw_torch"}

CASES = [
    {"name": "lora.sgd", "data": "ids", "lora": True, "opt": "sgd", "lr": 0.1, "center": None},
    {"name": "lora.adamw", "data": "ids", "lora": True, "opt": "adamw", "lr": 1e-3, "center": None},
    {"name": "lora.margin", "data": "margin", "lora": True, "opt": "sgd", "lr": 0.1, "center": None},
    {"name": "lora.center", "data": "ids", "lora": True, "opt": "sgd", "lr": 0.1, "center": 0.01},
    {"name": "lora.text", "data": "text", "lora": True, "opt": "sgd", "lr": 0.1, "center": None},
    {"name": "full.sgd", "data": "ids", "lora": False, "opt": "sgd", "lr": 0.01, "center": None},
]
ORDER = [list(range(k * BATCH, (k + 1) * BATCH)) for k in range(STEPS)]

# TRL 1.16.0's RewardConfig defaults and the TrainingArguments defaults that
# matter here (checked against the dataclasses).
TRL_DEFAULTS = {
    "max_length": 1024, "center_rewards_coefficient": None, "disable_dropout": True, "pad_to_multiple_of": "auto",
    "eos_token": None, "pad_token": None, "dataset_num_proc": None, "model_init_kwargs": None,
    "activation_offloading": False, "learning_rate": 1e-4, "logging_steps": 10, "gradient_checkpointing": True,
    "bf16": None,
}
HF_DEFAULTS = {"max_grad_norm": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 0, "weight_decay": 0.0,
               "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "gradient_accumulation_steps": 1,
               "seed": 42, "data_seed": None, "per_device_train_batch_size": 8, "train_sampling_strategy": "random"}
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time", "total_flos",
               "train_loss")
METRIC_NAMES = {"loss", "grad_norm", "learning_rate", "epoch", "num_tokens", "min_reward", "mean_reward",
                "max_reward", "accuracy", "margin"}

FORMULAS = r"""# Reward modelling (RewardTrainer) in TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/reward_trainer.py: RewardTrainer
__init__, _prepare_dataset, DataCollatorForPreference, compute_loss, log;
reward_config.py; base_config.py; trainer/utils.py pad,
create_model_from_path) with transformers 5.24.0 (modeling_layers.py
GenericForSequenceClassification, trainer.py) and peft 0.21.2
(PeftModelForSequenceClassification), and checked numerically by
scripts/make_reward_fixtures.py: every case of tests/fixtures/reward is
recomputed in f64 from these formulas and agrees with TRL within 1e-5.
B = per_device_train_batch_size (in PAIRS), r(x) the model's scalar reward of
a token sequence x.

## 1. The model and its score head
- `model` a string (path or hub id): TRL calls `set_seed(args.seed)` FIRST,
  then `AutoModelForSequenceClassification.from_pretrained(path,
  num_labels=1, dtype=float32 unless model_init_kwargs says otherwise,
  device_map None on CPU)`. From a causal-LM checkpoint this builds
  `<Arch>ForSequenceClassification`: the decoder (`model.*`) loaded, lm_head
  dropped (UNEXPECTED, silenced by TRL), and a new head
  `score = nn.Linear(hidden, 1, bias=False)` (MISSING, silenced), initialised
  by transformers' `_init_weights`: normal(0, initializer_range = 0.02). For
  the fixture model nothing else draws from the RNG first, so score.weight
  [1, 32] is exactly `torch.manual_seed(42); torch.empty(1, 32).normal_(0,
  0.02)` (checked). tests/fixtures/reward/seqcls is that model saved.
- `model` an instance: used as is (must have config.num_labels == 1, else
  ValueError); `set_seed(args.seed)` still runs at the start of __init__.
- `config.pad_token_id` is set to the tokenizer's pad id (section 3) on the
  model's text config, BEFORE training; the sequence-classification forward
  needs it. (bos/eos ids in the config are those of the checkpoint until
  transformers' Trainer aligns them with the tokenizer when train() starts:
  seqcls/config.json keeps bos 1 / eos 2, merged/config.json has 0 / 1.
  Trainer.__init__ also sets config.use_cache = args.use_cache, False; TRL
  passes use_cache=False to every forward anyway.)
- disable_dropout (default True): every nn.Dropout p set to 0.

## 2. PEFT (peft_config given; the model must not already be a PeftModel)
`get_peft_model(model, peft_config)` after set_seed: LoRA A kaiming-uniform
(a = sqrt(5)), B = 0. With task_type "SEQ_CLS" PEFT builds
PeftModelForSequenceClassification, which APPENDS ["classifier", "score"] to
peft_config.modules_to_save (sets it when None): the `score` Linear is
wrapped in a ModulesToSaveWrapper holding the frozen original
(`score.original_module`) and a trainable copy
(`score.modules_to_save.default`, equal to the original at start) that the
forward uses. Trainable parameters: every lora_A / lora_B and the score
copy; the base is frozen. adapter_model.safetensors names the score copy
`base_model.model.score.weight` (no "modules_to_save.default"), the LoRA
tensors `base_model.model.model.layers.<i>.self_attn.<q|v>_proj.lora_<A|B>.weight`;
adapter_config.json has "task_type": "SEQ_CLS", "modules_to_save":
["classifier", "score"] (a name that matches no module, "classifier" here,
is ignored). Without task_type SEQ_CLS (and no modules_to_save) the head
would stay frozen at its random init: TRL only warns about it in the
docstring. merge_and_unload() folds W + scale * B A into q_proj / v_proj and
replaces the wrapper by the trained copy, giving a plain
<Arch>ForSequenceClassification (tests/fixtures/reward/merged).
LoRA forward: y = W x + (alpha / r) * B (A x) (dropout 0), scale 2 here.

## 3. Tokenizer padding
pad_token = args.pad_token (deprecated) or tokenizer.pad_token or
tokenizer.eos_token; it is written back to the tokenizer. The fixture
tokenizer has no pad, so pad = EOS "<|end_of_text|>", id 1, and
config.pad_token_id = 1.

## 4. Data (`_prepare_dataset`)
- Processed rows: if the dataset has both "chosen_ids" and "rejected_ids"
  (or the legacy "chosen_input_ids"/"rejected_input_ids", renamed with a
  FutureWarning), nothing is added or tokenized: the ids are used verbatim
  (no BOS or EOS added). An optional "margin" column is kept.
- Text rows (standard, not conversational), in order:
  1. EOS: `chosen += eos_token` unless chosen already ends with the EOS
     TEXT; the same for rejected (string operations, before tokenizing);
  2. explicit prompt: chosen = prompt + chosen, rejected = prompt +
     rejected (string concatenation: the prompt and the completion are
     tokenized TOGETHER, so a merge can cross the boundary);
  3. `chosen_ids = tokenizer(chosen)["input_ids"]` (the tokenizer's own
     special tokens: BOS id 0 in front for the fixture tokenizer; the EOS
     text in the string becomes id 1), the same for rejected.
  No "prompt" column: the chosen / rejected strings are used whole (implicit
  prompt). Conversational rows go through the chat template instead.
- Then, for every dataset (processed or not): rows with
  len(chosen_ids) > max_length OR len(rejected_ids) > max_length are DROPPED
  (a filter, not truncation; max_length default 1024; None: no filter).
For the fixture's text rows: ids = [0] + [byte - 31 per character of
prompt + completion] + [1], one EOS even when the completion ended with the
EOS text (row 4).

## 5. Sampling and batching
transformers' Trainer samples with `train_sampling_strategy` (TrainingArguments
default "random": a RandomSampler, seeded by the Trainer / accelerate, so the
order is a permutation fixed by seed 42; RewardConfig keeps that default).
"sequential" keeps the file order; batches are consecutive groups of B pairs
(the last may be smaller). DataCollatorForPreference (B pairs -> 2B rows):
  input_ids      = [chosen_1, ..., chosen_B, rejected_1, ..., rejected_B],
                   each RIGHT-padded with pad_token_id (1 here) to the
                   longest of the 2B rows (pad_to_multiple_of: None off
                   Neuron, 128 there with "auto");
  attention_mask = 1 on each row's own ids (its EOS included), 0 on padding;
  margin         = float32 tensor [B] if the rows have "margin".
No position_ids: HF uses 0..L-1 on every row.

## 6. The forward and the pooled reward
`model(input_ids, attention_mask, use_cache=False)`: the decoder gives
hidden states h[i, t] (causal attention, padding keys masked); the score head
gives s[i, t] = score.weight . h[i, t]; the reward of row i is s[i, p_i] with
  p_i = argmax_t ( t * [input_ids[i, t] != pad_token_id] )
i.e. the RIGHTMOST position whose id differs from pad_token_id, computed from
input_ids, NOT from attention_mask. Consequences:
- a row ending with EOS, when EOS == pad (the fixture, and any tokenizer
  without a pad token), is read at the token BEFORE its EOS: the trailing
  EOS never influences the reward (causal attention), so [.., x, EOS] and
  [.., x] have the same reward; a row not ending in EOS is read at its last
  token;
- trailing runs of several pad-valued ids are all skipped; a pad-valued id
  in the middle of a row does not matter (only the rightmost non-pad);
- a row of only pad ids is read at position 0 (argmax of zeros);
- left padding works the same way.
rewards: logits [2B, 1] -> squeeze -> r_c = the first B (chosen), r_r = the
last B (rejected).

## 7. Loss (`compute_loss`)
  loss = -mean_i logsigmoid(r_c,i - r_r,i)                     (no margin column)
  loss = -mean_i logsigmoid(r_c,i - r_r,i - margin_i)          (margin column)
  if center_rewards_coefficient c is not None:
  loss += c * mean over the B pairs of (r_c,i + r_r,i)^2
(mean over pairs; loss_is_scaled_for_ga False; f32.) The logged loss is this
value (logging_steps 1, gradient_accumulation_steps 1).

## 8. Logged metrics (train; each a list averaged at log time sum / len,
one value per step with logging_steps 1 and no accumulation)
- num_tokens: the running total, over every training step so far, of
  attention_mask.sum() of the batch (chosen and rejected rows, EOS included,
  padding not), gathered over processes, // tp_size; logged as a float
- min_reward, mean_reward, max_reward: min / mean / max over all 2B rewards
  of the batch (chosen and rejected together)
- accuracy: mean_i [r_c,i > r_r,i] (strict; the margin is NOT used)
- margin: mean_i (r_c,i - r_r,i) (the margin column is NOT subtracted)
- and transformers': loss, grad_norm (the global L2 norm of the trainable
  gradients, logged also with max_grad_norm 0: clip_grad_norm_ with inf),
  learning_rate, epoch (= step / steps per epoch)
No per-step timing key is logged by 1.16 (train_runtime etc. only at the
end). Metrics are computed under no_grad from the same forward.

## 9. Optimisation
transformers' Trainer: optim "sgd" = torch.optim.SGD (momentum 0), optim
"adamw_torch" = torch.optim.AdamW (betas (0.9, 0.999), eps 1e-8); weight
decay 0 (every parameter in groups of decay 0); max_grad_norm 0: no
clipping; lr_scheduler "constant". LoRA: lora_A, lora_B and the score copy
are updated; full finetuning: every parameter (embeddings, norms,
projections, score; the lm_head does not exist).

## 10. RewardConfig 1.16 defaults worth knowing
learning_rate 1e-4; logging_steps 10; gradient_checkpointing True; bf16 True
when fp16 is unset; max_length 1024; center_rewards_coefficient None;
disable_dropout True; pad_to_multiple_of "auto"; eos_token None (the
tokenizer's); dataset_num_proc None; activation_offloading False; and the
TrainingArguments ones: train_sampling_strategy "random", max_grad_norm 1.0,
lr_scheduler "linear", warmup 0, weight_decay 0, per_device_train_batch_size
8 (pairs), seed 42.

## 11. The fixture (tests/fixtures/reward)
Batches (train_sampling_strategy "sequential", B = 4): step 1 pairs 0-3
(padded to 9), step 2 pairs 4-7 (padded to 8). Pooled positions (0-based)
on pairs_ids.jsonl: chosen 3 7 3 5 2 6 1 6, rejected 4 2 5 7 6 2 4 6.
"""


# ---------------------------------------------------------------------------
# Helpers.

def rel(path):
    return os.path.relpath(path, ROOT)


def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def load_seqcls(dtype=torch.float32, path=SEQCLS):
    """A sequence-classification folder as the cases load it: eager
    attention, no name (so nothing is fetched by name and PEFT writes
    base_model_name_or_path null)."""
    from transformers import AutoModelForSequenceClassification
    m = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager", dtype=dtype)
    m.name_or_path = None
    return m


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0, bias="none",
                      task_type="SEQ_CLS")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_jsonl(name, rows):
    with open(os.path.join(OUT, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def data_rows(data):
    return read_jsonl(os.path.join(OUT, DATA_FILES[data]))


def pool_index(seq):
    """The position GenericForSequenceClassification reads: the rightmost id
    that is not the pad id (0 if none)."""
    return max([t for t, x in enumerate(seq) if x != PAD_ID], default=0)


def pad_rows(seqs):
    """TRL's collator layout: right-padded with the pad id, mask 1 on ids."""
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD_ID] * (L - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    return ids, attn


def text_ids(row):
    """BOS + one id per character (printable ASCII b -> b - 31) + EOS; a
    completion already ending with the EOS text gets no second EOS."""
    def byte_ids(s):
        assert all(32 < ord(c) < 127 for c in s), s
        return [ord(c) - 31 for c in s]

    def one(c):
        if c.endswith(EOS_TEXT):
            c = c[:-len(EOS_TEXT)]
        return [BOS_ID] + byte_ids(row["prompt"] + c) + [EOS_ID]
    return {"chosen_ids": one(row["chosen"]), "rejected_ids": one(row["rejected"])}


def scaled_diff(a, b):
    """|a - b| / max(1, |a|), for numbers, lists or tensors (the largest
    entry's)."""
    if isinstance(a, torch.Tensor):
        a, b = a.double(), b.double()
        return ((a - b).abs().max() / max(1.0, a.abs().max().item())).item()
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        return max([0.0] + [scaled_diff(x, y) for x, y in zip(a, b)])
    return abs(a - b) / max(1.0, abs(a))


def config_kwargs(c, sampling="sequential"):
    """Every RewardConfig argument a case sets (besides output_dir)."""
    return dict(per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_steps=STEPS, seed=SEED,
                max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                logging_steps=1, report_to="none", bf16=False, fp16=False, gradient_checkpointing=False,
                optim=OPTS[c["opt"]], learning_rate=c["lr"], center_rewards_coefficient=c["center"],
                max_length=1024, train_sampling_strategy=sampling, use_cpu=True, save_strategy="no",
                dataloader_num_workers=0, disable_tqdm=True)


def peft_state(model):
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def base_state_as_checkpoint(pm):
    """The frozen base of a PeftModel under checkpoint names (LoRA tensors
    left out; score = the frozen original); also returns the score copy."""
    out, copy_w = {}, None
    for n, p in pm.get_base_model().named_parameters():
        if "lora_" in n:
            continue
        if n == "score.modules_to_save.default.weight":
            copy_w = p.detach().clone()
            continue
        out[n.replace(".base_layer", "").replace("score.original_module", "score")] = p.detach().clone()
    return out, copy_w


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------
# Inputs.

@step("inputs")
def write_inputs():
    os.makedirs(OUT, exist_ok=True)
    for p in PAIRS_IDS:
        for k in ("chosen_ids", "rejected_ids"):
            s = p[k]
            assert 3 <= len(s) <= 9 and s[0] == BOS_ID and EOS_ID not in s[:-1], s
            assert all(2 <= x <= 95 for x in s[1:-1] + ([s[-1]] if s[-1] != EOS_ID else [])), s
    ends = [p[k][-1] == EOS_ID for p in PAIRS_IDS for k in ("chosen_ids", "rejected_ids")]
    assert any(ends) and not all(ends)
    write_jsonl(DATA_FILES["ids"], PAIRS_IDS)
    write_jsonl(DATA_FILES["margin"], [{**p, "margin": m} for p, m in zip(PAIRS_IDS, MARGINS)])
    write_jsonl(DATA_FILES["text"], TEXT_ROWS)
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)
    # FORMULAS section 11's pooled positions
    got = {k: [pool_index(p[k + "_ids"]) for p in PAIRS_IDS] for k in ("chosen", "rejected")}
    assert got == {"chosen": [3, 7, 3, 5, 2, 6, 1, 6], "rejected": [4, 2, 5, 7, 6, 2, 4, 6]}, got
    tok = tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token) == (BOS_ID, EOS_ID, None)


# ---------------------------------------------------------------------------
# TRL.

def trainer_class():
    """RewardTrainer recording each compute_loss's batch, loss and rewards,
    and the trained state after each optimizer step."""
    from transformers import TrainerCallback
    from trl import RewardTrainer

    class Snap(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kw):
            t = self.trainer
            if t.is_peft:
                t.states.append(peft_state(t.model))
            else:
                t.states.append({n: p.detach().clone() for n, p in t.model.named_parameters()})

    class Reward(RewardTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.records, self.states = [], []
            from accelerate.utils import is_peft_model
            self.is_peft = is_peft_model(self.model)
            self.add_callback(Snap(self))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            batch = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            self.records.append({"batch": batch, "loss": loss.detach().float().item(),
                                 "rewards": outputs.logits.detach().squeeze(-1).clone()})
            return (loss, outputs) if return_outputs else loss
    return Reward


def build_trainer(c, rows, tmp, sampling="sequential", model=None):
    from datasets import Dataset
    from trl import RewardConfig
    args = RewardConfig(output_dir=tmp, **config_kwargs(c, sampling))
    kw = {"peft_config": lora_config()} if c["lora"] else {}
    return trainer_class()(model=load_seqcls() if model is None else model, args=args,
                           train_dataset=Dataset.from_list(rows), processing_class=tokenizer(), **kw)


def check_start(trainer, c):
    """TRL's model before training is seqcls/ (and, LoRA, adapter_fresh/)."""
    want = load_file(os.path.join(SEQCLS, "model.safetensors"))
    if c["lora"]:
        base, score_copy = base_state_as_checkpoint(trainer.model)
        assert same_tensors(base, want), "the trainer's base is not seqcls/"
        assert torch.equal(score_copy, want["score.weight"])
        fresh = load_file(os.path.join(ADAPTER_FRESH, "adapter_model.safetensors"))
        assert same_tensors(peft_state(trainer.model), fresh), "the starting adapter is not adapter_fresh/"
        for n, p in trainer.model.named_parameters():
            assert p.requires_grad == ("lora_" in n or "modules_to_save" in n), (n, p.requires_grad)
    else:
        got = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert same_tensors(got, want), "the trainer's model is not seqcls/"
        assert all(p.requires_grad for p in trainer.model.parameters())
    assert trainer.model.config.pad_token_id == PAD_ID
    assert trainer.processing_class.pad_token_id == PAD_ID


def run_trl(c):
    """The case through RewardTrainer. Returns (trainer, logs per step,
    records per step, states per step, prepared rows)."""
    rows = data_rows(c["data"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(c, rows, tmp)
        check_start(trainer, c)
        prepared = trainer.train_dataset.to_list()
        trainer.train()
    logs = [dict(l) for l in trainer.state.log_history if "loss" in l and "train_loss" not in l]
    assert [l["step"] for l in logs] == list(range(1, STEPS + 1)), logs
    assert len(trainer.records) == STEPS and len(trainer.states) == STEPS
    return trainer, logs, trainer.records, trainer.states, prepared


def start_rewards(rows):
    """seqcls/'s f32 rewards of every pair (eval, TRL's collator, the
    training batches), file order."""
    from trl.trainer.reward_trainer import DataCollatorForPreference
    m = load_seqcls().eval()
    coll = DataCollatorForPreference(pad_token_id=PAD_ID)
    ch, rj = [], []
    with torch.no_grad():
        for idx in ORDER:
            b = coll([{k: rows[i][k] for k in ("chosen_ids", "rejected_ids")} for i in idx])
            r = m(**b, use_cache=False).logits.squeeze(-1)
            ch += r[:len(idx)].tolist()
            rj += r[len(idx):].tolist()
    return {"chosen": ch, "rejected": rj}


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

class F64:
    """seqcls/ in float64 with the trained tensors as f64 leaves: for LoRA
    the adapter (deltas added to q_proj / v_proj by forward hooks, no PEFT)
    and the score weight; for full finetuning every parameter."""

    def __init__(self, lora, start):
        self.m = load_seqcls(torch.float64).eval()
        self.lora = lora
        if lora:
            for p in self.m.parameters():
                p.requires_grad_(False)
            self.params = {k: v.double().clone().requires_grad_(True) for k, v in start.items()}
            for i, layer in enumerate(self.m.model.layers):
                for proj in TARGETS:
                    key = f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_"
                    A, B = self.params[key + "A.weight"], self.params[key + "B.weight"]
                    getattr(layer.self_attn, proj).register_forward_hook(
                        lambda mod, inp, out, A=A, B=B: out + LORA_SCALE * (inp[0] @ A.T) @ B.T)
            self.score = self.params["base_model.model.score.weight"]
            assert len(self.params) == 4 * len(self.m.model.layers) + 1, sorted(self.params)
        else:
            self.params = dict(self.m.named_parameters())
            for p in self.params.values():
                p.requires_grad_(True)
            self.score = self.params["score.weight"]

    def rewards(self, seqs):
        ids, attn = pad_rows(seqs)
        h = self.m.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        idx = torch.tensor([pool_index(s) for s in seqs])
        return h[torch.arange(len(seqs)), idx] @ self.score[0]


def hand(c, rows, start):
    """The case by FORMULAS.md in f64: per step the batch, rewards, loss,
    metrics and state after the step; the start rewards."""
    f = F64(c["lora"], start)
    with torch.no_grad():
        r0c = f.rewards([r["chosen_ids"] for r in rows])
        r0r = f.rewards([r["rejected_ids"] for r in rows])
    keys = list(f.params)
    adam = {k: (torch.zeros_like(f.params[k]), torch.zeros_like(f.params[k])) for k in keys}
    tokens, steps = 0, []
    for k_step, idx in enumerate(ORDER, start=1):
        batch_rows = [rows[i] for i in idx]
        n = len(idx)
        seqs = [r["chosen_ids"] for r in batch_rows] + [r["rejected_ids"] for r in batch_rows]
        ids, attn = pad_rows(seqs)
        batch = {"input_ids": ids, "attention_mask": attn}
        for p in f.params.values():
            p.grad = None
        r = f.rewards(seqs)
        rc, rr = r[:n], r[n:]
        d = rc - rr
        if "margin" in batch_rows[0]:
            margin = torch.tensor([x["margin"] for x in batch_rows], dtype=torch.float32)
            batch["margin"] = margin
            d = d - margin.double()
        loss = -torch.nn.functional.logsigmoid(d).mean()
        if c["center"] is not None:
            loss = loss + c["center"] * ((rc + rr) ** 2).mean()
        loss.backward()
        grads = {k: (f.params[k].grad if f.params[k].grad is not None else torch.zeros_like(f.params[k])).clone()
                 for k in keys}
        tokens += int(attn.sum())
        rd = r.detach()
        diff = (rc - rr).detach()
        metrics = {"loss": loss.item(), "grad_norm": torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item(),
                   "learning_rate": c["lr"], "epoch": k_step / STEPS, "num_tokens": float(tokens),
                   "min_reward": rd.min().item(), "mean_reward": rd.mean().item(), "max_reward": rd.max().item(),
                   "accuracy": (diff > 0).double().mean().item(), "margin": diff.mean().item()}
        hand_step(f.params, grads, c["opt"], c["lr"], k_step, adam)
        steps.append({"batch": batch, "metrics": metrics, "rewards": rd.clone(),
                      "min_gap": diff.abs().min().item(),
                      "after": {k: v.detach().clone() for k, v in f.params.items()},
                      "pooled_index": [pool_index(s) for s in seqs], "length": ids.shape[1]})
    return {"steps": steps, "start": {"chosen": r0c.tolist(), "rejected": r0r.tolist()}, "model": f}


# ---------------------------------------------------------------------------
# Outputs.

@step("seqcls")
def write_seqcls():
    """seqcls/ from RewardTrainer's own string path (set_seed, then
    AutoModelForSequenceClassification.from_pretrained(gqa_llama3,
    num_labels=1)), saved before training; checked against an independent
    load, the manual_seed(42) draw of the score head, and a reload."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, set_seed
    from trl import RewardConfig, RewardTrainer
    with tempfile.TemporaryDirectory() as tmp:
        args = RewardConfig(output_dir=tmp, **config_kwargs(CASES[0]))
        trainer = RewardTrainer(model=MODEL_DIR, args=args, train_dataset=Dataset.from_list(PAIRS_IDS),
                                processing_class=tokenizer())
        model = trainer.model
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == PAD_ID, model.config.pad_token_id
    model.name_or_path = None
    if os.path.exists(SEQCLS):
        shutil.rmtree(SEQCLS)
    model.save_pretrained(SEQCLS)
    trl_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    set_seed(SEED)
    indep = AutoModelForSequenceClassification.from_pretrained(MODEL_DIR, num_labels=1)
    assert same_tensors(trl_sd, {k: v.detach() for k, v in indep.state_dict().items()}), \
        "TRL's model differs from set_seed(42) + from_pretrained(num_labels=1)"
    torch.manual_seed(SEED)
    assert torch.equal(trl_sd["score.weight"], torch.empty(1, 32).normal_(0.0, 0.02)), "score init"
    saved = load_file(os.path.join(SEQCLS, "model.safetensors"))
    assert same_tensors(saved, trl_sd), "seqcls/model.safetensors"
    causal = load_file(os.path.join(MODEL_DIR, "model.safetensors"))
    assert set(saved) == (set(causal) - {"lm_head.weight"}) | {"score.weight"}, sorted(set(saved) ^ set(causal))
    assert all(torch.equal(saved[k], causal[k]) for k in saved if k != "score.weight")
    assert saved["score.weight"].shape == (1, 32) and saved["score.weight"].dtype == torch.float32
    with open(os.path.join(SEQCLS, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["pad_token_id"] == PAD_ID, cfg
    assert cfg["id2label"] == {"0": "LABEL_0"}, cfg
    re = load_seqcls()
    assert same_tensors({k: v.detach() for k, v in re.state_dict().items()}, trl_sd)
    print(f"seqcls: {sorted(os.listdir(SEQCLS))}, score.weight std {saved['score.weight'].std():.4f}; config "
          f"pad {cfg['pad_token_id']} bos {cfg.get('bos_token_id')} eos {cfg.get('eos_token_id')}")


@step("adapter_fresh")
def write_adapter_fresh():
    """adapter_fresh/: lora.sgd's trainer's adapter before training, checked
    against set_seed(42) + get_peft_model."""
    from peft import get_peft_model
    from transformers import set_seed
    c = CASES[0]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(c, data_rows(c["data"]), tmp)
        pm = trainer.model
    assert type(pm).__name__ == "PeftModelForSequenceClassification", type(pm)
    assert pm.peft_config["default"].modules_to_save == ["classifier", "score"]
    if os.path.exists(ADAPTER_FRESH):
        shutil.rmtree(ADAPTER_FRESH)
    pm.save_pretrained(ADAPTER_FRESH)
    os.remove(os.path.join(ADAPTER_FRESH, "README.md"))
    saved = load_file(os.path.join(ADAPTER_FRESH, "adapter_model.safetensors"))
    assert same_tensors(saved, peft_state(pm))
    set_seed(SEED)
    indep = get_peft_model(load_seqcls(), lora_config())
    assert same_tensors(peft_state(indep), saved), "TRL's fresh adapter differs from set_seed + get_peft_model"
    seq = load_file(os.path.join(SEQCLS, "model.safetensors"))
    assert torch.equal(saved["base_model.model.score.weight"], seq["score.weight"])
    assert all(not v.any() for k, v in saved.items() if "lora_B" in k)
    with open(os.path.join(ADAPTER_FRESH, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["task_type"] == "SEQ_CLS" and cfg["modules_to_save"] == ["classifier", "score"], cfg
    assert cfg["base_model_name_or_path"] is None, cfg["base_model_name_or_path"]
    print(f"adapter_fresh: keys {sorted(saved)}; modules_to_save {cfg['modules_to_save']}, target_modules "
          f"{cfg['target_modules']}")


def check_batches(name, records, h_steps):
    for k, (rec, hs) in enumerate(zip(records, h_steps), start=1):
        assert rec["batch"].keys() == hs["batch"].keys(), (name, k, sorted(rec["batch"]), sorted(hs["batch"]))
        for key, v in hs["batch"].items():
            assert rec["batch"][key].dtype == v.dtype and torch.equal(rec["batch"][key], v), (name, k, key)


def run_case(c):
    name = c["name"]
    trainer, logs, records, states, prepared = run_trl(c)
    rows = [{k: r[k] for k in ("chosen_ids", "rejected_ids", "margin") if k in r} for r in prepared]
    if c["data"] == "text":
        assert rows == [text_ids(r) for r in TEXT_ROWS], rows
        assert all(x < 96 for r in rows for s in r.values() for x in s)
    else:
        assert rows == data_rows(c["data"]), "TRL changed the processed rows"
    start = load_file(os.path.join(ADAPTER_FRESH, "adapter_model.safetensors")) if c["lora"] else None
    h = hand(c, rows, start)
    check_batches(name, records, h["steps"])
    r_start = start_rewards(rows)
    diffs = {"loss": 0.0, "metrics": 0.0, "rewards": 0.0, "rewards_start": 0.0, "state": 0.0}
    diffs["rewards_start"] = max(scaled_diff(h["start"][k], r_start[k]) for k in r_start)
    tensors, entry_steps = {}, []
    min_gap = min(min(s["min_gap"] for s in h["steps"]), min(abs(a - b) for a, b in zip(*h["start"].values())))
    assert min_gap > 1e-4, (name, "a chosen and a rejected reward within 1e-4", min_gap)
    for k, (log, rec, st, hs) in enumerate(zip(logs, records, states, h["steps"]), start=1):
        logged = {key: v for key, v in log.items() if key not in TIMING_KEYS and key != "step"}
        assert set(logged) == METRIC_NAMES == set(hs["metrics"]), (name, k, sorted(logged))
        assert logged["loss"] == rec["loss"], (name, k, logged["loss"], rec["loss"])
        diffs["loss"] = max(diffs["loss"], scaled_diff(hs["metrics"]["loss"], rec["loss"]))
        diffs["metrics"] = max(diffs["metrics"], max(scaled_diff(hs["metrics"][m], logged[m]) for m in logged))
        diffs["rewards"] = max(diffs["rewards"], scaled_diff(hs["rewards"], rec["rewards"]))
        assert st.keys() == hs["after"].keys(), (name, sorted(set(st) ^ set(hs["after"])))
        for key, v in st.items():
            diffs["state"] = max(diffs["state"], scaled_diff(hs["after"][key], v))
            tensors[f"{name}.step{k}.{key}"] = v
        n = len(ORDER[k - 1])
        rw = rec["rewards"].tolist()
        entry_steps.append({"step": k, "loss": rec["loss"], "grad_norm": logged["grad_norm"], "logged": logged,
                            "rewards": {"chosen": rw[:n], "rejected": rw[n:]},
                            "pooled_index": {"chosen": hs["pooled_index"][:n], "rejected": hs["pooled_index"][n:]},
                            "batch_length": hs["length"]})
    # Every trained tensor moves (full: all parameters; LoRA: A from step 2)
    last = states[-1]
    first = start if c["lora"] else load_file(os.path.join(SEQCLS, "model.safetensors"))
    unchanged = sorted(k for k in last if torch.equal(last[k], first[k]))
    assert not unchanged, (name, "unchanged tensors", unchanged)
    # Step 1 of a LoRA case (B = 0) and of full.sgd sees seqcls's rewards
    assert scaled_diff(torch.tensor(r_start["chosen"][:BATCH] + r_start["rejected"][:BATCH]),
                       records[0]["rewards"]) < 1e-6, name
    print(f"{name:12s} loss " + " ".join(f"{s['loss']:.7f}" for s in entry_steps) +
          f"  acc {[s['logged']['accuracy'] for s in entry_steps]}  f64 check: " +
          "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()) + f"  (|r_c - r_r| >= {min_gap:.1e})")
    entry = {"settings": settings_of(c), "order": ORDER, "rewards_start": r_start, "steps": entry_steps}
    if c["data"] == "text":
        entry["tokenized"] = {k: [r[k] for r in rows] for k in ("chosen_ids", "rejected_ids")}
    return name, entry, tensors, diffs, trainer, h


def settings_of(c):
    kw = config_kwargs(c)
    return {"trainer": "RewardTrainer", "data": DATA_FILES[c["data"]], "margin_column": c["data"] == "margin",
            "start": rel(SEQCLS), "adapter": rel(ADAPTER_FRESH) if c["lora"] else None,
            "peft": {"type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0,
                     "bias": "none", "task_type": "SEQ_CLS", "modules_to_save": ["classifier", "score"]}
            if c["lora"] else None,
            "trained": "lora+score" if c["lora"] else "all",
            **{k: kw[k] for k in ("per_device_train_batch_size", "max_steps", "optim", "learning_rate",
                                  "center_rewards_coefficient", "max_length", "train_sampling_strategy", "seed",
                                  "max_grad_norm", "lr_scheduler_type", "warmup_steps", "weight_decay",
                                  "gradient_accumulation_steps", "logging_steps", "bf16",
                                  "gradient_checkpointing")},
            "disable_dropout": True, "dtype": "float32", "attn_implementation": "eager", "pad_token_id": PAD_ID}


def row_scores(model, rows):
    """Each row's reward alone (batch 1, unpadded), f32; and all rows in one
    padded batch."""
    ch, rj = [], []
    with torch.no_grad():
        for r in rows:
            for key, out in (("chosen_ids", ch), ("rejected_ids", rj)):
                ids = torch.tensor([r[key]])
                out.append(model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                           .logits[0, 0].item())
        ids, attn = pad_rows([r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows])
        batched = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.squeeze(-1)
    return {"chosen": ch, "rejected": rj}, batched


def scores(trainer, h):
    """lora.sgd's trained model on pairs_ids.jsonl; merged/ and its scores."""
    rows = data_rows("ids")
    pm = trainer.model
    pm.eval()
    sc, batched = row_scores(pm, rows)
    d_batched = scaled_diff(torch.tensor(sc["chosen"] + sc["rejected"]), batched)
    assert d_batched < 1e-6, d_batched
    f = h["model"]
    with torch.no_grad():
        want = {"chosen": f.rewards([r["chosen_ids"] for r in rows]).tolist(),
                "rejected": f.rewards([r["rejected_ids"] for r in rows]).tolist()}
    d_f64 = max(scaled_diff(want[k], sc[k]) for k in sc)
    merged = copy.deepcopy(pm).merge_and_unload()
    assert type(merged).__name__ == "LlamaForSequenceClassification", type(merged)
    final = peft_state(pm)
    assert torch.equal(merged.score.weight.detach(), final["base_model.model.score.weight"])
    merged.name_or_path = None
    if os.path.exists(MERGED):
        shutil.rmtree(MERGED)
    merged.save_pretrained(MERGED)
    with open(os.path.join(MERGED, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["pad_token_id"] == PAD_ID, cfg
    from transformers import AutoModelForSequenceClassification
    reloaded = AutoModelForSequenceClassification.from_pretrained(MERGED).eval()
    assert reloaded.dtype == torch.float32
    msc, _ = row_scores(reloaded, rows)
    d_merged = max(scaled_diff(sc[k], msc[k]) for k in sc)
    assert d_merged < 1e-6, d_merged
    print(f"scores (lora.sgd after step {STEPS}): chosen {['%.5f' % x for x in sc['chosen']]} rejected "
          f"{['%.5f' % x for x in sc['rejected']]}; f64 check {d_f64:.1e}, merged/ differs by {d_merged:.1e}, "
          f"batched by {d_batched:.1e}; merged/ {sorted(os.listdir(MERGED))} (bos {cfg.get('bos_token_id')} eos "
          f"{cfg.get('eos_token_id')} pad {cfg['pad_token_id']})")
    entry = {"case": "lora.sgd", "after_step": STEPS, "data": DATA_FILES["ids"],
             "computed": "each row alone: batch 1, no padding, attention_mask all ones",
             "chosen": sc["chosen"], "rejected": sc["rejected"],
             "merged": {"dir": "merged", "chosen": msc["chosen"], "rejected": msc["rejected"]},
             "max_abs_diff_merged": d_merged, "max_abs_diff_batched": d_batched}
    return entry, d_f64


def random_order():
    """The pair order TRL trains in with TrainingArguments' default
    train_sampling_strategy "random" (lora.sgd's settings otherwise)."""
    rows = data_rows("ids")
    c = CASES[0]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(c, rows, tmp, sampling="random")
        trainer.train()
    order = []
    for rec in trainer.records:
        ids = rec["batch"]["input_ids"].tolist()
        n, L = len(ids) // 2, len(ids[0])

        def padded(s):
            return s + [PAD_ID] * (L - len(s))
        found = []
        for j in range(n):
            m = [i for i, p in enumerate(rows)
                 if padded(p["chosen_ids"]) == ids[j] and padded(p["rejected_ids"]) == ids[n + j]]
            assert len(m) == 1, (j, m)
            found.append(m[0])
        order.append(found)
    assert sorted(sum(order, [])) == list(range(len(rows))), order
    print("TRL's order with train_sampling_strategy 'random' (seed 42):", order)
    return order


@step("cases")
def cases():
    import accelerate, datasets, peft, transformers, trl
    from trl import RewardConfig
    defaults = {f.name: f.default for f in dataclasses.fields(RewardConfig)}
    for k, v in {**TRL_DEFAULTS, **HF_DEFAULTS}.items():
        assert defaults[k] == v, ("default differs", k, defaults[k], v)
    expected, tensors = {}, {}
    worst = {}
    sgd = None
    for c in CASES:
        name, entry, after, diffs, trainer, h = run_case(c)
        for k, v in diffs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        expected[name] = entry
        tensors.update(after)
        if name == "lora.sgd":
            sgd = (trainer, h)
    # lora.center and lora.margin differ from lora.sgd from step 1 on
    for other in ("lora.center", "lora.margin"):
        assert expected[other]["steps"][0]["loss"] != expected["lora.sgd"]["steps"][0]["loss"], other
    expected["scores"], worst["scores"] = scores(*sgd)
    order_random = random_order()
    with open(os.path.join(ADAPTER_FRESH, "adapter_config.json")) as f:
        adapter_cfg = json.load(f)
    with open(os.path.join(SEQCLS, "config.json")) as f:
        seq_cfg = json.load(f)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "accelerate": accelerate.__version__,
                     "datasets": datasets.__version__},
        "paths": "relative to the repository root, but settings.data (relative to tests/fixtures/reward)",
        "causal_model": rel(MODEL_DIR), "tokenizer": rel(TOKENIZER_DIR), "seqcls": rel(SEQCLS),
        "adapter_fresh": rel(ADAPTER_FRESH), "merged": rel(MERGED),
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "pooling": "reward = score(h[i, p_i]), p_i = rightmost position with input_ids != pad_token_id (1), "
                   "0 if none",
        "seqcls_config": {**{k: seq_cfg.get(k) for k in ("architectures", "id2label", "label2id", "pad_token_id",
                                                         "bos_token_id", "eos_token_id", "use_cache", "dtype")},
                          "num_labels": len(seq_cfg["id2label"])},
        "score_init": "score.weight [1, 32] = torch.manual_seed(42); torch.empty(1, 32).normal_(0, 0.02) (checked)",
        "lora": {"r": 4, "lora_alpha": 8, "scale": LORA_SCALE, "target_modules": TARGETS, "dropout": 0.0,
                 "task_type": "SEQ_CLS"},
        "adapter_keys": sorted(load_file(os.path.join(ADAPTER_FRESH, "adapter_model.safetensors"))),
        "adapter_score_key": "base_model.model.score.weight (in the PeftModel: "
                             "base_model.model.score.modules_to_save.default.weight, trainable, next to the frozen "
                             "base_model.model.score.original_module.weight)",
        "adapter_config": {k: adapter_cfg[k] for k in ("task_type", "modules_to_save", "target_modules", "r",
                                                       "lora_alpha", "lora_dropout", "bias",
                                                       "base_model_name_or_path", "peft_type")},
        "max_length_default": TRL_DEFAULTS["max_length"],
        "trl_reward_defaults": TRL_DEFAULTS, "trainingarguments_defaults": HF_DEFAULTS,
        "order_default_random": {"train_sampling_strategy": "random (the TrainingArguments default)",
                                 "seed": SEED, "order": order_random,
                                 "note": "pair indices per step with lora.sgd's settings but the default sampler; "
                                         "the cases use 'sequential' (file order)"},
        "f64_check_max_scaled_diff": worst,
        "f64_check": "|TRL - f64| / max(1, |f64|), tensors by their largest entry",
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected.safetensors"))
    print("f64 check, worst over all cases:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert all(v < TOL for v in worst.values()), worst


@step("tidy")
def tidy():
    """Files readable by all (safetensors creates them 0600), no absolute
    path in any of them; prints the sizes."""
    total = 0
    for d, _, files in os.walk(OUT):
        for fn in sorted(files):
            p = os.path.join(d, fn)
            os.chmod(p, 0o644)
            with open(p, "rb") as f:
                assert ROOT.encode() not in f.read(), ("absolute path in", p)
            total += os.path.getsize(p)
            print(f"  {rel(p):55s} {os.path.getsize(p):8d}")
    print(f"  total {total} bytes")
    assert total < 1_000_000, total


if __name__ == "__main__":
    import accelerate, datasets, peft, safetensors, tokenizers, transformers, trl
    print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "peft",
          peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "tokenizers",
          tokenizers.__version__, "safetensors", safetensors.__version__)
    if sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    write_inputs()
    write_seqcls()
    write_adapter_fresh()
    cases()
    tidy()
    finish()
