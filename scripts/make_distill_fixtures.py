#!/usr/bin/env python3
"""Build the on-policy distillation fixtures (the student learns to match a
teacher's next-token distribution on completions it is given, the
distillation sibling of hlo-train's `train --objective grpo --rollouts FILE`)
from TRL's own DistillationTrainer.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets,
accelerate, safetensors and PyTorch are installed (made with torch 2.9.1
run on CPU, trl 1.16.0, transformers 5.24.0, peft 0.21.2, accelerate
1.15.0, datasets 5.2.0); it needs no GPU and no network, and takes about 10
seconds:

    python3 scripts/make_distill_fixtures.py

(e.g. `PYTHONPATH=DIR python3 scripts/make_distill_fixtures.py` with the
packages installed under DIR, as for scripts/make_grpo_fixtures.py; two runs
reproduce the files byte for byte on the machine that made them; elsewhere
the f32 numbers can move by an ulp or so.)

It READS, and never writes:
  tests/fixtures/llama/gqa_llama3     the STUDENT: tiny f32 Llama (vocab 128,
                                      hidden 32, 2 layers, GQA, llama3 rope);
                                      its generation_config says
                                      eos_token_id 2, which TRL also treats as
                                      an EOS (TRL's eos ids are [1, 2])
  tests/fixtures/qlora/llama          the TEACHER: a different, larger tiny
                                      Llama (vocab 128, hidden 128, 2 layers,
                                      4 heads / 2 kv heads, head_dim 32, rope
                                      theta 1e4, untied lm_head), a plain f32
                                      checkpoint (the ORIGINAL weights that
                                      make_qlora_fixtures.py quantizes, not a
                                      quantized one; checked: every tensor
                                      f32), loaded in f32 and frozen
  tests/fixtures/preference/tokenizer the tokenizer (BOS id 0, EOS id 1, no
                                      pad token: TRL pads with EOS)
  tests/fixtures/grpo/rollouts.jsonl  8 (prompt_ids, completion_ids) pairs:
                                      2 prompts of 5 ids x 4 completions of
                                      2..6 ids (its rewards are ignored)
  tests/fixtures/grpo/adapters/fresh  the adapter PEFT makes from the LoRA
                                      config after set_seed(42) (lora_A
                                      kaiming-uniform, lora_B 0): TRL is given
                                      the base model + peft_config and makes
                                      it itself; checked equal, bit for bit
  tests/fixtures/grpo/adapters/init   a random adapter (A and B ~ N(0, 0.1)):
                                      TRL is given a PeftModel loaded from it
                                      (is_trainable), no peft_config; checked
                                      that TRL's initial adapter equals it

and writes tests/fixtures/distill/ (about 60 KB):

  rollouts.jsonl         8 lines {"prompt_ids": [...], "completion_ids": [...]},
                         the grpo rows in the order TRL's loss batch holds
                         them (after its seeded sampler permutation and its
                         shuffle of the generation batch; the same order in
                         every case, checked); completions end with EOS (1)
                         unless truncated at max_completion_length 6 (two
                         rows); no rewards
  expected.json          per case (schema below) and "_meta"
  expected.safetensors   "<case>.<PEFT key>": the adapter after the one
                         optimizer step (f32; keys as adapter_model.safetensors
                         writes them, e.g.
                         base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
  FORMULAS.md            what TRL 1.16's DistillationTrainer computes, exactly
                         (from FORMULAS below), and its defaults

LoRA on the student: r 4, lora_alpha 8 (scale 2), target_modules q_proj and
v_proj, dropout 0, no bias, f32.

Every case: DistillationTrainer on the CPU in f32, per_device_train_batch_size
8 (the whole file: one generation batch, one optimizer step), max_steps 1,
gradient_accumulation_steps 1, max_completion_length 6, seed 42, bf16 False,
gradient_checkpointing False, max_grad_norm 0 (clipping off),
lr_scheduler "constant", warmup 0, weight_decay 0, logging_steps 1,
report_to none, use_vllm False; optim "sgd" (momentum 0) lr 0.1 unless said;
every other DistillationConfig setting at TRL 1.16's default (TRL_DEFAULTS
below, checked against the dataclass). Cases b<beta>.t<temperature>[.<variant>]:

  b1.0.t1.0          beta 1.0: reverse KL(student || teacher), TRL's default
  b0.0.t1.0          beta 0.0: forward KL(teacher || student)
  b0.5.t1.0          beta 0.5: the (symmetric) Jensen-Shannon divergence
  b0.5.t0.7          beta 0.5, temperature 0.7 (both models' logits / 0.7,
                     and the entropy metric)
  b1.0.t1.0.adamw    optim "adamw_torch" (betas (0.9, 0.999), eps 1e-8),
                     lr 1e-3
  b0.5.t1.0.init     student = PeftModel of adapters/init (lora_B != 0, so
                     lora_A gets a gradient too)

expected.json, per case:
  "settings"                 beta, temperature, optim ("sgd" | "adamw_torch"),
                             learning_rate, start ("fresh" | "init"),
                             student_adapter, student, teacher (paths relative
                             to the repository), per_device_train_batch_size,
                             gradient_accumulation_steps, max_steps,
                             max_completion_length, num_items_in_batch (36:
                             the completion tokens of the batch, EOS
                             included), seed, weight_decay, max_grad_norm,
                             lr_scheduler_type, warmup_steps, shuffle_dataset,
                             rollouts
  "loss"                     the loss TRL's compute_loss returned (f32 value)
  "logged"                   EVERY value TRL logged at step 1, TRL's names,
                             less step_time (a timing): loss, grad_norm,
                             learning_rate, epoch, entropy, num_tokens,
                             completions/mean_length, completions/min_length,
                             completions/max_length, completions/clipped_ratio,
                             completions/mean_terminated_length,
                             completions/min_terminated_length,
                             completions/max_terminated_length
  "per_token_divergence_f64" per row of rollouts.jsonl (file order), the
                             divergence of each completion token, f64,
                             hand-computed (TRL's f32 values agree within the
                             tolerance, checked)
  "per_token_entropy_f64"    the same for the student's entropy
"_meta": versions, student, teacher, tokenizer, LoRA, token ids, TRL's eos
ids, where each rollouts.jsonl row comes from in grpo/rollouts.jsonl and
the generation order, TRL 1.16's DistillationConfig defaults (checked), the
TrainingArguments defaults (checked) and the f64 check's largest
differences.

How TRL runs on fixed completions: the dataset has 8 rows {"prompt": the
prompt string, "row": i}, one per grpo/rollouts.jsonl row (TRL's own
tokenization of the strings gives exactly the files' prompt_ids, checked);
DistillationTrainer._generate_single_turn (the transformers-generate path,
which returns each row's completion ids, cut after the first EOS) is
replaced by one that returns row i's completion_ids for the dataset row i
that TRL put in that slot of the generation batch (read from the "row"
column, which TRL passes through: remove_unused_columns is False). TRL then
does everything else itself: padding, masks, num_items_in_batch, the
shuffle, both forwards, the loss, the step, the metrics. The chunked
divergence function TRL's loss calls is wrapped (not replaced) to record its
per-token divergences and entropies.

Checks, each failing the script: the student and teacher are what is said
above (vocab 128 both, teacher f32, different sizes); TRL's tokenization of
the prompts gives the prompt_ids; TRL's loss batch holds exactly the rows
of rollouts.jsonl in file order (prompt_ids unpadded, completions
right-padded with the pad id 1 to the longest, 6, completion_mask 1 exactly
on each completion's ids, EOS included), the same in every case; TRL
generated once; num_items_in_batch is 36; TRL's initial adapter is
adapters/fresh (fresh) or adapters/init; TRL 1.16's DistillationConfig and
TrainingArguments defaults are TRL_DEFAULTS / HF_DEFAULTS; TRL's loss is
the sum of its own per-token divergences / 36; and every case is recomputed
independently in f64 (a plain transformers + PEFT forward of the student
and a plain transformers forward of the teacher, each row unpadded, the
formulas of FORMULAS.md on full logits, autograd for the gradient, the SGD /
AdamW step by hand): the set of logged metric names must be exactly the
recomputed one, and the loss, every logged metric, grad_norm, the per-token
divergences and entropies, and the adapter after the step must agree with
TRL within 1e-5 (the largest differences are printed and stored in _meta).

Reuses scripts/make_grpo_fixtures.py's helpers by importing it (importing
runs only its idempotent trl_environment() and definitions); the same
workaround applies (datasets 5.2.0 could not fingerprint a pyarrow table
here, so the fingerprint is a hash of the rows and caching is off).
"""

import json
import math
import os
import sys
import tempfile

from fixture_steps import trl_environment

trl_environment()

import torch
from safetensors.torch import save_file

import make_grpo_fixtures as grpo
from fixture_steps import contiguous, finish, hand_step, step, tiny_llama

ROOT = grpo.ROOT
OUT = os.path.join(ROOT, "tests", "fixtures", "distill")
GRPO_DIR = grpo.OUT  # the shared inputs (rollouts, adapters): read only
STUDENT_DIR = grpo.MODEL_DIR
TEACHER_DIR = os.path.join(ROOT, "tests", "fixtures", "qlora", "llama")
EOS_ID = grpo.EOS_ID
SEED = grpo.SEED
MAX_COMPLETION = grpo.MAX_COMPLETION
VOCAB = 128
TOL = 1e-5

OPTS = grpo.OPTS  # sgd lr 0.1, adamw_torch lr 1e-3

# TRL 1.16.0's DistillationConfig defaults (checked against the dataclass
# below); the cases keep them unless they say otherwise.
TRL_DEFAULTS = {
    "beta": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
    "max_completion_length": 512, "shuffle_dataset": True, "pad_to_multiple_of": "auto", "disable_dropout": False,
    "remove_unused_columns": False, "use_vllm": False, "max_tool_calling_iterations": None,
    "generation_kwargs": None, "teacher_model_init_kwargs": None, "teacher_model_name_or_path": None,
    "cache_implementation": None, "log_completions": False, "learning_rate": 1e-6, "logging_steps": 10,
    "gradient_checkpointing": True, "bf16": None,
}
# TrainingArguments defaults that matter here (checked too).
HF_DEFAULTS = dict(grpo.HF_DEFAULTS, optim="adamw_torch_fused", include_num_input_tokens_seen="no")


def case(beta, temperature, variant=None, **kw):
    name = f"b{beta}.t{temperature}" + (f".{variant}" if variant else "")
    c = {"name": name, "beta": beta, "temperature": temperature, "opt": "sgd", "learning_rate": None,
         "start": "fresh"}
    assert set(kw) <= set(c), sorted(set(kw) - set(c))
    c.update(kw)
    if c["learning_rate"] is None:
        c["learning_rate"] = OPTS[c["opt"]]["learning_rate"]
    return c


CASES = [
    case(1.0, 1.0),
    case(0.0, 1.0),
    case(0.5, 1.0),
    case(0.5, 0.7),
    case(1.0, 1.0, "adamw", opt="adamw"),
    case(0.5, 1.0, "init", start="init"),
]

FORMULAS = r"""# On-policy distillation in TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/distillation_trainer.py,
distillation_config.py, base_config.py, kernels/chunked_divergence.py: on
the CPU its torch tile functions, not the Triton kernels; trainer/utils.py:
RepeatSampler, shuffle_sequence_dict, pad) with transformers 5.24.0 and peft
0.21.2. scripts/make_distill_fixtures.py checks it numerically: every case
of tests/fixtures/distill/expected.json is recomputed in f64 from these
formulas and agrees with TRL within 1e-5 (loss, every logged metric, the
per-token divergences and entropies, the adapter after the step).
Notation: i indexes the rows (one completion each) of the batch, t the
completion tokens, m[i,t] the loss mask, V = 128 the shared vocabulary.

## 1. The batch

- The dataset has a "prompt" column. DistillationTrainer is one completion
  per prompt (no groups: RepeatSampler with mini_repeat_count 1); the
  generation batch is per_device_train_batch_size x processes x
  gradient_accumulation_steps rows, drawn in a seeded random permutation
  (shuffle_dataset True, torch.Generator seeded with args.seed). A prompt
  wanted several times is simply several dataset rows.
- String prompts are tokenized with `processing_class(text=prompts)` (the
  fixture tokenizer adds BOS, id 0).
- Generation (the student, sampling at `temperature`; replaced by the
  fixture) returns each row's completion ids up to and including the first
  EOS; the EOS ids are `[tokenizer.eos_token_id] +
  model.generation_config.eos_token_id` = [1, 2] for the fixture student
  (so id 2 also ends a completion). Nothing after the first EOS is kept,
  so no token after an EOS is ever in the batch or in the mask; a
  completion without EOS is truncated at max_completion_length ids.
- Padding: prompts LEFT-padded with the pad id (tokenizer.pad_token, else
  EOS: 1 here), prompt_mask 0 on the padding; completions RIGHT-padded with
  the pad id to the batch's longest completion (not to
  max_completion_length); completion_mask 1 on every completion id (the EOS
  included), 0 on padding. pad_to_multiple_of "auto" pads nothing off
  Neuron. The fixture's prompts all have 5 ids, so nothing is left-padded.
- loss mask = completion_mask (times tool_mask in tool-calling runs, which
  zeroes tool-result tokens; no tools here).
- num_items_in_batch = sum of the loss mask over the WHOLE generation batch
  of all processes, computed once at generation (here 36 = the completion
  lengths 4+2+6+5+4+6+3+6 in grpo order, EOS included).
- After generation the generation batch's rows are permuted
  (shuffle_sequence_dict: torch.randperm from the global RNG) and split
  into gradient_accumulation_steps micro-batches (one here). The order
  changes nothing but the order of float sums; tests/fixtures/distill/
  rollouts.jsonl lists the rows in the order of the batch the loss sees.
- input = cat(prompt_ids, completion_ids), attention_mask =
  cat(prompt_mask, completion_mask); no position_ids (positions 0..len-1).

## 2. The two distributions (temperature T)

Both the student (with its LoRA adapter active) and the teacher (frozen,
eval mode, under no_grad) run their BACKBONE on the same input; TRL keeps
the last hidden state at the positions that predict the completion tokens
(the position before each completion token) and projects it with each
model's own lm_head (f32 matmul; the teacher may be wider than the student,
only the vocabulary must match). Then, for completion token t of row i:
    zs = student_logits / T,   zt = teacher_logits / T
    log ps = log_softmax(zs),  log pt = log_softmax(zt)     (over V)
(Logit scales / final softcapping are applied before the division for
models that have them; Llama has none.) The completion token itself plays
no role: the loss compares full distributions at each position.

## 3. The per-token divergence (beta = DistillationConfig.beta, default 1.0)

    beta = 0:   D = sum_v pt (log pt - log ps)              forward KL(teacher || student)
    beta = 1:   D = sum_v ps (log ps - log pt)              reverse KL(student || teacher)
    else:       log M = log((1 - beta) ps + beta pt)         (mixture; beta weighs the TEACHER)
                D = beta sum_v pt (log pt - log M) + (1 - beta) sum_v ps (log ps - log M)
beta 0 and 1 are special-cased: the mixture formula itself would give 0 at
beta = 0 (M = ps) and 0 at beta = 1 (M = pt), not the two KLs. beta 0.5 is
the ordinary Jensen-Shannon divergence. beta must lie in [0, 1]. There is
no reference model and no KL penalty: beta only selects the divergence.

## 4. The loss

    loss = sum_{i,t} m[i,t] D[i,t] / num_items_in_batch'
    num_items_in_batch' = max(num_items_in_batch, 1) / num_processes
(the count of section 1, over the whole generation batch: with gradient
accumulation each micro-batch's loss is its token sum over the generation
batch's count, so the accumulated gradient is the token mean; the trainer
sets loss_is_scaled_for_ga, so transformers divides by nothing more).
Gradient to the student only (the teacher's logits are constants; only the
LoRA tensors train):
    dD/dzs_v = ps_v - pt_v                                     beta = 0
    dD/dzs_v = ps_v (log ps_v - log pt_v - D)                   beta = 1
    dD/dzs_v = (1 - beta) ps_v (log ps_v - log M_v - KL(ps || M))   else
and d zs = d logits / T.

## 5. The optimizer step

The logged grad_norm is the global L2 norm of all trainable gradients
before clipping (transformers 5.24 logs it also when max_grad_norm is 0,
which turns clipping off; the default 1.0 clips). SGD (momentum 0):
p -= lr g. AdamW ("adamw_torch", betas (0.9, 0.999), eps 1e-8,
weight_decay 0 here): m = 0.1 g; v = 0.001 g^2 (step 1); p -= lr / (1 -
0.9) m / (sqrt(v) / sqrt(1 - 0.999) + eps) (every trainable tensor
counts, also a fresh lora_A's whose gradient is 0 because lora_B = 0).
lr_scheduler "constant": lr.

## 6. Logged metrics (names as logged; one log per optimizer step with
logging_steps 1; with logging_steps > 1 each is the mean of its values in
the window, NaNs dropped)

From the Trainer: loss (section 4), grad_norm, learning_rate, epoch (1.0
here: one step is one pass over the 8 prompts).
From the generation (over the whole generation batch):
- num_tokens: state.num_input_tokens_seen, the cumulative sum over rows of
  len(prompt_ids) + len(completion_ids) (unpadded, EOS included): 40 + 36
  = 76 here
- completions/mean_length, /min_length, /max_length: of len(completion_ids)
- completions/clipped_ratio: fraction of rows whose last id is not in
  eos_token_ids + [pad_token_id] (= [1, 2, 1])
- completions/mean_terminated_length, /min_..., /max_...: over the rows
  that are not truncated (0.0 if none)
From the loss:
- entropy: the student's entropy at temperature T, pooled over the loss
  tokens: sum_{i,t} m H / sum_{i,t} m with H = -sum_v ps log ps (TRL forms
  it as logsumexp(zs) - sum_v ps zs). Divided by the batch's own token
  count, not num_items_in_batch (equal here).
- step_time: wall time (not recorded in the fixture).
Not logged: no divergence / KL metric besides the loss, no reward, no
teacher entropy; tools/* only with tools.

## 7. TRL 1.16 DistillationConfig defaults (checked by the script)

beta 1.0 (reverse KL); temperature 1.0; top_p 1.0; top_k 0; min_p None;
repetition_penalty 1.0; max_completion_length 512; shuffle_dataset True;
pad_to_multiple_of "auto" (None off Neuron); disable_dropout False;
remove_unused_columns False; use_vllm False; max_tool_calling_iterations
None; generation_kwargs None; teacher_model_name_or_path None;
teacher_model_init_kwargs None; cache_implementation None; log_completions
False. No lmbda / seq_kd (every batch is on-policy), no num_generations.
Training defaults that differ from transformers': learning_rate 1e-6,
logging_steps 10, gradient_checkpointing True, bf16 None (-> True unless
fp16). From TrainingArguments: optim "adamw_torch_fused", max_grad_norm
1.0, lr_scheduler_type "linear", warmup_steps 0, weight_decay 0.0, AdamW
betas (0.9, 0.999), eps 1e-8, gradient_accumulation_steps 1, seed 42,
include_num_input_tokens_seen "no" (num_tokens is TRL's own count).

## 8. The fixture (tests/fixtures/distill)

Student tests/fixtures/llama/gqa_llama3 (f32, vocab 128, hidden 32) with
LoRA r 4, alpha 8, q_proj and v_proj, dropout 0; start
tests/fixtures/grpo/adapters/fresh (TRL builds it from peft_config after
set_seed(42); checked identical) or adapters/init (a PeftModel). Teacher
tests/fixtures/qlora/llama (plain f32, vocab 128, hidden 128), frozen.
Tokenizer tests/fixtures/preference/tokenizer (BOS 0, EOS 1, pad = EOS).
The 8 (prompt, completion) pairs of tests/fixtures/grpo/rollouts.jsonl, in
rollouts.jsonl in the order of TRL's loss batch; generation replaced so
TRL's batch holds exactly them. One optimizer step on all 8 rows: SGD lr
0.1 (AdamW lr 1e-3 for the .adamw case), no clipping, constant lr, seed 42.
"""


# ---------------------------------------------------------------------------
# Inputs (read only).

def grpo_rows():
    """The 8 (prompt_ids, completion_ids) pairs of grpo/rollouts.jsonl, in
    its order, rewards dropped."""
    return [{"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"]}
            for r in grpo.read_rollouts("rollouts.jsonl")]


def teacher_model(dtype=torch.float32):
    m = tiny_llama(TEACHER_DIR, dtype).eval()
    m.requires_grad_(False)
    return m


@step("inputs")
def check_inputs():
    from safetensors import safe_open
    from transformers import AutoConfig
    tok = grpo.tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token) == (grpo.BOS_ID, EOS_ID, None)
    for s, ids in zip(grpo.PROMPTS, grpo.PROMPT_IDS):
        assert tok(s)["input_ids"] == ids, (s, tok(s)["input_ids"], ids)
    rows = grpo_rows()
    assert len(rows) == 8 and len({(tuple(r["prompt_ids"]), tuple(r["completion_ids"])) for r in rows}) == 8
    for r in rows:
        c = r["completion_ids"]
        assert r["prompt_ids"] in grpo.PROMPT_IDS
        assert 1 <= len(c) <= MAX_COMPLETION and 2 not in c and EOS_ID not in c[:-1], c
        assert c[-1] == EOS_ID or len(c) == MAX_COMPLETION, c
    s_cfg, t_cfg = AutoConfig.from_pretrained(STUDENT_DIR), AutoConfig.from_pretrained(TEACHER_DIR)
    assert s_cfg.vocab_size == t_cfg.vocab_size == VOCAB, (s_cfg.vocab_size, t_cfg.vocab_size)
    assert (s_cfg.hidden_size, t_cfg.hidden_size) == (32, 128)
    with safe_open(os.path.join(TEACHER_DIR, "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}, ("the teacher is not a plain f32 checkpoint", dtypes)
    for a in ("fresh", "init"):
        assert os.path.exists(os.path.join(grpo.adapter_dir(a), "adapter_model.safetensors")), a


# ---------------------------------------------------------------------------
# TRL runs.

def trainer_class():
    """DistillationTrainer with (1) generation replaced by the file's
    completions (dataset row i gets grpo row i's completion), (2) the
    generation batch, the loss batch and the loss recorded."""
    from trl import DistillationTrainer

    class Fixed(DistillationTrainer):
        def _generate_and_score_completions(self, inputs):
            self.fixture_pending = [int(x["row"]) for x in inputs]
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self.fixture_pending = None
            self.fixture_generated.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                           for k, v in out.items()})
            return out

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
            assert images is None and not multimodal_fields and not has_tool_images and not self.use_vllm
            rows = self.fixture_pending
            assert rows is not None and len(rows) == len(prompt_ids), (rows, len(prompt_ids))
            out = []
            for p, j in zip(prompt_ids, rows):
                src = self.fixture_rows[j]
                assert [int(x) for x in p] == src["prompt_ids"], ("TRL's tokenization", list(p), src)
                out.append(list(src["completion_ids"]))
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.fixture_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                        for k, v in inputs.items()})
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
            self.fixture_losses.append((loss[0] if return_outputs else loss).detach().float().item())
            return loss

    return Fixed


class DivergenceRecorder:
    """Stands in for ChunkedDivergenceFunction in TRL's trainer module: calls
    it unchanged and keeps a copy of its per-token outputs."""
    original = None
    calls = []

    @staticmethod
    def apply(*args):
        div, ent = DivergenceRecorder.original.apply(*args)
        DivergenceRecorder.calls.append({"divergence": div.detach().clone(), "entropy": ent.detach().clone(),
                                         "beta": args[6], "temperature": args[7]})
        return div, ent


def run_trl(c, rows):
    """Runs the case through DistillationTrainer. Returns the initial adapter,
    the adapter after the step, the loss, the logged metrics, the loss
    batch's and the generation's row order (indices into grpo's file) and
    TRL's per-token divergences and entropies (per loss-batch row)."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import DistillationConfig
    import trl.trainer.distillation_trainer as dt
    cls = trainer_class()
    states = []

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            states.append(grpo.adapter_state(model))

    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        for key in ("beta", "temperature"):
            if c[key] != TRL_DEFAULTS[key]:
                extra[key] = c[key]
        args = DistillationConfig(
            output_dir=tmp, per_device_train_batch_size=len(rows), gradient_accumulation_steps=1, max_steps=1,
            max_completion_length=MAX_COMPLETION, optim=OPTS[c["opt"]]["optim"], learning_rate=c["learning_rate"],
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
            save_strategy="no", report_to="none", bf16=False, fp16=False, gradient_checkpointing=False,
            use_cpu=True, seed=SEED, use_vllm=False, dataloader_num_workers=0, disable_tqdm=True, **extra)
        assert args.pad_to_multiple_of is None and args.shuffle_dataset is True
        assert (args.beta, args.temperature) == (c["beta"], c["temperature"]), (args.beta, args.temperature)
        kw = {}
        if c["start"] == "fresh":
            model = grpo.base_model()
            kw["peft_config"] = grpo.lora_config()
        else:
            model = grpo.load_adapter(grpo.adapter_dir("init"))
        teacher = teacher_model()
        trainer = cls(model=model, teacher_model=teacher, args=args,
                      train_dataset=Dataset.from_list([{"prompt": grpo.PROMPTS[grpo.PROMPT_IDS.index(r["prompt_ids"])],
                                                        "row": i} for i, r in enumerate(rows)]),
                      processing_class=grpo.tokenizer(), callbacks=[AfterStep()], **kw)
        trainer.remove_callback(PrinterCallback)  # transformers prints every log dict with disable_tqdm
        trainer.fixture_rows = rows
        trainer.fixture_pending = None
        trainer.fixture_generated, trainer.fixture_inputs, trainer.fixture_losses = [], [], []
        assert trainer.eos_token_ids == [EOS_ID, 2], trainer.eos_token_ids
        assert trainer._tokenizer.pad_token_id == EOS_ID
        assert (trainer.beta, trainer.temperature) == (c["beta"], c["temperature"])
        tm = trainer.teacher_model
        assert tm is not None and not any(p.requires_grad for p in tm.parameters())
        assert next(trainer.teacher_model.parameters()).dtype == torch.float32
        pm = trainer.model
        assert list(pm.peft_config) == ["default"], list(pm.peft_config)
        trainable = sorted(n for n, p in pm.named_parameters() if p.requires_grad)
        assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable), trainable
        init = grpo.adapter_state(pm)
        saved = grpo.load_safetensors(grpo.adapter_dir(c["start"]))
        assert init.keys() == saved.keys() and all(torch.equal(init[k], saved[k]) for k in saved), \
            ("the trainer's initial adapter differs from the saved one", c["name"])
        DivergenceRecorder.original = dt.ChunkedDivergenceFunction
        DivergenceRecorder.calls = []
        dt.ChunkedDivergenceFunction = DivergenceRecorder
        try:
            trainer.train()
        finally:
            dt.ChunkedDivergenceFunction = DivergenceRecorder.original
        logs = [dict(e) for e in trainer.state.log_history if "loss" in e]
    calls = DivergenceRecorder.calls
    assert len(logs) == 1 == len(states) == len(trainer.fixture_losses) == len(trainer.fixture_inputs) == len(calls), \
        (len(logs), len(states), len(trainer.fixture_losses), len(calls))
    assert logs[0]["step"] == 1, logs[0]
    assert len(trainer.fixture_generated) == 1, "TRL generated more than once"
    assert (calls[0]["beta"], calls[0]["temperature"]) == (c["beta"], c["temperature"])
    gen, batch = trainer.fixture_generated[0], trainer.fixture_inputs[0]
    gen_order = grpo.batch_rows(gen, rows)
    order = grpo.batch_rows(batch, rows)
    n_items = gen["num_items_in_batch"]
    assert torch.equal(batch["num_items_in_batch"], n_items)
    assert int(n_items) == sum(len(r["completion_ids"]) for r in rows) == int(batch["completion_mask"].sum())
    B, K = batch["completion_ids"].shape
    div = calls[0]["divergence"].view(B, K)
    ent = calls[0]["entropy"].view(B, K)
    mask = batch["completion_mask"].bool()
    # Off Triton every position (padding included) is projected; TRL zeroes
    # the padding's divergence and entropy after this function returns.
    assert div.numel() == B * K and bool(torch.isfinite(div).all()) and bool(torch.isfinite(ent).all())
    per_div = [div[i, :int(mask[i].sum())].double().tolist() for i in range(B)]
    per_ent = [ent[i, :int(mask[i].sum())].double().tolist() for i in range(B)]
    # TRL's loss is its own per-token divergences summed over the mask / num_items_in_batch.
    own = (div * mask).sum() / n_items.clamp(min=1.0)
    assert abs(own.item() - trainer.fixture_losses[0]) <= 1e-7 * max(1.0, abs(own.item())), \
        (own.item(), trainer.fixture_losses[0])
    return {"init": init, "after": states[0], "loss": trainer.fixture_losses[0], "log": logs[0], "order": order,
            "gen_order": gen_order, "num_items_in_batch": int(n_items), "divergence": per_div, "entropy": per_ent,
            "width": K}


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

def divergence_f64(ls, lt, beta):
    """Per position: the divergence of FORMULAS.md section 3 from the
    student's and the teacher's log-probabilities [C, V]."""
    ps, pt = ls.exp(), lt.exp()
    if beta == 0.0:
        return (pt * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ps * (ls - lt)).sum(-1)
    log_m = torch.log((1 - beta) * ps + beta * pt)
    return beta * (pt * (lt - log_m)).sum(-1) + (1 - beta) * (ps * (ls - log_m)).sum(-1)


def hand(c, rows):
    """The case by FORMULAS.md in f64: loss, metrics, the adapter after the
    step, per-token divergences and entropies per row."""
    from peft import get_peft_model_state_dict
    T, beta = c["temperature"], c["beta"]
    pol = grpo.f64_policy(c["start"])  # adapters/fresh or adapters/init, f64, LoRA trainable
    teacher = teacher_model(torch.float64)
    named = dict(pol.named_parameters())
    keys = list(get_peft_model_state_dict(pol).keys())
    pname = {k: k.replace(".weight", ".default.weight") for k in keys}
    for p in named.values():
        p.grad = None
    divs, ents = [], []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        zs = pol(input_ids=ids).logits[0, P - 1:P + C - 1] / T
        with torch.no_grad():
            zt = teacher(input_ids=ids).logits[0, P - 1:P + C - 1] / T
        assert zs.dtype == zt.dtype == torch.float64 and zs.shape == (C, VOCAB)
        ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
        divs.append(divergence_f64(ls, lt, beta))
        ents.append(-(ls.exp() * ls).sum(-1).detach())
    n_items = sum(len(r["completion_ids"]) for r in rows)
    loss = torch.cat(divs).sum() / n_items
    loss.backward()
    grads = {k: named[pname[k]].grad.detach().clone() for k in keys}
    gnorm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    entropy = (torch.cat(ents).sum() / n_items).item()
    met = {"loss": loss.item(), "grad_norm": gnorm, "learning_rate": c["learning_rate"], "epoch": 1.0,
           "entropy": entropy}
    met.update(grpo.completion_metrics(rows))
    adam = {k: (torch.zeros_like(named[pname[k]]), torch.zeros_like(named[pname[k]])) for k in keys}
    hand_step({k: named[pname[k]] for k in keys}, grads, c["opt"], c["learning_rate"], 1, adam)
    after = {k: named[pname[k]].detach().clone() for k in keys}
    zero_grad = sorted(k for k, g in grads.items() if not g.any())
    return {"metrics": met, "after": after, "divergence": [d.detach().tolist() for d in divs],
            "entropy": [e.tolist() for e in ents], "zero_grad": zero_grad}


# ---------------------------------------------------------------------------

def settings_of(c, n_items):
    return {"beta": c["beta"], "temperature": c["temperature"], "optim": OPTS[c["opt"]]["optim"],
            "learning_rate": c["learning_rate"], "start": c["start"],
            "student_adapter": os.path.relpath(grpo.adapter_dir(c["start"]), ROOT),
            "student": os.path.relpath(STUDENT_DIR, ROOT), "teacher": os.path.relpath(TEACHER_DIR, ROOT),
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 1,
            "max_completion_length": MAX_COMPLETION, "num_items_in_batch": n_items, "seed": SEED,
            "weight_decay": 0.0, "max_grad_norm": 0.0, "lr_scheduler_type": "constant", "warmup_steps": 0,
            "shuffle_dataset": True, "rollouts": "rollouts.jsonl"}


def max_diff(a, b):
    """Largest |a - b| over (nested) lists of numbers."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        return max([0.0] + [max_diff(x, y) for x, y in zip(a, b)])
    return abs(a - b)


def write_rollouts(rows):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "rollouts.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"]}) + "\n")


@step("cases")
def cases():
    import dataclasses
    import accelerate, datasets, peft, transformers, trl
    from trl import DistillationConfig
    defaults = {f.name: f.default for f in dataclasses.fields(DistillationConfig)}
    for k, v in {**TRL_DEFAULTS, **HF_DEFAULTS}.items():
        assert defaults[k] == v, ("TRL default differs from TRL_DEFAULTS", k, defaults[k], v)
    src = grpo_rows()
    expected, tensors, worst = {}, {}, {}
    order = gen_order = None
    for c in CASES:
        name = c["name"]
        t = run_trl(c, src)
        if order is None:
            order, gen_order = t["order"], t["gen_order"]
            rows = [src[j] for j in order]  # rollouts.jsonl: the loss batch's order
            write_rollouts(rows)
        assert t["order"] == order and t["gen_order"] == gen_order, (name, t["order"], order)
        h = hand(c, rows)
        logged = {k: v for k, v in t["log"].items() if k not in grpo.TIMING_KEYS and k != "step"}
        assert set(logged) == set(h["metrics"]), (name, sorted(set(logged) ^ set(h["metrics"])))
        assert logged["loss"] == t["loss"], (name, logged["loss"], t["loss"])
        diffs = {"loss": abs(h["metrics"]["loss"] - t["loss"]),
                 "metrics": max(abs(h["metrics"][k] - logged[k]) for k in logged),
                 "adapter": max((h["after"][k] - t["after"][k].double()).abs().max().item() for k in h["after"]),
                 "per_token_divergence": max_diff(h["divergence"], t["divergence"]),
                 "per_token_entropy": max_diff(h["entropy"], t["entropy"])}
        assert h["after"].keys() == t["after"].keys()
        for k in sorted(t["after"]):
            tensors[f"{name}.{k}"] = t["after"][k]
        for k, v in diffs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        moved = max((t["after"][k] - t["init"][k]).abs().max().item() for k in t["after"])
        print(f"{name:18s} loss {t['loss']:.7f} entropy {logged['entropy']:.6f} grad_norm {logged['grad_norm']:.6f}"
              f" (adapter moved by {moved:.2e}; zero-gradient tensors {len(h['zero_grad'])})  f64 check: "
              + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        assert moved > 1e-4, (name, moved)
        # A fresh adapter (lora_B = 0) gives lora_A no gradient; adapters/init does.
        if c["start"] == "fresh":
            assert h["zero_grad"] and all(".lora_A." in k for k in h["zero_grad"]), h["zero_grad"]
        else:
            assert not h["zero_grad"], h["zero_grad"]
        expected[name] = {"settings": settings_of(c, t["num_items_in_batch"]), "loss": t["loss"], "logged": logged,
                          "per_token_divergence_f64": h["divergence"], "per_token_entropy_f64": h["entropy"]}
    # The three divergences differ (beta selects which), and temperature matters.
    losses = {n: e["loss"] for n, e in expected.items()}
    assert len({round(losses[n], 6) for n in ("b1.0.t1.0", "b0.0.t1.0", "b0.5.t1.0", "b0.5.t0.7")}) == 4, losses
    assert losses["b1.0.t1.0"] == losses["b1.0.t1.0.adamw"], "same start, same loss before the step"
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "accelerate": accelerate.__version__,
                     "datasets": datasets.__version__},
        "student": os.path.relpath(STUDENT_DIR, ROOT),
        "teacher": os.path.relpath(TEACHER_DIR, ROOT),
        "teacher_note": "plain f32 checkpoint (the unquantized weights of the qlora fixture), loaded in f32, "
                        "frozen; vocab 128, hidden 128, 2 layers",
        "tokenizer": os.path.relpath(grpo.TOKENIZER_DIR, ROOT),
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": grpo.TARGETS, "dropout": 0.0},
        "bos_token_id": grpo.BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "trl_eos_token_ids": [EOS_ID, 2],
        "source_rollouts": os.path.relpath(os.path.join(GRPO_DIR, "rollouts.jsonl"), ROOT),
        "rollouts_rows_from_source": order,
        "generation_order_from_source": gen_order,
        "trl_distillation_defaults": TRL_DEFAULTS, "trainingarguments_defaults": HF_DEFAULTS,
        "f64_check_max_abs_diff": worst,
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected.safetensors"))
    os.chmod(os.path.join(OUT, "expected.safetensors"), 0o644)  # safetensors creates it 0600
    print("rollouts.jsonl rows (grpo indices):", order, "; generation order:", gen_order)
    print("f64 check, worst over all cases:", worst)
    assert all(v < TOL for v in worst.values()), worst


def write_formulas():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)


if __name__ == "__main__":
    import accelerate, datasets, peft, safetensors, tokenizers, transformers, trl
    print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "peft",
          peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "tokenizers",
          tokenizers.__version__, "safetensors", safetensors.__version__)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]}")
    check_inputs()
    write_formulas()
    cases()
    finish()
