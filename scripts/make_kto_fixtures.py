#!/usr/bin/env python3
"""Build the KTO fixtures (loss_type "kto" and "apo_zero_unpaired") from
TRL's own KTOTrainer, for hlo-train's Rust tests.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets,
accelerate, safetensors and PyTorch are installed (made with torch 2.9.1 run
on CPU, trl 1.16.0, transformers 5.24.0, peft 0.21.2, datasets 5.2.0); it
needs no GPU and no network:

    python3 scripts/make_kto_fixtures.py                 # all but expected_precompute.*, expected_full.*
    python3 scripts/make_kto_fixtures.py --precompute    # expected_precompute.* only
    python3 scripts/make_kto_fixtures.py --full          # expected_full.* only

(e.g. `PYTHONPATH=DIR python3 scripts/make_kto_fixtures.py` with the
packages of scripts/make_preference_fixtures.py installed in DIR.) Two runs
write byte-identical files; elsewhere the f32 numbers can move by an ulp or
so, as that script's docstring says.

It reads, and does not change, the tiny f32 model
tests/fixtures/llama/gqa_llama3 (vocab 128) and, from the preference
fixtures, tests/fixtures/preference/tokenizer/ (BOS "<|begin_of_text|>" id 0,
EOS "<|end_of_text|>" id 1, no pad token, so KTOTrainer pads with EOS id 1;
printable ASCII bytes are ids 2..95; the strings below tokenize without
merges), tests/fixtures/preference/adapters/fresh (the adapter TRL creates
from peft_config with seed 42: lora_A kaiming-uniform, lora_B = 0; checked
against KTOTrainer's own), tests/fixtures/preference/adapters/init (A and B
~ N(0, 0.1)), and tests/fixtures/preference/data.jsonl / data_ids.jsonl (4
preference pairs, the .paired case) and tests/fixtures/preference/adapters/ref
(A and B ~ N(0, 0.1), the reference of the expected_ref cases). It writes
tests/fixtures/kto/ (about 140 KB, plus 450 KB of expected_full.*):

  data.jsonl            4 unpaired string rows {"prompt","completion","label"}
                        (ROWS; labels true, false, true, false; no BOS/EOS in
                        the text: TRL adds them)
  data_ids.jsonl        the same rows pre-tokenized {"prompt_ids",
                        "completion_ids","label"}: the ids KTOTrainer's own
                        _prepare_dataset derives from data.jsonl (BOS first
                        in prompt_ids, EOS last in completion_ids), to be used
                        verbatim (nothing added); no KL columns (the KL rows
                        are made from these by the rotation of FORMULAS.md)
  expected.json         per case: "settings" (every KTOConfig setting that
                        matters, the data, the adapters, the reference),
                        "loss" (step 1, before the update, as compute_loss
                        returned it), "logged_loss", "metrics" (every value
                        TRL logged for step 1 but loss/epoch/step), and
                        "rows_f64" (per row of the step-1 batch, in batch
                        order, hand-computed in f64: label, policy_sum and
                        ref_sum (completion log-prob sums), completion_tokens,
                        and for loss "kto" kl_policy_sum, kl_ref_sum and
                        kl_completion_tokens of the row's KL sequence);
                        "_meta": versions, LoRA, token ids, the worst f64
                        differences. Paths are relative to the repo root.
  expected.safetensors  per case, "<case>.<PEFT key>": the adapter after the
                        one optimizer step (f32, keys as
                        adapter_model.safetensors writes them)
  expected_ref.json,    the same for REF_CASES (below), whose reference
  expected_ref.safetensors  differs from the policy at step 1
  expected_precompute.json,  the same for PRECOMPUTE_CASES (below,
  expected_precompute.safetensors  precompute_ref_log_probs=True), written
                        only by --precompute (which writes nothing else;
                        it reads expected.json / expected_ref.json); each
                        case also has "precomputed" and "vs_non_precomputed"
  expected_full.json,   the same for FULL_CASES (below: full finetuning,
  expected_full.safetensors  precompute_ref_log_probs=True), written only by
                        --full (which writes and reads nothing else of
                        tests/fixtures/kto but data_ids.jsonl); the
                        safetensors hold every weight after the step
                        (below)
  FORMULAS.md           what TRL 1.16's KTOTrainer computes, exactly, with
                        the data layout (FORMULAS below)

Cases are named <loss>.<start>.<opt>[.<variant>]:
  loss    kto: loss_type "kto"; apo: loss_type "apo_zero_unpaired" (no KL
          rows, kl logged as 0).
  start   fresh: the trainer wraps the base with peft_config (seed 42; the
                 reference is the base, adapter disabled);
          init:  the trainer gets a PeftModel loaded (trainable) from
                 preference/adapters/init and no ref_model: KTOTrainer adds
                 a second adapter "ref" with the same LoraConfig, copies
                 "default" into it (frozen) and runs the reference forward
                 with "ref" active (checked).
  opt     sgd:   optim "sgd" (torch.optim.SGD, momentum 0), lr 0.1;
          adamw: optim "adamw_torch" (betas (0.9, 0.999), eps 1e-8), lr 1e-3.
  all 8 combinations, plus
  kto.fresh.sgd.weights  desirable_weight 1.5, undesirable_weight 0.5;
  kto.fresh.sgd.paired   data tests/fixtures/preference/data.jsonl (4 pairs;
                         TRL unpairs them into 8 rows: the chosen of every
                         pair, then the rejected of every pair), batch 8; its
                         ids run feeds preference/data_ids.jsonl unpaired the
                         same way.
Every case: beta 0.1, desirable/undesirable_weight 1.0 (but .weights),
weight_decay 0, lr_scheduler "constant", warmup 0, max_grad_norm 0 (no
clipping; TRL's default is 1.0), max_steps 1, per_device_train_batch_size 4
(8 for .paired: every row in the one batch), gradient_accumulation_steps 1,
train_sampling_strategy "sequential" (KTOConfig's default), seed 42, bf16
False (KTOConfig's default is True), gradient_checkpointing False (default
True), use_cpu, f32, max_length 1024 (default), report_to "none". LoRA: r 4,
lora_alpha 8 (scale 2), q_proj and v_proj, dropout 0, no bias.

Every case runs twice: from the strings (TRL's tokenization) and from the ids
(TRL 1.16 has no pre-tokenized path: _prepare_dataset calls extract_prompt /
tokenizes strings, so for that run the script's subclass returns the id rows
verbatim with only TRL's KL rotation added, by its own code). The two must
agree bitwise (loss, logged metrics, adapters before and after, the whole
first batch including the KL tensors), else the script fails. Each case is
then recomputed independently in f64 (plain transformers + PEFT forward of
the batch built from the id rows, the formulas of FORMULAS.md, autograd for
the gradient, SGD p - lr*g, AdamW step 1 p - lr*g/(|g|+eps)); the batch it
builds must equal TRL's bitwise, and the loss, metrics and adapter must agree
to 1e-5 relative (|d| / max(|value|, 1); adapters relative to the tensor's
largest entry), else the script fails.

With these starts the policy equals the reference at step 1 (fresh: lora_B
= 0; init: "ref" is a copy), so every log-ratio is 0, kl is 0 and the step-1
loss is 0.5 in every case (kto: 1 - sigmoid(0); apo: 1 - sigmoid(0) and
sigmoid(0); .weights: (1.5 + 1.5 + 0.5 + 0.5) * 0.5 / 4). The cases differ
in the gradient, hence the adapter after the step and grad_norm, and in the
logps/logits/entropy metrics; but at r = 0 (kl detached, 0) "kto" and
"apo_zero_unpaired" have the same gradient, so kto.X and apo.X are equal.
Hence expected_ref.json / expected_ref.safetensors (same layout), the cases
  kto.ref.sgd, kto.ref.adamw, apo.ref.sgd, kto.ref.sgd.paired
with every setting of the case of the same name with start fresh, but the
policy preference/adapters/fresh loaded as a trainable PeftModel (no
peft_config: the same tensors, and TRL then makes its "ref" adapter) and the
reference preference/adapters/ref: TRL 1.16 has no option naming a reference
adapter, so after the trainer is built the script overwrites the tensors of
TRL's frozen "ref" copy with adapters/ref, and TRL's own
use_adapter(model, "ref") runs the reference forward with it (as the
preference fixtures' "ref" start). There r != 0; on data.jsonl the kl is
positive (0.515, the unclamped path), on the .paired data mean(KL_policy -
KL_ref) is negative (-0.449), so kl is clamped to 0.

With --precompute the script runs only PRECOMPUTE_CASES, into
expected_precompute.json / expected_precompute.safetensors (same layout):
  kto.fresh.sgd.precompute, kto.ref.sgd.precompute, apo.ref.sgd.precompute,
  kto.ref.adamw.precompute
each the case of the same name without ".precompute" (expected.json for
start fresh, expected_ref.json for start ref) with KTOConfig
precompute_ref_log_probs=True (precompute_ref_batch_size None: TRL
precomputes with per_device_train_batch_size, 4; checked). TRL precomputes
the reference log-probs at the end of KTOTrainer.__init__ (section 10 of
FORMULAS.md), after it has made its "ref" adapter, so for start "ref" the
script's subclass overrides _precompute_ref_logps to overwrite "ref" with
adapters/ref first (installing it after the trainer is built, as the
expected_ref cases do, would leave precomputed values of the fresh copy);
the script checks it: the precomputed sums must match the f64 reference
sums of adapters/ref to 1e-5 relative and differ from the policy's (fresh)
by more than 1e-2. Each case's "precomputed" holds, per row in dataset
order (here the one batch), the f32 values TRL stored in its dataset:
"ref_logps" and (loss kto only) "ref_KL_logps", with "batch_size" and
"dtype"; the first batch must carry them unchanged, and the strings and
ids runs must agree on them bitwise (with the other checks above, all
kept). "vs_non_precomputed" compares the case with the stored figures of
its non-precomputed case (loss, logged_loss, metrics, rows_f64, adapter
after the step): all four are bitwise identical (max_abs_diff 0).

With --full the script runs only FULL_CASES, into expected_full.json /
expected_full.safetensors:
  kto.full.sgd, kto.full.adamw, apo.full.sgd, apo.full.adamw
(<loss>.full.<opt>): FULL finetuning, start "full": the trainer gets the
plain f32 LlamaForCausalLM of tests/fixtures/llama/gqa_llama3 (no
peft_config, no adapter, no ref_model), so every one of its 21 weights
(26784 numbers) is trained, with KTOConfig precompute_ref_log_probs=True
(precompute_ref_batch_size None: batch 4) on the data of the precompute
cases (tests/fixtures/kto/data.jsonl, 4 rows, batch 4, the KL rows of
section 9 of FORMULAS.md: (x1,y4), (x2,y1), (x3,y2), (x4,y3), loss kto
only). Every other setting as above (beta 0.1, weights 1.0, max_steps 1,
max_grad_norm 0, constant lr, seed 42, f32, ...); the optimizers: sgd lr 0.1
(as above); adamw lr 1e-4 (not 1e-3: AdamW's first step moves each weight by
lr * g / (|g| + 1e-8), and one gradient entry here, of
model.layers.1.self_attn.v_proj.weight, is 6.5e-9, at eps, where f32's
gradient is 12% off and the update 3% of lr off; lr 1e-4 keeps that below
TOL of the tensor's largest weight, 4.5e-6, while all but that weight of
those with a nonzero gradient move by 0.9e-4 to 1e-4; 110 unused rows of
embed_tokens have gradient 0 and stay). TRL 1.16 with a non-PEFT model,
ref_model None and precompute_ref_log_probs makes NO reference copy
(ref_model stays None; a copy is loaded by the model's name only without
precompute) and precomputes the reference sums with the policy itself at
the end of KTOTrainer.__init__, before any step, i.e. with the initial
weights (checked: the KTO subclass records the model's weights and
ref_model at the precompute; they are the checkpoint's and None). So, as in
expected.json, the policy equals the reference at step 1: r = 0, kl = 0
(the policy's KL sums equal the precomputed ones bitwise), loss 0.5, and
kto.full.X and apo.full.X have bitwise the same weights after the step.
Each case's entry has the schema of expected_precompute.json (settings,
with "start" "full", "full" true, "policy" the model, "ref_model" null;
loss, logged_loss, metrics, rows_f64, precomputed), but
"vs_non_precomputed" compares with a run the script makes (not written):
the same case with a second load of the checkpoint passed as ref_model and
precompute_ref_log_probs False (all four identical, max_abs_diff 0).
expected_full.safetensors holds, per case, every weight after the one step
(f32) as "<case>.<name>", the name as in the model's model.safetensors
(HF checkpoint names), 21 per case, 84 in all:
  <case>.model.embed_tokens.weight, <case>.lm_head.weight,
  <case>.model.norm.weight, and for L in 0, 1:
  <case>.model.layers.L.input_layernorm.weight,
  <case>.model.layers.L.post_attention_layernorm.weight,
  <case>.model.layers.L.self_attn.{q,k,v,o}_proj.weight,
  <case>.model.layers.L.mlp.{gate,up,down}_proj.weight,
e.g. "kto.full.sgd.model.layers.0.self_attn.q_proj.weight". The strings and
ids runs must agree bitwise and the batch must equal the f64 one, as above;
the f64 check is extended to every weight: the gradient w.r.t. every
parameter of an f64 load of the checkpoint (autograd; the reference a second
f64 load), the step by fixture_steps.hand_step (SGD p - lr*g; AdamW step 1
from zero moments, bias-corrected), every weight after the step against
TRL's relative to the tensor's largest entry ("weights"), the loss, logged
loss and metrics (grad_norm over every weight) and the precomputed sums, all
to TOL 1e-5, else the script fails. "_meta" also reports, not held to TOL,
"update": TRL's weight change (after minus before, two f32 weights) against
the f64 one relative to the tensor's largest update (SGD ~6e-5, the f32
rounding of the weights; AdamW ~3e-2, the entry at eps above).

The f64 recomputation uses HF's Llama in f64, which still computes RMSNorm,
the RoPE angles and the attention softmax in f32 (transformers' code), so
its numbers are f64 up to ~1e-8 relative and can move by that much on
another CPU.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from fixture_steps import trl_environment

trl_environment()

import torch
from safetensors.torch import save_file

from fixture_steps import contiguous, failures, finish, q_v_lora, step, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
PREF = os.path.join(ROOT, "tests", "fixtures", "preference")
OUT = os.path.join(ROOT, "tests", "fixtures", "kto")
BOS_ID, EOS_ID = 0, 1

# Prompts 4-7 tokens with BOS, completions 2-6 tokens with EOS, labels
# alternating. Each prompt ends in punctuation and each completion starts
# with a letter, so the byte-level pre-tokenizer splits at the boundary; no
# merge of the tokenizer applies (checked: one id per character).
ROWS = [
    {"prompt": "HI=", "completion": "IH", "label": True},
    {"prompt": "ZZ:Q?", "completion": "QZZQ!", "label": False},
    {"prompt": "N*K#", "completion": "K", "label": True},
    {"prompt": "GOTTA;", "completion": "OGGO", "label": False},
]
TARGETS = ["q_proj", "v_proj"]
SEED = 42
BETA = 0.1
OPTS = {"sgd": dict(optim="sgd", learning_rate=0.1), "adamw": dict(optim="adamw_torch", learning_rate=1e-3)}
LOSSES = {"kto": "kto", "apo": "apo_zero_unpaired"}
CASES = [(loss, start, opt, None) for loss in LOSSES for start in ("fresh", "init") for opt in OPTS] + \
        [("kto", "fresh", "sgd", "weights"), ("kto", "fresh", "sgd", "paired")]
# expected_ref.*: a reference that differs from the policy at step 1.
REF_CASES = [("kto", "ref", "sgd", None), ("kto", "ref", "adamw", None), ("apo", "ref", "sgd", None),
             ("kto", "ref", "sgd", "paired")]
# expected_precompute.* (--precompute): precompute_ref_log_probs=True.
PRECOMPUTE_CASES = [("kto", "fresh", "sgd", "precompute"), ("kto", "ref", "sgd", "precompute"),
                    ("apo", "ref", "sgd", "precompute"), ("kto", "ref", "adamw", "precompute")]
PRECOMPUTED = ("ref_logps", "ref_KL_logps")
# expected_full.* (--full): full finetuning (no adapter, every weight
# trained) with precompute_ref_log_probs=True.
FULL_CASES = [(loss, "full", opt, None) for loss in LOSSES for opt in OPTS]
# Their optimizers: SGD as OPTS (lr 0.1: the largest update of a tensor is
# 6e-4 to 9e-3 of its largest weight); AdamW lr 1e-4, not 1e-3: its step 1
# moves every weight by lr * g / (|g| + 1e-8), and one gradient entry of
# the data (model.layers.1.self_attn.v_proj.weight, |g| 6.5e-9 in f64) sits
# at eps, where f32's gradient is 12% off and its update 3% of lr off: with
# lr 1e-3 that is 4.5e-5 of the tensor's largest weight (above TOL), with
# 1e-4 4.5e-6, while every other weight with a gradient moves by 0.9e-4 to
# 1e-4 (hundreds to thousands of f32 ulps; a tensor's largest update is 7e-5
# to 1.7e-4 of its largest weight).
FULL_OPTS = {"sgd": OPTS["sgd"], "adamw": dict(OPTS["adamw"], learning_rate=1e-4)}
# f64-check figures reported, not held to TOL ("update": see f64_full_diffs).
INFO_DIFFS = ("update",)
# The adapter each start trains, and its reference (None: the base; start
# "full" trains the base itself, its reference is the base's initial weights).
POLICY = {"fresh": "fresh", "init": "init", "ref": "fresh", "full": None}
REFERENCE = {"fresh": None, "init": "init", "ref": "ref", "full": None}
TOL = 1e-5

FORMULAS = r"""# KTO of TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/kto_trainer.py: KTOTrainer
__init__, _prepare_dataset, DataCollatorForUnpairedPreference,
_compute_kl_logps, _compute_loss, log; kto_config.py; data_utils.py
unpair_preference_dataset, _tokenize, common_prefix_length; trainer/utils.py
add_fused_lm_head, use_adapter) with transformers 5.24.0 and peft 0.21.2, and
checked numerically by scripts/make_kto_fixtures.py (every case recomputed
in f64 from these formulas, the batch layout compared bitwise). i indexes
the rows of a batch, B = per_device_train_batch_size.

## 1. Data and tokenization (`_prepare_dataset`, text rows)
Rows are unpaired {"prompt", "completion", "label"} (label true =
desirable). In order:
1. no "prompt" key: `extract_prompt` (the longest common prefix of
   chosen/rejected becomes the prompt);
2. paired rows ({"prompt","chosen","rejected"}): `unpair_preference_dataset`,
   a batched map (datasets' default batch of 1000 rows): within each block of
   1000 pairs, first every pair's (prompt, chosen, label true), then every
   pair's (prompt, rejected, label false). For 4 pairs: c1, c2, c3, c4, r1,
   r2, r3, r4;
3. non-conversational rows: the EOS token's TEXT is appended to the
   completion unless it already ends with it;
4. `prompt_ids = tok(prompt)`, `pc = tok(prompt + completion)` (completion
   with its EOS text), both with the tokenizer's default special tokens (ours
   adds BOS id 0 in front; no EOS); prompt and completion are tokenized
   TOGETHER, so a merge across the boundary can happen;
5. `n = common_prefix_len(prompt_ids, pc)`; `prompt_ids = prompt_ids[:n]`,
   `completion_ids = pc[n:]` (a warning if n < len(prompt_ids));
6. rows with len(prompt_ids) >= max_length (1024) are dropped;
7. KL completions (loss "kto" only; `calculate_KL` is False for
   "apo_zero_unpaired"): a batched map with batch_size =
   per_device_train_batch_size over the rows IN DATASET ORDER (after 1-6):
   within each consecutive chunk of B rows (the last may be shorter) the
   completions are rotated by +1:
     (x1,y1), ..., (xn,yn) -> KL rows (x1,yn), (x2,y1), ..., (xn,y(n-1)),
   i.e. `KL_completion_ids[i] = completion_ids[i-1]` within the chunk, the
   first row taking the chunk's last. Labels are ignored; the KL row keeps
   row i's prompt. This is fixed at preprocessing; the trainer requires
   train_sampling_strategy "sequential" for it (and B > 1), so a training
   batch is exactly such a chunk.
There is no pre-tokenized input path in 1.16 (prompt_ids/completion_ids rows
would fail in extract_prompt); the fixture feeds data_ids.jsonl verbatim,
adding only the rotation of step 7.
For the fixture tokenizer (BOS template, no merges across the boundary):
prompt_ids = [0] + bytes(prompt), completion_ids = bytes(completion) + [1],
printable ASCII byte b (33..126) -> id b - 31.

## 2. Batch (`DataCollatorForUnpairedPreference`)
Main rows: `prompt_ids + completion_ids`, each cut to max_length (keep the
start), RIGHT-padded with the pad id (tokenizer.pad_token, else EOS: id 1
here) to the longest row of the batch; attention_mask 1 on real tokens, 0 on
padding; completion_mask 1 on completion tokens only. KL rows likewise from
`prompt_ids + KL_completion_ids`, padded to THEIR own longest row
(KL_input_ids, KL_attention_mask, KL_completion_mask). label: a bool tensor.
No position_ids are passed (HF uses 0..L-1 per row). pad_to_multiple_of
"auto" is None off Neuron.

## 3. Completion log-probability sums
Forward `model(input_ids, attention_mask, labels = input_ids with -100 off
the completion, fused_lm_head=True, use_cache=False)`: per-token
logp_t = log_softmax(logits[t-1])[ids[t]] for t >= 1, f32, 0 where the label
is -100. Per row:
  S_i = sum over the row's completion tokens t of logp_t,  N_i = their count.
- policy S_i: the training forward (with gradient);
- KL_policy_i: the same on the row's KL sequence, policy, under no_grad,
  computed BEFORE the main forward;
- reference S0_i and KL_ref_i: under no_grad, with the reference (section 4),
  KL rows first, then the main rows.

## 4. Reference
- a peft_config given (the model is wrapped by the trainer; "fresh"): no
  "ref" adapter exists, so `use_adapter(model, None)` =
  `model.disable_adapter()`: the reference is the base;
- a PeftModel given and ref_model None ("init"): `model.add_adapter("ref",
  peft_config["default"])` and every ".default." parameter copied into
  ".ref." (not trainable: only "default" is active, and trainable); the
  reference forward runs under `use_adapter(model, "ref")` ("ref" active).
  (peft 0.17-0.19 with target_parameters: the base instead.)
- ref_model given: that model; precompute_ref_log_probs: S0 and KL_ref read
  from precomputed columns (same reference choice).
No option names another adapter as the reference. With both starts the
policy equals the reference before the first update.

## 5. KL estimate
loss "kto": kl = clamp( mean_i (KL_policy_i - KL_ref_i), min=0 ), over the B
rows of the batch (gathered and averaged over processes before the clamp),
detached (both KL forwards run under no_grad): a constant in the gradient.
loss "apo_zero_unpaired": no KL rows, no KL forwards, kl = 0 (logged 0.0).

## 6. Losses
r_i = S_i - S0_i (log-ratio), beta = 0.1, sigma = sigmoid, wd / wu =
desirable_weight / undesirable_weight (default 1.0).
- "kto":
    label true:  L_i = 1 - sigma(beta * (r_i - kl))
    label false: L_i = 1 - sigma(beta * (kl - r_i))
- "apo_zero_unpaired":
    label true:  L_i = 1 - sigma(beta * r_i)
    label false: L_i = sigma(beta * r_i)
losses = concat(wd * L_chosen, wu * L_rejected) (chosen rows first, each in
batch order), loss = nanmean(losses) = sum_i w_i L_i / B: a plain mean over
the B rows of the batch (NOT divided by the sum of the weights);
loss_is_scaled_for_ga False. (An MoE model's router aux loss would be added.)

## 7. Logged metrics, step 1 (each a list per step averaged at log time:
`sum(values)/len(values)`; with logging_steps 1 one value)
- loss: as above (transformers' logged loss, unrounded)
- kl: the kl of section 5 (0.0 for apo)
- entropy = token-weighted mean, over every completion token t of every main
  row (chosen and rejected together), of the entropy of softmax(logits[t-1])
  (0.0 if no tokens)
- num_tokens = total attention_mask ones of the MAIN rows (KL rows not
  counted, padding not counted), cumulative over steps
- logits/chosen = sum over the completion tokens t of the label-true rows of
  mean_v logits[t-1, v], divided by their count (pooled, token-weighted);
  logits/rejected likewise for label-false rows. Each is logged only if its
  token count > 0 (a batch without that label logs no value for it)
- rewards/chosen = sum over label-true rows of beta * r_i / their number;
  logps/chosen = sum over label-true rows of S_i / their number (policy
  sums, f32 sum then Python division); both only if there is a true row
- rewards/rejected, logps/rejected likewise over label-false rows, only if
  there is one
- rewards/margins = rewards/chosen - rewards/rejected, only if the batch has
  both labels
- grad_norm (transformers 5.24: the global L2 norm of the trainable
  gradients before clipping, logged also with max_grad_norm 0),
  learning_rate, epoch.
No accuracy metric; rewards use r_i, never the kl.

## 8. Training-loop defaults worth knowing (KTOConfig 1.16)
learning_rate 1e-6; bf16 True when fp16 is unset; gradient_checkpointing
True; logging_steps 10; max_grad_norm 1.0; optim adamw_torch(_fused) with
betas (0.9, 0.999), eps 1e-8, weight_decay 0; lr_scheduler "linear",
warmup 0; disable_dropout True; train_sampling_strategy "sequential"
(required unless apo_zero_unpaired); max_length 1024; beta 0.1;
desirable_weight = undesirable_weight = 1.0. set_seed(seed) runs before the
adapter is created (fresh adapters reproducible).

## 9. The fixture (tests/fixtures/kto)
data.jsonl rows (labels true, false, true, false) give, batch 4:
main rows prompt_i + completion_i; KL rows (x1,y4), (x2,y1), (x3,y2),
(x4,y3). The .paired case (preference/data.jsonl: 8 unpaired rows in one
batch of 8, in TRL's unpair order c1, c2, c3, c4, r1, r2, r3, r4, where
pair j = (xj, cj, rj)): row k (0-based) takes the completion of row k-1,
row 0 that of row 7:
  row 0 (x1,c1) -> KL (x1,r4);  row 4 (x1,r1) -> KL (x1,c4);
  row 1 (x2,c2) -> KL (x2,c1);  row 5 (x2,r2) -> KL (x2,r1);
  row 2 (x3,c3) -> KL (x3,c2);  row 6 (x3,r3) -> KL (x3,r2);
  row 3 (x4,c4) -> KL (x4,c3);  row 7 (x4,r4) -> KL (x4,r3).
In expected.json the policy equals the reference at step 1 (fresh: lora_B =
0; init: "ref" is a copy), so r_i = 0, kl = 0 and the loss is 0.5 in every
case; the gradient is not 0: d loss / d S_i = -w_i beta sigma'(0) / B =
-w_i beta / (4B) for a true row, +w_i beta / (4B) for a false row, for kto
and apo alike (so kto.X and apo.X agree there). expected_ref.json's cases
(start "ref": policy adapters/fresh, TRL's "ref" adapter overwritten with
preference/adapters/ref) have r_i != 0; kl = 0.515 on data.jsonl, and on the
paired data mean(KL_policy - KL_ref) < 0, so kl is clamped to 0.

## 10. precompute_ref_log_probs (expected_precompute.json)
KTOConfig precompute_ref_log_probs=True (default False) changes only where
the reference sums S0_i and KL_ref_i come from; the formulas of sections
3-7 are unchanged. (KTOTrainer `__init__` end, `_precompute_ref_logps`,
`compute_ref_log_probs`, `_compute_loss`.)
- When: ONCE, at the very end of KTOTrainer.__init__ (after
  Trainer.__init__, after the "ref" adapter of section 4 is made and copied
  from "default", after the model is hashed), for the train dataset (and
  each eval dataset; a dataset passed to evaluate() is precomputed then).
  Whatever changes the reference after the trainer is built is not seen.
  The model is in training mode then (dropout disabled by disable_dropout).
- Rows: the prepared dataset of section 1 (tokenized, KL rows already
  rotated), in dataset order: a DataLoader with shuffle False, batch size
  `precompute_ref_batch_size or per_device_train_batch_size` (for eval
  datasets: `or per_device_eval_batch_size`), the trainer's collator
  (section 2: right-padded to the longest row of each PRECOMPUTE batch; KL
  rows to their own longest). The KL pairing is fixed at preprocessing by
  per_device_train_batch_size, so the precompute batch size changes only
  the padding.
- Forward (`compute_ref_log_probs`): under torch.no_grad(), gradient
  checkpointing off, accelerator.autocast() (a no-op in f32), the reference
  of section 4: no ref_model and a PeftModel -> `use_adapter(model, "ref"
  if a "ref" adapter exists else None)` (the "ref" adapter; the base,
  adapter disabled, with a peft_config); a ref_model -> that model.
  `model(input_ids, attention_mask, labels = ids with -100 off the
  completion, fused_lm_head=True)`: S0_i = the sum of section 3; for loss
  "kto" also the KL rows: KL_ref_i. Loss "apo_zero_unpaired": no KL rows
  exist, no KL forward, only S0_i.
- Stored: gathered over processes, concatenated, written (dataset.map into
  an arrow cache file) as f32 columns "ref_logps" (S0_i) and, for "kto"
  only, "ref_KL_logps" (KL_ref_i), appended to the dataset. The cache file
  is named from hash(dataset fingerprint, sha256 of the model's state_dict
  at hash time, calculate_KL) when datasets caching is on and the dataset
  has cache files (a later run then reuses it); otherwise (the fixture) a
  random name, never reused.
- Training: the collator makes f32 tensors batch["ref_logps"] (and
  batch["ref_KL_logps"]) of the batch's rows; `_compute_loss` takes S0 of
  the chosen / rejected rows from ref_logps (index_select by label) and
  KL_ref from ref_KL_logps (None for apo: kl = 0) and runs NO reference
  forward; the policy's KL forward (no_grad) and main forward are as
  without precompute.
- Equal to the per-step reference: with precompute_ref_batch_size None and
  sequential sampling a precompute batch is the training batch (same rows,
  same padding), so the stored sums equal those the per-step reference
  forward computes, bitwise: the four fixture cases equal their
  non-precomputed cases bitwise (loss, metrics, adapter after the step).
  Another precompute_ref_batch_size pads differently: equal in exact
  arithmetic (right padding, causal mask), in f32 up to rounding (batch 1 on
  data.jsonl: two ref_logps differ by 1 ulp, 9.5e-7).
- The fixture's start "ref": "ref" must hold adapters/ref before the
  precompute, so the script overwrites it inside __init__ (its
  _precompute_ref_logps override; the model hash is retaken). Overwritten
  after __init__ (as for expected_ref.json), the precomputed values stay the
  fresh copy's (= the base's: loss 0.5, kl 0) while the "ref" adapter holds
  adapters/ref.
Precomputed (f32) on data.jsonl, rows 1-4: base (kto.fresh.sgd.precompute)
ref_logps -16.153530, -36.126480, -11.337513, -29.198433; ref_KL_logps
-25.829788, -15.466124, -37.440823, -10.138912; adapters/ref (the three ref
cases; apo: ref_logps only) ref_logps -15.088039, -36.281738, -11.187407,
-30.192657; ref_KL_logps -27.283428, -16.409430, -36.880203, -10.360813.
"""


# ---------------------------------------------------------------------------
# Helpers.

def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.join(PREF, "tokenizer"))


def base_model(dtype=torch.float32):
    return tiny_llama(MODEL_DIR, dtype)


def lora_config():
    return q_v_lora(TARGETS)


def adapter_dir(name):
    return os.path.join(PREF, "adapters", name)


def load_adapter(d, trainable=True, dtype=torch.float32):
    from peft import PeftModel
    return PeftModel.from_pretrained(base_model(dtype), d, is_trainable=trainable)


def adapter_state(model, name="default"):
    from peft import get_peft_model_state_dict
    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def saved_adapter(name):
    from safetensors.torch import load_file
    return load_file(os.path.join(adapter_dir(name), "adapter_model.safetensors"))


def rel(path):
    return os.path.relpath(path, ROOT)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_jsonl(name, rows):
    with open(os.path.join(OUT, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def unpair_ids(pairs):
    """TRL's unpair order on id pairs: every chosen, then every rejected."""
    return [{"prompt_ids": p["prompt_ids"], "completion_ids": p[k + "_ids"], "label": k == "chosen"}
            for k in ("chosen", "rejected") for p in pairs]


def with_kl(rows, batch):
    """Rows plus "KL_completion_ids": completions rotated by +1 within each
    consecutive chunk of `batch` rows (TRL's add_kl_completion_ids)."""
    out = []
    for s in range(0, len(rows), batch):
        chunk = rows[s:s + batch]
        comps = [r["completion_ids"] for r in chunk]
        for r, kl in zip(chunk, [comps[-1]] + comps[:-1]):
            out.append({**r, "KL_completion_ids": kl})
    return out


def case_name(loss, start, opt, variant):
    return f"{loss}.{start}.{opt}" + (f".{variant}" if variant else "")


def case_data(variant):
    """(string rows, id rows, settings describing them) of a case."""
    if variant == "paired":
        pairs = read_jsonl(os.path.join(PREF, "data_ids.jsonl"))
        return (read_jsonl(os.path.join(PREF, "data.jsonl")), unpair_ids(pairs),
                {"data": "tests/fixtures/preference/data.jsonl (4 pairs, unpaired by TRL into 8 rows: "
                         "chosen of pairs 1-4 (label true), then rejected of pairs 1-4 (label false))",
                 "data_ids": "tests/fixtures/preference/data_ids.jsonl, unpaired in the same order"})
    return (ROWS, read_jsonl(os.path.join(OUT, "data_ids.jsonl")),
            {"data": "tests/fixtures/kto/data.jsonl", "data_ids": "tests/fixtures/kto/data_ids.jsonl"})


def config_kwargs(loss, opt, variant, start=None):
    """Every KTOConfig argument the cases set (besides output_dir); start
    "full" (full finetuning) always precomputes the reference log-probs."""
    kw = dict(loss_type=LOSSES[loss], beta=BETA, desirable_weight=1.0, undesirable_weight=1.0,
              per_device_train_batch_size=8 if variant == "paired" else 4, gradient_accumulation_steps=1,
              max_steps=1, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
              train_sampling_strategy="sequential", seed=SEED, data_seed=SEED, bf16=False, fp16=False,
              gradient_checkpointing=False, use_cpu=True, max_length=1024, logging_steps=1, save_strategy="no",
              report_to="none", dataloader_num_workers=0, disable_tqdm=True, **OPTS[opt])
    if variant == "weights":
        kw.update(desirable_weight=1.5, undesirable_weight=0.5)
    if variant == "precompute" or start == "full":
        kw.update(precompute_ref_log_probs=True, precompute_ref_batch_size=None)
    if start == "full":
        kw.update(FULL_OPTS[opt])
    return kw


# ---------------------------------------------------------------------------
# TRL.

def kto_class():
    """KTOTrainer keeping the first compute_loss's loss and batch, and taking
    pre-tokenized rows verbatim (only TRL's KL rotation added, by with_kl)."""
    from datasets import Dataset
    from trl import KTOTrainer

    class KTO(KTOTrainer):
        def __init__(self, *a, ref_before_precompute=False, **k):
            # Set before KTOTrainer.__init__, which precomputes (below).
            self.ref_before_precompute = ref_before_precompute
            self.precompute_calls = []
            super().__init__(*a, **k)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            """TRL calls this at the end of __init__, after it made its
            "ref" adapter (a copy of "default") and hashed the model; with
            ref_before_precompute the "ref" adapter gets adapters/ref first
            (install_ref) and the hash (which only names TRL's cache file)
            is retaken, so TRL precomputes with the intended reference."""
            if self.ref_before_precompute and not self.precompute_calls:
                from trl.trainer.utils import hash_module
                install_ref(self.model)
                self._precompute_model_hash = hash_module(self.model)
            if not hasattr(self.model, "peft_config"):
                # Full finetuning: what TRL precomputes with (checked by
                # check_reference: no ref_model, the policy itself, still
                # holding the checkpoint's weights).
                self.precompute_with = (self.ref_model, {k: v.detach().clone()
                                                         for k, v in self.model.state_dict().items()})
            self.precompute_calls.append((name, batch_size, len(dataset)))
            return super()._precompute_ref_logps(dataset, name, batch_size)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            if not hasattr(self, "first_loss"):
                loss = out[0] if isinstance(out, tuple) else out
                self.first_loss = loss.detach().float().item()
                self.first_batch = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
            return out

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" not in dataset.column_names:
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            rows = dataset.to_list()
            if self.calculate_KL:
                rows = with_kl(rows, args.per_device_train_batch_size)
            return Dataset.from_list(rows)
    return KTO


def build_trainer(loss, start, opt, variant, rows, tmp, explicit_ref=False):
    """explicit_ref (start "full" only): pass a second load of the
    checkpoint as ref_model and do not precompute (the vs_non_precomputed
    run of a full case)."""
    from datasets import Dataset
    from trl import KTOConfig
    kwargs = config_kwargs(loss, opt, variant, start)
    if explicit_ref:
        assert start == "full", start
        kwargs.update(precompute_ref_log_probs=False)
    args = KTOConfig(output_dir=tmp, **kwargs)
    kw = {}
    if start == "full":
        # No peft_config, a plain (not PEFT) model: every weight trained.
        model = base_model()
        if explicit_ref:
            kw["ref_model"] = base_model()
    elif start == "fresh":
        model = base_model()
        kw["peft_config"] = lora_config()
    else:
        model = load_adapter(adapter_dir(POLICY[start]))
    if variant == "precompute":
        # TRL precomputes the reference log-probs inside __init__, so the
        # "ref" start installs adapters/ref there, before the precompute.
        kw["ref_before_precompute"] = start == "ref"
    trainer = kto_class()(model=model, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer(), **kw)
    if args.precompute_ref_log_probs:
        assert trainer.precompute_calls == [("train", args.per_device_train_batch_size, len(rows))], \
            trainer.precompute_calls
    elif explicit_ref:
        assert trainer.precompute_calls == [], trainer.precompute_calls
    elif start == "ref":
        install_ref(trainer.model)
    return trainer


def install_ref(pm):
    """Overwrites TRL's "ref" adapter (its frozen copy of the policy's) with
    preference/adapters/ref, so TRL's own use_adapter(model, "ref") runs the
    reference forward with it (TRL 1.16 has no option naming a reference
    adapter; the same as the preference fixtures' "ref" start)."""
    want = saved_adapter("ref")
    n = 0
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".ref." in name:
                p.copy_(want[name.replace(".ref.", ".")])
                n += 1
    assert n == len(want), (n, len(want))


def checkpoint_state():
    """The tiny Llama's weights as its model.safetensors holds them."""
    from safetensors.torch import load_file
    return load_file(os.path.join(MODEL_DIR, "model.safetensors"))


def model_state(model, start):
    """What a case trains, by the key it is stored under: the adapter (PEFT
    keys), or for start "full" every weight (HF checkpoint names)."""
    if start != "full":
        return adapter_state(model)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def start_state(start):
    return checkpoint_state() if start == "full" else saved_adapter(POLICY[start])


def check_full(trainer, explicit_ref):
    """start "full": a plain LlamaForCausalLM (no PEFT), every parameter
    trainable, named as the checkpoint's tensors. TRL 1.16 with
    precompute_ref_log_probs and no ref_model makes NO reference copy
    (ref_model None) and precomputes with the policy itself, at the end of
    __init__, while it still holds the checkpoint's weights (recorded by
    the KTO subclass); with explicit_ref, the ref_model given, a separate
    module holding the checkpoint's weights, frozen by nobody but never
    stepped (not in the optimizer)."""
    from transformers import LlamaForCausalLM
    pm = trainer.model
    assert type(pm) is LlamaForCausalLM and not hasattr(pm, "peft_config"), type(pm)
    names = {n for n, _ in pm.named_parameters()}
    want = checkpoint_state()
    assert names == set(want) == set(pm.state_dict()), sorted(names ^ set(want))
    assert all(p.requires_grad for p in pm.parameters()), "a frozen weight"
    if not explicit_ref:
        assert trainer.ref_model is None, "KTOTrainer made a ref_model"
        ref, weights = trainer.precompute_with
        assert ref is None, "TRL precomputed with a ref_model"
        assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want), \
            "TRL precomputed with weights other than the checkpoint's"
    else:
        ref = trainer.ref_model
        assert ref is not None and ref is not pm, "no separate ref_model"
        sd = ref.state_dict()
        assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want), \
            "the ref_model is not the checkpoint"


def check_reference(trainer, start, explicit_ref=False):
    """fresh: no "ref" adapter (reference = adapters disabled); init: TRL's
    frozen "ref" adapter, a copy of adapters/init; ref: that adapter holding
    adapters/ref; never a ref_model. full: check_full."""
    pm = trainer.model
    if start == "full":
        return check_full(trainer, explicit_ref)
    assert trainer.ref_model is None, "KTOTrainer made a ref_model"
    if start == "fresh":
        assert list(pm.peft_config) == ["default"], list(pm.peft_config)
        return
    assert list(pm.peft_config) == ["default", "ref"], list(pm.peft_config)
    assert pm.active_adapters == ["default"], pm.active_adapters
    for n, p in pm.named_parameters():
        assert p.requires_grad == (".default." in n), (n, p.requires_grad)
    want, got = saved_adapter(REFERENCE[start]), adapter_state(pm, "ref")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), \
        ("'ref' is not adapters/" + REFERENCE[start])


def run_trl(loss, start, opt, variant, form, explicit_ref=False):
    """One optimizer step of KTOTrainer. Returns (loss, step-1 logs, adapter
    (start "full": every weight) before, the same after, first batch,
    prepared rows)."""
    strings, ids, _ = case_data(variant)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(loss, start, opt, variant, strings if form == "strings" else ids, tmp,
                                explicit_ref=explicit_ref)
        check_reference(trainer, start, explicit_ref)
        init = model_state(trainer.model, start)
        want = start_state(start)
        assert init.keys() == want.keys() and all(torch.equal(init[k], want[k]) for k in want), \
            ("the trainer's starting " + ("weights are not the checkpoint's" if start == "full"
                                          else "adapter is not adapters/" + POLICY[start]))
        prepared = trainer.train_dataset.to_list()
        trainer.train()
        check_reference(trainer, start, explicit_ref)  # "ref" (the ref_model) unchanged by the step
        logs = dict(trainer.state.log_history[0])
        assert logs["step"] == 1, logs
        return trainer.first_loss, logs, init, model_state(trainer.model, start), trainer.first_batch, prepared


# ---------------------------------------------------------------------------
# Inputs.

def expected_ids(row):
    """[BOS] + one id per character of the prompt; the completion's + [EOS]
    (the fixture tokenizer: printable ASCII byte b is id b - 31)."""
    def byte_ids(s):
        assert all(32 < ord(c) < 127 for c in s), s
        return [ord(c) - 31 for c in s]
    return {"prompt_ids": [BOS_ID] + byte_ids(row["prompt"]),
            "completion_ids": byte_ids(row["completion"]) + [EOS_ID], "label": row["label"]}


@step("inputs")
def write_inputs():
    os.makedirs(OUT, exist_ok=True)
    write_jsonl("data.jsonl", ROWS)
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)


@step("data_ids")
def write_ids():
    """data_ids.jsonl from KTOTrainer's own _prepare_dataset of data.jsonl
    (loss kto, batch 4); checks the ids (expected_ids) and TRL's KL column
    (with_kl)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer("kto", "fresh", "sgd", None, ROWS, tmp)
        prepared = trainer.train_dataset.to_list()
    keys = ("prompt_ids", "completion_ids", "label")
    rows = [{k: r[k] for k in keys} for r in prepared]
    assert rows == [expected_ids(r) for r in ROWS], rows
    kl = [{k: r[k] for k in keys + ("KL_completion_ids",)} for r in prepared]
    assert kl == with_kl(rows, 4), kl
    assert all(0 <= i < 128 for r in rows for i in r["prompt_ids"] + r["completion_ids"])
    write_jsonl("data_ids.jsonl", rows)
    for s, r in zip(ROWS, kl):
        print(f"  {s} -> {r}")


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

def batch_of(rows, key):
    """TRL's collator layout: prompt + rows[key], right-padded with EOS."""
    seqs = [r["prompt_ids"] + r[key] for r in rows]
    comp = [[0] * len(r["prompt_ids"]) + [1] * len(r[key]) for r in rows]
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [EOS_ID] * (L - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    cmask = torch.tensor([c + [0] * (L - len(c)) for c in comp])
    return ids, attn, cmask


def f64_model(adapter):
    if adapter is None:
        return base_model(torch.float64).eval()
    return load_adapter(adapter, trainable=True, dtype=torch.float64).eval()


def sums(model, ids, attn, cmask):
    """(completion log-prob sums, logits) of the batch."""
    logits = model(input_ids=ids, attention_mask=attn).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (lp * cmask[:, 1:].double()).sum(1), logits


def hand_forward(start, rows, kl_on, trl_batch):
    """Policy and reference sums in f64 (main rows, KL rows if kl_on), the
    policy's logits and the batch; the batch must equal TRL's bitwise."""
    main = batch_of(rows, "completion_ids")
    names = ["input_ids", "attention_mask", "completion_mask"]
    got = {n: t for n, t in zip(names, main)}
    kl_batch = batch_of(rows, "KL_completion_ids") if kl_on else None
    if kl_on:
        got.update({"KL_" + n: t for n, t in zip(names, kl_batch)})
    got["label"] = torch.tensor([r["label"] for r in rows])
    assert trl_batch.keys() == got.keys(), (sorted(trl_batch), sorted(got))
    for k in got:
        assert torch.equal(trl_batch[k], got[k]), ("the f64 batch differs from TRL's", k)
    pol = f64_model(None if POLICY[start] is None else adapter_dir(POLICY[start]))
    for n, p in pol.named_parameters():
        p.requires_grad_(start == "full" or "lora_" in n)
    S, logits = sums(pol, *main)
    out = {"S": S, "logits": logits.detach(), "main": main, "pol": pol}
    with torch.no_grad():
        ref = f64_model(None if REFERENCE[start] is None else adapter_dir(REFERENCE[start]))
        out["S0"] = sums(ref, *main)[0]
        if kl_on:
            out["KLp"] = sums(pol, *kl_batch)[0]
            out["KLr"] = sums(ref, *kl_batch)[0]
            out["kl_tokens"] = kl_batch[2][:, 1:].sum(1)
    return out


def hand_loss(loss, f, labels, wd, wu):
    """KTO / APO-zero loss (section 6 of FORMULAS.md) and the kl."""
    sig = torch.sigmoid
    r = f["S"] - f["S0"]
    kl = (f["KLp"] - f["KLr"]).mean().clamp(min=0) if loss == "kto" else torch.zeros((), dtype=torch.float64)
    rc, rr = r[labels], r[~labels]
    if loss == "kto":
        lc, lr = 1 - sig(BETA * (rc - kl)), 1 - sig(BETA * (kl - rr))
    else:
        lc, lr = 1 - sig(BETA * rc), sig(BETA * rr)
    return torch.cat((wd * lc, wu * lr)).mean(), kl, r.detach()


def hand_metrics(f, labels, r, kl):
    """The logged metrics of section 7, from the f64 forward."""
    ids, attn, cmask = f["main"]
    logits = f["logits"][:, :-1]
    m = cmask[:, 1:].bool()
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    mean_v = logits.mean(-1)
    S = f["S"].detach()
    out = {"kl": kl.item(), "entropy": ent[m].mean().item(), "num_tokens": float(attn.sum())}
    for name, sel in (("chosen", labels), ("rejected", ~labels)):
        out[f"logits/{name}"] = mean_v[sel][m[sel]].mean().item()
        out[f"rewards/{name}"] = (BETA * r[sel]).mean().item()
        out[f"logps/{name}"] = S[sel].mean().item()
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def hand(loss, start, variant, rows, batch, trl_batch):
    """Loss, metrics, start adapter, gradients (by PEFT key) and per-row
    numbers of the first batch, in f64 (start "full": every weight and its
    gradient, by HF checkpoint name; the reference a second f64 load of the
    checkpoint)."""
    from peft import get_peft_model_state_dict
    kw = config_kwargs(loss, "sgd", variant)
    rows = rows[:batch]
    kl_on = loss == "kto"
    f = hand_forward(start, rows, kl_on, trl_batch)
    labels = torch.tensor([r["label"] for r in rows])
    value, kl, r = hand_loss(loss, f, labels, kw["desirable_weight"], kw["undesirable_weight"])
    metrics = hand_metrics(f, labels, r, kl)
    value.backward()
    pol = f["pol"]
    named = dict(pol.named_parameters())
    if start == "full":
        params = {k: v.detach().clone() for k, v in named.items()}
        grads = {k: v.grad.detach().clone() for k, v in named.items()}
    else:
        params = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pol).items()}
        grads = {k: named[k.replace(".weight", ".default.weight")].grad.detach().clone() for k in params}
    metrics["grad_norm"] = sum((g ** 2).sum() for g in grads.values()).sqrt().item()
    per_row = {"label": [bool(x) for x in labels], "policy_sum": f["S"].tolist(), "ref_sum": f["S0"].tolist(),
               "completion_tokens": [float(x) for x in f["main"][2][:, 1:].sum(1)]}
    if kl_on:
        per_row.update(kl_policy_sum=f["KLp"].tolist(), kl_ref_sum=f["KLr"].tolist(),
                       kl_completion_tokens=[float(x) for x in f["kl_tokens"]])
    return value.item(), metrics, params, grads, per_row


# ---------------------------------------------------------------------------
# Cases.

TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def check_same(name, a, b):
    """The strings run and the ids run agree bitwise."""
    loss, logs, init, after, batch, prepared = a
    loss2, logs2, init2, after2, batch2, prepared2 = b
    assert loss == loss2, (name, loss, loss2)
    assert logs.keys() == logs2.keys(), (name, sorted(logs), sorted(logs2))
    for k in logs:
        if k not in TIMING_KEYS:
            assert logs[k] == logs2[k], (name, k, logs[k], logs2[k])
    for k in after:
        assert torch.equal(after[k], after2[k]) and torch.equal(init[k], init2[k]), (name, k)
    assert batch.keys() == batch2.keys(), (name, sorted(batch), sorted(batch2))
    for k in batch:
        assert torch.equal(batch[k], batch2[k]), (name, "batch", k)
    keys = [k for k in prepared2[0]]
    assert [{k: r[k] for k in keys} for r in prepared] == prepared2, (name, "prepared rows")


def f64_diffs(opt, trl, h):
    """Largest relative differences of TRL's numbers to the f64 ones."""
    loss, logs, _, after, _, _ = trl
    h_loss, h_metrics, h_params, h_grads, _ = h
    missing = sorted(set(h_metrics) ^ (set(logs) - {"loss", "epoch", "step", "learning_rate"}))
    assert not missing, ("logged metrics differ from the hand-computed set", missing)
    d_met = max(abs(h_metrics[k] - logs[k]) / max(abs(h_metrics[k]), 1.0) for k in h_metrics)
    lr = OPTS[opt]["learning_rate"]
    d_ad = 0.0
    for k, p0 in h_params.items():
        g = h_grads[k]
        want = p0 - lr * g if opt == "sgd" else p0 - lr * g / (g.abs() + 1e-8)
        d_ad = max(d_ad, ((want - after[k].double()).abs().max() / want.abs().max()).item())
    return {"loss": abs(h_loss - loss) / max(abs(h_loss), 1.0), "metrics": d_met, "adapter": d_ad,
            "logged_loss": abs(h_loss - logs["loss"]) / max(abs(h_loss), 1.0)}


def f64_full_diffs(loss, opt, trl, h):
    """f64_diffs for start "full": every weight after the step against the
    f64 weights stepped by hand (fixture_steps.hand_step: SGD p - lr*g;
    AdamW step 1 from zero moments, bias-corrected), relative to the
    tensor's largest entry ("weights"); and the update (weight after minus
    before) relative to the tensor's largest f64 update ("update": TRL's
    update is the difference of two f32 weights, so it carries their
    rounding, ~6e-8 absolute; also catches an AdamW sign flip, a gradient
    entry whose sign f32 gets wrong)."""
    from fixture_steps import hand_step
    loss_value, logs, init, after, _, _ = trl
    h_loss, h_metrics, h_params, h_grads, _ = h
    missing = sorted(set(h_metrics) ^ (set(logs) - {"loss", "epoch", "step", "learning_rate"}))
    assert not missing, ("logged metrics differ from the hand-computed set", missing)
    d_met = max(abs(h_metrics[k] - logs[k]) / max(abs(h_metrics[k]), 1.0) for k in h_metrics)
    lr = config_kwargs(loss, opt, None, "full")["learning_rate"]
    assert logs["learning_rate"] == lr, (logs["learning_rate"], lr)
    assert h_params.keys() == after.keys() == init.keys(), sorted(set(h_params) ^ set(after))
    want = {k: p.clone() for k, p in h_params.items()}
    hand_step(want, h_grads, opt, lr, 1, {k: (torch.zeros_like(p), torch.zeros_like(p)) for k, p in want.items()})
    d_w = d_u = 0.0
    moved = {}
    for k, w in want.items():
        assert torch.equal(h_params[k], init[k].double()), (k, "the f64 start is not TRL's")
        d_w = max(d_w, ((w - after[k].double()).abs().max() / w.abs().max()).item())
        du = w - h_params[k]
        d_u = max(d_u, ((du - (after[k].double() - init[k].double())).abs().max() / du.abs().max()).item())
        moved[k] = (du.abs().max() / w.abs().max()).item()
    low = min(moved, key=moved.get)
    print(f"  largest update per tensor, relative to its largest weight: {min(moved.values()):.2e} ({low}) "
          f"to {max(moved.values()):.2e}; f64 check: weights {d_w:.1e}, update {d_u:.1e}")
    return {"loss": abs(h_loss - loss_value) / max(abs(h_loss), 1.0), "metrics": d_met, "weights": d_w,
            "logged_loss": abs(h_loss - logs["loss"]) / max(abs(h_loss), 1.0), "update": d_u}


def case_settings(loss, start, opt, variant):
    kw = config_kwargs(loss, opt, variant, start)
    for k in ("logging_steps", "save_strategy", "report_to", "dataloader_num_workers", "disable_tqdm", "fp16",
              "data_seed"):
        kw.pop(k)
    if start == "full":
        return {"trainer": "KTOTrainer", **kw, **case_data(variant)[2], "start": start, "full": True,
                "dtype": "float32", "calculate_kl": loss == "kto",
                "policy": f"{rel(MODEL_DIR)} (no adapter, no peft_config: every weight trained, "
                          f"{sum(v.numel() for v in checkpoint_state().values())} parameters)",
                "ref_model": None,
                "reference": f"{rel(MODEL_DIR)}'s initial weights: with precompute_ref_log_probs and no ref_model "
                             "TRL makes no reference copy (ref_model None) and precomputes the reference log-probs "
                             "with the policy itself at the end of KTOTrainer.__init__, before any step"}
    return {"trainer": "KTOTrainer", **kw, **case_data(variant)[2], "start": start, "dtype": "float32",
            "calculate_kl": loss == "kto", "policy_adapter": rel(adapter_dir(POLICY[start])),
            "reference": {"fresh": "base (adapter disabled)",
                          "init": f"{rel(adapter_dir('init'))} (TRL's frozen 'ref' copy of the policy adapter)",
                          "ref": f"{rel(adapter_dir('ref'))} (loaded into TRL's frozen 'ref' adapter "
                                 + ("inside KTOTrainer.__init__, before TRL precomputes the reference log-probs)"
                                    if variant == "precompute" else "after the trainer is built)")}[start]}


def run_case(loss, start, opt, variant):
    """One case through TRL twice (strings, ids: bitwise equal) and once in
    f64. Returns (name, expected entry, tensors, f64 diffs)."""
    name = case_name(loss, start, opt, variant)
    full = start == "full"
    a = run_trl(loss, start, opt, variant, "strings")
    b = run_trl(loss, start, opt, variant, "ids")
    check_same(name, a, b)
    ids_rows = b[5]
    batch = config_kwargs(loss, opt, variant, start)["per_device_train_batch_size"]
    trl_batch = {k: v for k, v in a[4].items() if k not in PRECOMPUTED}
    h = hand(loss, start, variant, ids_rows, batch, trl_batch)
    diffs = f64_full_diffs(loss, opt, a, h) if full else f64_diffs(opt, a, h)
    first_loss, logs, _, after, _, _ = a
    print(f"{name:24s} loss {first_loss:.7f} kl {logs['kl']:.3g} grad_norm {logs['grad_norm']:.6f}  f64 check "
          f"(relative): loss {diffs['loss']:.1e} metrics {diffs['metrics']:.1e} "
          + (f"weights {diffs['weights']:.1e}" if full else f"adapter {diffs['adapter']:.1e}"))
    metrics = {k: v for k, v in logs.items() if k not in ("loss", "epoch", "step")}
    entry = {"settings": case_settings(loss, start, opt, variant), "loss": first_loss,
             "logged_loss": logs["loss"], "metrics": metrics, "rows_f64": h[4]}
    if variant == "precompute" or full:
        entry["precomputed"], diffs["precomputed"] = check_precomputed(name, loss, start, a, h[4], batch)
        entry["vs_non_precomputed"] = (vs_explicit_ref(name, loss, start, opt, variant, a) if full
                                       else vs_non_precomputed(name, entry, after))
    return name, entry, {f"{name}.{k}": v for k, v in after.items()}, diffs


def vs_explicit_ref(name, loss, start, opt, variant, trl):
    """A full case has no non-precomputed counterpart on file (TRL would
    load a reference copy by the model's name, which the fixture model
    lacks), so the script runs one: the same case (strings) with a second
    load of the checkpoint passed as ref_model and precompute_ref_log_probs
    False (TRL's per-step reference forward). Whether loss, logged metrics
    (but the timings), every weight after the step and the first batch
    (without the precomputed columns) equal the precompute run's, and the
    largest absolute differences; the script fails if they are not equal."""
    loss_a, logs_a, _, after_a, batch_a, _ = trl
    loss_b, logs_b, _, after_b, batch_b, _ = run_trl(loss, start, opt, variant, "strings", explicit_ref=True)
    assert logs_a.keys() == logs_b.keys(), (name, sorted(logs_a), sorted(logs_b))
    keys = [k for k in logs_a if k not in TIMING_KEYS + ("epoch", "step")]
    d = {"loss": abs(loss_a - loss_b), "logged_loss": abs(logs_a["loss"] - logs_b["loss"]),
         "metrics": max(abs(logs_a[k] - logs_b[k]) for k in keys if k != "loss"),
         "weights": max((after_a[k] - after_b[k]).abs().max().item() for k in after_a)}
    assert after_a.keys() == after_b.keys(), name
    assert set(batch_a) - set(PRECOMPUTED) == set(batch_b), (name, sorted(batch_a), sorted(batch_b))
    assert all(torch.equal(batch_a[k], batch_b[k]) for k in batch_b), (name, "batch")
    same = all(v == 0 for v in d.values())
    print(f"  vs {name} with an explicit ref_model, no precompute: {'identical' if same else 'DIFFERENT'}, "
          f"max |difference| {d}")
    return {"case": f"{name} with ref_model = a second load of {rel(MODEL_DIR)} and precompute_ref_log_probs "
                    "False (run by this script, not written)", "identical": same, "max_abs_diff": d}


def check_precomputed(name, loss, start, trl, per_row, batch):
    """The reference log-prob sums TRL precomputed into its dataset (f32,
    the "ref_logps" / "ref_KL_logps" columns; the strings and ids runs
    already agree bitwise): the first batch carries them unchanged, they
    match the f64 reference sums (ref_sum, kl_ref_sum) to TOL, and for start
    "ref" they are adapters/ref's, far from the policy adapter's (fresh:
    policy_sum, kl_policy_sum). Returns (the "precomputed" entry, the
    largest relative difference to f64)."""
    _, _, _, _, first_batch, prepared = trl
    cols = PRECOMPUTED if loss == "kto" else PRECOMPUTED[:1]
    assert [k for k in PRECOMPUTED if k in prepared[0]] == list(cols), (name, sorted(prepared[0]))
    assert [k for k in PRECOMPUTED if k in first_batch] == list(cols), (name, sorted(first_batch))
    out, worst = {}, 0.0
    for col, f64_key, policy_key in zip(cols, ("ref_sum", "kl_ref_sum"), ("policy_sum", "kl_policy_sum")):
        values = [r[col] for r in prepared]
        t = first_batch[col]
        assert t.dtype == torch.float32 and torch.equal(t, torch.tensor(values[:batch])), (name, col, t)
        assert all(torch.tensor(v, dtype=torch.float32).item() == v for v in values), (name, col, "not f32")
        want = per_row[f64_key]
        d = max(abs(w - v) / max(abs(w), 1.0) for w, v in zip(want, values[:batch]))
        assert d < TOL, (name, col, "differs from the f64 reference sums", values, want)
        if start == "ref":
            far = max(abs(w - v) / max(abs(w), 1.0) for w, v in zip(per_row[policy_key], values[:batch]))
            assert far > 1e3 * TOL, (name, col, "precomputed with the policy adapter, not adapters/ref", far)
        worst = max(worst, d)
        out[col] = values
    # build_trainer checked that TRL precomputed once, with batch
    # per_device_train_batch_size (precompute_ref_batch_size None).
    out.update(batch_size=batch, dtype="float32")
    print(f"  precomputed {', '.join(cols)} (f32, batch {batch}): f64 check {worst:.1e}")
    for col in cols:
        print(f"    {col}: {out[col]}")
    return out, worst


def vs_non_precomputed(name, entry, after):
    """The figures of the same case without precompute (expected.json or
    expected_ref.json, read, not written): whether this case's loss,
    logged metrics, rows_f64 and adapter after the step equal them, and
    the largest absolute differences."""
    from safetensors.torch import load_file
    base = name[:-len(".precompute")]
    stem = "expected" if base.split(".")[1] != "ref" else "expected_ref"
    with open(os.path.join(OUT, stem + ".json")) as f:
        other = json.load(f)[base]
    theirs = load_file(os.path.join(OUT, stem + ".safetensors"))
    d = {"loss": abs(entry["loss"] - other["loss"]), "logged_loss": abs(entry["logged_loss"] - other["logged_loss"])}
    assert entry["metrics"].keys() == other["metrics"].keys(), (name, sorted(entry["metrics"]),
                                                                sorted(other["metrics"]))
    d["metrics"] = max(abs(entry["metrics"][k] - other["metrics"][k]) for k in entry["metrics"])
    assert entry["rows_f64"].keys() == other["rows_f64"].keys(), name
    d["rows_f64"] = float(max(abs(x - y) for k in entry["rows_f64"]
                        for x, y in zip(entry["rows_f64"][k], other["rows_f64"][k], strict=True)))
    d["adapter"] = max((after[k] - theirs[f"{base}.{k}"]).abs().max().item() for k in after)
    assert set(after) == {k[len(base) + 1:] for k in theirs if k.startswith(base + ".base_model.")}, name
    same = all(v == 0 for v in d.values())
    print(f"  vs {base} ({stem}.json): {'identical' if same else 'DIFFERENT'}, max |difference| {d}")
    return {"case": base, "file": rel(os.path.join(OUT, stem + ".json")), "identical": same, "max_abs_diff": d}


def meta(worst):
    import datasets, peft, trl, transformers
    return {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "datasets": datasets.__version__},
        "model": rel(MODEL_DIR), "tokenizer": rel(os.path.join(PREF, "tokenizer")),
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "pad_token_id": EOS_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "paths": "relative to the repository root",
        "rows_f64": "per row of the step-1 batch in batch order; kl_* only where loss_type is kto",
        "f64_check_max_rel_diff": worst,
    }


def write_cases(case_list, stem, notes=None):
    """Runs the cases; writes OUT/<stem>.json and OUT/<stem>.safetensors
    (`notes`: more "_meta" entries; a note None drops meta's entry)."""
    expected, tensors = {}, {}
    worst = {}
    for case in case_list:
        name, entry, after, diffs = run_case(*case)
        worst = {k: max(worst.get(k, 0.0), diffs[k]) for k in {**worst, **diffs}}
        expected[name] = entry
        tensors.update(after)
    expected["_meta"] = {k: v for k, v in {**meta(worst), **(notes or {})}.items() if v is not None}
    with open(os.path.join(OUT, stem + ".json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, stem + ".safetensors"))
    print(f"{stem}: f64 check, worst relative difference over all cases:", worst)
    assert all(v < TOL for k, v in worst.items() if k not in INFO_DIFFS), worst


@step("cases")
def cases():
    write_cases(CASES, "expected")


@step("ref_cases")
def ref_cases():
    write_cases(REF_CASES, "expected_ref")


@step("precompute_cases")
def precompute_cases():
    write_cases(PRECOMPUTE_CASES, "expected_precompute", notes={
        "precomputed": "per row of the dataset (in dataset order; here the step-1 batch): the f32 reference "
                       "log-prob sums TRL precomputed into its ref_logps / ref_KL_logps columns (ref_KL_logps "
                       "only where loss_type is kto), batch_size the batch TRL precomputed them in",
        "vs_non_precomputed": "the same case without precompute_ref_log_probs (read from the file named): "
                              "identical when loss, logged_loss, metrics, rows_f64 and the adapter after the "
                              "step are bitwise equal; max_abs_diff the largest absolute differences"})


@step("full_cases")
def full_cases():
    write_cases(FULL_CASES, "expected_full", notes={
        "lora": None,
        "full": "full finetuning: no adapter, every weight of the model trained; the tensors of "
                "expected_full.safetensors are every weight after the step, '<case>.<HF checkpoint name>' "
                "(the names of the model's model.safetensors), f32",
        "precomputed": "per row of the dataset (in dataset order; here the step-1 batch): the f32 reference "
                       "log-prob sums TRL precomputed (with the initial weights) into its ref_logps / "
                       "ref_KL_logps columns (ref_KL_logps only where loss_type is kto), batch_size the batch "
                       "TRL precomputed them in",
        "vs_non_precomputed": "the same case run by this script (not written) with a second load of the "
                              "checkpoint as ref_model and precompute_ref_log_probs False: identical when loss, "
                              "logged_loss, metrics (but timings) and every weight after the step are bitwise "
                              "equal; max_abs_diff the largest absolute differences",
        "f64_check": "relative differences: loss, logged_loss, metrics (|d| / max(|value|, 1)); weights (every "
                     "weight after the step, |d| relative to the tensor's largest f64 entry); update (weight "
                     "after minus before, relative to the tensor's largest f64 update); precomputed (the "
                     "precomputed sums against the f64 reference sums)"})


if __name__ == "__main__":
    import accelerate, datasets, peft, safetensors, tokenizers, transformers, trl
    print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "peft",
          peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "tokenizers",
          tokenizers.__version__, "safetensors", safetensors.__version__)
    if sys.argv[1:] not in ([], ["--precompute"], ["--full"]):
        sys.exit(f"usage: {sys.argv[0]} [--precompute | --full]")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--precompute"]:
        precompute_cases()
    elif sys.argv[1:] == ["--full"]:
        full_cases()
    else:
        write_inputs()
        write_ids()
        cases()
        ref_cases()
    finish()
