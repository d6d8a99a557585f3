#!/usr/bin/env python3
"""Build the RLOO fixtures (offline RLOO on given completions, the RLOO
sibling of hlo-train's `train --objective grpo --rollouts FILE`) from TRL's
own RLOOTrainer.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets,
accelerate, safetensors and PyTorch are installed (made with torch 2.9.1
run on CPU, trl 1.16.0, transformers 5.24.0, peft 0.21.2, accelerate
1.15.0, datasets 5.2.0); it needs no GPU and no network, and takes about 15
seconds:

    python3 scripts/make_rloo_fixtures.py

(e.g. `PYTHONPATH=DIR python3 scripts/make_rloo_fixtures.py` with the
packages installed under DIR, as for scripts/make_grpo_fixtures.py; two runs
reproduce the files byte for byte on the machine that made them; elsewhere
the f32 numbers can move by an ulp or so.)

It is scripts/make_grpo_fixtures.py's sibling and shares its inputs, which it
READS and never writes: the tiny f32 model tests/fixtures/llama/gqa_llama3
(vocab 128; its generation_config says eos_token_id 2, which TRL 1.16 also
treats as an EOS), the tokenizer tests/fixtures/preference/tokenizer/ (BOS
id 0, EOS id 1, no pad token: TRL pads with EOS), and from tests/fixtures/grpo/:

  rollouts.jsonl             8 rows {"prompt_ids", "completion_ids",
                             "reward"}: 2 prompts x G = 4 completions, rows
                             1-4 prompt 1's group, rows 5-8 prompt 2's.
                             Both prompts are 5 ids (BOS first: no left
                             padding); completions 2..6 ids, EOS (1) last
                             when they ended, two truncated at
                             max_completion_length 6.
  rollouts_tied.jsonl        the same with group 2's rewards all 0.5
  rollouts_two_rewards.jsonl the same rows with {"rewards": {"a": x, "b": y}}:
                             reward functions "a" and "b", reward_weights
                             [1.0, 0.5]
  adapters/fresh/            PEFT adapter as the trainer creates it from
                             peft_config (set_seed(42): lora_A
                             kaiming-uniform, lora_B = 0; checked equal to
                             RLOOTrainer's in every fresh case)
  adapters/init/             random adapter, A and B ~ N(0, 0.1)
  adapters/ref/              another: the reference of the "ref" cases

and writes tests/fixtures/rloo/ (about 200 KB):

  expected.json              per case (schema below) and "_meta"
  expected.safetensors       "<case>.step<k>.<PEFT key>": the adapter after
                             optimizer step k (f32, keys as
                             adapter_model.safetensors writes them, e.g.
                             base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
  FORMULAS.md                what TRL 1.16's RLOOTrainer computes, exactly
                             (from FORMULAS below), and its defaults

LoRA everywhere: r 4, lora_alpha 8 (scale 2), target_modules q_proj and
v_proj, dropout 0, no bias, f32.

Cases are named b<beta>.mu<num_iterations>[.<variant>]. Every case:
RLOOTrainer on the CPU in f32, per_device_train_batch_size 8 (the whole
file), num_generations 4, max_completion_length 6,
gradient_accumulation_steps 1, steps_per_generation default (1), seed 42,
bf16 False, gradient_checkpointing False, max_grad_norm 0 (clipping OFF),
lr_scheduler "constant", warmup 0, weight_decay 0, use_vllm False,
logging_steps 1, report_to none; optim "sgd" (momentum 0) lr 0.1 unless
said; max_steps = num_iterations (mu = 2: the second step reuses the same
rollouts, advantages and old log-probs). Every other RLOO setting at TRL
1.16's default (epsilon 0.2, epsilon_high = epsilon, temperature 1.0,
normalize_advantages False, reward_clip_range None, ...: FORMULAS.md section
9, checked against RLOOConfig). Start "fresh" (peft_config, adapters/fresh;
reference, when beta != 0: the base with the adapter disabled) unless said.

  b0.0.mu1, b0.0.mu2, b0.05.mu1, b0.05.mu2   the base cases (fresh)
                            (b0.05.mu{1,2} equal b0.0.mu{1,2} but for the
                            kl metric: the penalty is 0, section 3 of
                            FORMULAS.md)
  b0.05.mu{1,2}.init        policy = a PeftModel loaded from adapters/init;
                            TRL's reference: its frozen copy of that adapter
                            ("ref"), so the KL is 0 at generation (checked)
  b0.05.mu{1,2}.ref         policy adapters/init, reference adapters/ref (TRL
                            1.16 has no option for a reference adapter: the
                            script loads adapters/ref into TRL's "ref"
                            adapter after the trainer is built, so TRL's own
                            code runs the reference forward with it); the KL
                            penalty is non-zero and changes the advantages
                            (checked against the advantages without it)
  b0.5.mu1.ref              the same with beta 0.5
  b0.0.mu1.norm             normalize_advantages True
  b0.05.mu1.ref.norm        normalize_advantages True, the .ref start
  b0.0.mu2.eps_high         epsilon_high 0.28, SGD lr 1.0: at step 2 some
                            sequences are clipped on both sides (clip_ratio
                            metrics > 0, checked); a sequence with A > 0 and
                            ratio ~1.8 is clipped at 1.28, so its loss value
                            (not its zero gradient) depends on epsilon_high
                            (checked: with 1.2 step 2's loss would differ)
  b0.0.mu1.adamw,           optim "adamw_torch" (betas (0.9, 0.999), eps
  b0.05.mu2.ref.adamw       1e-8), lr 1e-3
  b0.05.mu2.ref.temp0.7     temperature 0.7 (every log-prob, the entropy)
  b0.0.mu1.tied             rollouts_tied.jsonl (frac_reward_zero_std 0.5,
                            checked)
  b0.0.mu1.two_rewards      rollouts_two_rewards.jsonl, reward_weights
                            [1.0, 0.5]
  b0.05.mu1.ref.clip        reward_clip_range (-0.25, 0.8): four rewards
                            clipped (checked); the logged "reward" is the
                            UNCLIPPED mean (checked)

expected.json, per case:
  "settings"          per_device_train_batch_size, num_generations,
                      max_steps, beta, num_iterations, epsilon,
                      epsilon_high (the value used), epsilon_high_given
                      (the case's number, else null), max_completion_length,
                      temperature, optim ("sgd" | "adamw_torch"),
                      learning_rate, rollouts (file name, relative to
                      tests/fixtures/grpo/), reward_funcs (TRL's order),
                      reward_weights (list or null), start ("fresh" |
                      "init" | "ref"), normalize_advantages (bool),
                      reward_clip_range ([min, max] or null); and, for
                      information, policy_adapter, reference, weight_decay,
                      max_grad_norm, lr_scheduler_type, warmup_steps,
                      gradient_accumulation_steps, steps_per_generation,
                      mask_truncated_completions, seed
  "advantages"        TRL's advantage of each row, file order (f32 values)
  "kl_per_row_f64"    (beta != 0) per row sum_t (old - ref) m, f64
                      (hand-computed; the penalty is beta times it)
  "logps_start_f64"   per row, the policy's log-prob of each completion
                      token before step 1 at the case's temperature (f64,
                      hand-computed): TRL's old log-probs, summed per row
  "ref_logps_f64"     (beta != 0) the same for the reference
  "steps"             one per optimizer step: {"step": k, "loss": the loss
                      TRL's compute_loss returned, "grad_norm": as logged,
                      "logged": EVERY value TRL logged for step k, TRL's
                      names (loss, grad_norm, learning_rate, epoch, entropy,
                      clip_ratio/..., and at the step that generated:
                      num_tokens, completions/..., kl (beta != 0), reward,
                      reward_std, rewards/<fn>/mean|std,
                      frac_reward_zero_std), less step_time (a timing)}
"_meta": versions, model, LoRA, token ids, TRL's eos ids, TRL 1.16's RLOO
defaults (checked), the TrainingArguments defaults (checked) and the f64
check's largest differences.

Checks, each failing the script: TRL's tokenization of the prompts gives the
files' prompt_ids; the prompt_ids, completion_ids and completion_mask in
TRL's batch are the file's rows (at every step; generation happens once);
TRL's initial adapter is adapters/fresh (fresh) or adapters/init, and its
"ref" adapter exists exactly for a PeftModel (whatever beta); TRL 1.16's
RLOOConfig defaults are those of FORMULAS.md; the per-case checks above; and
every case is recomputed independently in f64 (plain transformers + PEFT
forward of each row unpadded, the formulas of FORMULAS.md, autograd for the
gradient, the SGD / AdamW steps by hand): the set of logged metric names
must be exactly the recomputed one, and the loss, every logged metric,
grad_norm, the advantages, TRL's old, reference and policy log-probs (per
token and per row), the per-row KL and the adapter after every step must
agree with TRL within 1e-5 (the largest differences are printed and stored
in _meta). No sequence ratio lies within 1e-4 of a clipping bound (so f32
and f64 take the same branch).

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
from fixture_steps import contiguous, finish, hand_step, step

ROOT = grpo.ROOT
OUT = os.path.join(ROOT, "tests", "fixtures", "rloo")
GRPO_DIR = grpo.OUT  # the shared inputs (rollouts, adapters): read only
EOS_ID = grpo.EOS_ID
SEED = grpo.SEED
G = grpo.G
MAX_COMPLETION = grpo.MAX_COMPLETION
REWARD_WEIGHTS = grpo.REWARD_WEIGHTS
TOL = 1e-5

OPTS = grpo.OPTS

# TRL 1.16.0's RLOOConfig defaults (checked against the dataclass below);
# the cases keep them unless they say otherwise.
TRL_DEFAULTS = {
    "beta": 0.05, "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "reward_weights": None,
    "normalize_advantages": False, "reward_clip_range": None, "mask_truncated_completions": False,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
    "num_generations": 2, "max_completion_length": 512, "steps_per_generation": None,
    "generation_batch_size": None, "shuffle_dataset": True, "pad_to_multiple_of": "auto",
    "disable_dropout": False, "sync_ref_model": False, "router_aux_loss_coef": None, "learning_rate": 1e-6,
    "logging_steps": 10, "gradient_checkpointing": True, "bf16": None, "remove_unused_columns": False,
    "use_vllm": False, "use_transformers_continuous_batching": False,
}
HF_DEFAULTS = grpo.HF_DEFAULTS


def case(beta, mu, variant=None, **kw):
    """A case's settings: every RLOO setting TRL's default unless given."""
    name = f"b{beta}.mu{mu}" + (f".{variant}" if variant else "")
    c = {"name": name, "beta": beta, "num_iterations": mu, "max_steps": mu, "epsilon": 0.2, "epsilon_high": None,
         "temperature": 1.0, "opt": "sgd", "learning_rate": None, "start": "fresh", "rollouts": "rollouts.jsonl",
         "normalize_advantages": False, "reward_clip_range": None}
    assert set(kw) <= set(c), sorted(set(kw) - set(c))
    c.update(kw)
    if c["learning_rate"] is None:
        c["learning_rate"] = OPTS[c["opt"]]["learning_rate"]
    return c


CASES = [
    case(0.0, 1), case(0.0, 2), case(0.05, 1), case(0.05, 2),
    case(0.05, 1, "init", start="init"),
    case(0.05, 2, "init", start="init"),
    case(0.05, 1, "ref", start="ref"),
    case(0.05, 2, "ref", start="ref"),
    case(0.5, 1, "ref", start="ref"),
    case(0.0, 1, "norm", normalize_advantages=True),
    case(0.05, 1, "ref.norm", start="ref", normalize_advantages=True),
    case(0.0, 2, "eps_high", epsilon_high=0.28, learning_rate=1.0),
    case(0.0, 1, "adamw", opt="adamw"),
    case(0.05, 2, "ref.adamw", start="ref", opt="adamw"),
    case(0.05, 2, "ref.temp0.7", start="ref", temperature=0.7),
    case(0.0, 1, "tied", rollouts="rollouts_tied.jsonl"),
    case(0.0, 1, "two_rewards", rollouts="rollouts_two_rewards.jsonl"),
    case(0.05, 1, "ref.clip", start="ref", reward_clip_range=(-0.25, 0.8)),
]

FORMULAS = r"""# RLOO in TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/rloo_trainer.py, rloo_config.py,
base_config.py, trainer/utils.py: RepeatSampler, nanstd, nanmin, nanmax,
use_adapter, add_fused_lm_head, shuffle_sequence_dict) with transformers
5.24.0 and peft 0.21.2. scripts/make_rloo_fixtures.py checks it numerically:
every case of tests/fixtures/rloo/expected.json is recomputed in f64 from
these formulas, and every logged metric, the loss, grad_norm, the
advantages, the log-probs and the adapter after each step agree with TRL
within 1e-5. Notation: N rows (completions) in the generation batch, G =
num_generations per prompt, i indexes rows, t completion tokens, m[i,t] the
completion mask, L_i = sum_t m[i,t] (the length of completion i, its EOS
included).

RLOO differs from TRL's GRPO (tests/fixtures/grpo/FORMULAS.md) in four
places: the advantage is a leave-one-out difference (no std scaling), the
KL to the reference is a first-order penalty subtracted from the REWARD at
generation time (not a loss term), the importance ratio is one number per
SEQUENCE (the exponent of the summed per-token log-ratio) and the loss is
the plain mean over sequences; and the old log-probs are ALWAYS computed at
generation (also with num_iterations 1).

## 1. Rollouts and the batch

As GRPO (its FORMULAS.md section 1): the "prompt" column is tokenized by
`processing_class(text=prompts)` (BOS id 0 added by the fixture
tokenizer); RepeatSampler yields generation_batch_size =
per_device_train_batch_size x processes x steps_per_generation rows (8
here), generation_batch_size / G prompts each repeated G times in a row
(prompt order a seeded permutation with shuffle_dataset True), the same
prompts num_iterations x steps_per_generation times. Generation (replaced by
the fixture) returns per row the completion ids up to and including the
first EOS, the EOS ids being `[tokenizer.eos_token_id] +
model.generation_config.eos_token_id` = [1, 2] for the fixture model;
truncated completions keep max_completion_length ids. Prompts are
LEFT-padded with the pad id (tokenizer.pad_token, else EOS: 1 here),
completions RIGHT-padded with it to the batch's longest completion;
completion_mask 1 on the completion ids (EOS included); input =
cat(prompt, completion), attention_mask = cat(prompt_mask,
completion_mask); no position_ids (the fixture's prompts all have 5 ids, so
nothing is left-padded). mask_truncated_completions (default False) would
zero the mask of truncated rows. After scoring, the generation batch's rows
are permuted (shuffle_sequence_dict) and split into steps_per_generation
micro-batches.

## 2. Per-token log-probabilities and entropies (temperature T)

Only completion tokens are scored. For completion token t of row i, with z
the LM head's logits at the position before it, times 1/T (TRL's fused LM
head, f32):
    logp[i,t] = z[target] - logsumexp(z)
    H[i,t]    = -sum_v softmax(z)_v log softmax(z)_v
0 on padding. The same T (RLOOConfig.temperature, default 1.0) is used for
the policy, the old and the reference log-probs and the entropy metric.
Sequence log-prob: S_i = sum_t m[i,t] logp[i,t].

## 3. Old and reference log-probs (at generation, once per generation batch)

Under no_grad, with the policy as it is before the first optimizer step on
this generation batch (train mode; no dropout here):
- old[i,t]: the policy's logp; old_logps_i = sum_t m[i,t] old[i,t] (TRL's
  batch key "old_logps", one number per row). Computed for EVERY
  num_iterations, 1 included (unlike GRPO, which uses logp.detach() when
  mu = 1): with mu = 1 the ratio of section 5 is exp(S_i - old_logps_i),
  1 up to f32 rounding (exactly 1.0 in every case here: the generation and
  the loss forwards give bit-identical per-token log-probs, checked), with
  the gradient of exp(S_i).
- ref[i,t] (only when beta != 0): the reference's logp:
  * a plain model + peft_config (the fixture's "fresh" start): the same
    model with the adapter disabled (`use_adapter(model, None)` =
    `disable_adapter()`), i.e. the BASE;
  * a PeftModel (the "init" start): TRL adds a second adapter "ref" with the
    "default" adapter's LoraConfig and copies every ".default." tensor into
    ".ref." (frozen; not in the optimizer); the reference forward runs with
    "ref" active. NOTE: RLOOTrainer creates this "ref" adapter for ANY
    PeftModel, also when beta == 0 (GRPOTrainer only when beta != 0); it is
    then unused. (peft 0.17-0.19 with LoRA target_parameters: the base.)
  * a plain model without PEFT: a second model loaded from the config's
    name or path.
  No option names another adapter as the reference; sync_ref_model is
  refused with PEFT. The fixture's "ref" start loads adapters/ref into TRL's
  "ref" adapter after the trainer is built (policy adapters/init).
  With "fresh" or "init", ref == old at generation, so the KL penalty is 0
  (exactly, here: kl 0.0) and beta changes nothing for the first generation
  batch, whatever mu: the KL is never part of the loss (b0.05.mu2's adapters
  equal b0.0.mu2's bit for bit). Only a reference that differs from the
  policy at generation (the "ref" cases, or later generation batches) makes
  beta act, through the advantages.

## 4. Rewards, the KL penalty and the advantages (f32, once per generation batch)

rewards_per_func[i,k]: reward function k on row i (None -> NaN). Weights w_k
(reward_weights, default all 1.0):
    r_i   = nansum_k w_k rewards_per_func[i,k]     (NaN if every function
            returned None: "unscorable", advantage forced to 0)
    rc_i  = clamp(r_i, lo, hi)                     only if reward_clip_range = (lo, hi)
    kl_i  = sum_t m[i,t] (old[i,t] - ref[i,t])     first-order log ratio, summed
            per sequence (can be negative), only if beta != 0
    R_i   = rc_i - beta kl_i                        (rc_i if beta == 0)
Leave-one-out baseline within row i's group g (G rows; nansum, and the
count of non-NaN rows of the group, n_g, replaces G with unscorable rows):
    b_i = (sum_{j in g} R_j - R_i) / (n_g - 1)
    A_i = R_i - b_i                       (= G/(G-1) (R_i - mean_g R))
With normalize_advantages (default False), over the WHOLE generation batch
(all processes):
    A_i = (A_i - mean(A)) / (std(A) + 1e-4)     std UNBIASED (nanstd, Bessel)
then NaN -> 0. The advantages of a group sum to 0 (before normalisation);
a group of equal R has A = 0. One number per row; computed once, reused at
every step on this batch.

## 5. The loss (every optimizer step)

    S_i     = sum_t m[i,t] logp[i,t]             (current policy, with grad)
    rho_i   = exp(S_i - old_logps_i)             ONE ratio per sequence
    rhoc_i  = clamp(rho_i, 1 - epsilon, 1 + eps_high)
              eps_high = epsilon_high if set, else epsilon (0.2)
    l_i     = -min(rho_i A_i, rhoc_i A_i)
    loss    = (1/B) sum_i l_i                    B = rows of the micro-batch (8)
No KL term, no length normalisation (a long completion's ratio moves
faster: its log-ratio is a sum), no entropy bonus. TRL returns this loss
unscaled and transformers' Trainer divides it by gradient_accumulation_steps
(1 here). Gradient: d l_i = -A_i rho_i dS_i where the clip is inactive, 0
where it is active (rho_i > 1 + eps_high with A_i > 0, or rho_i < 1 -
epsilon with A_i < 0). At the first step on a batch rho = 1, so the loss
value is -mean_i A_i: 0 up to f32 rounding (TRL logs e.g. 2.2e-8), with
or without normalisation; its gradient is not 0.

## 6. num_iterations (mu)

generate_every = steps_per_generation x mu. A generation batch is made at
micro-steps 0, generate_every, ...; the buffered micro-batches (same rows,
same shuffled order, same advantages, same old_logps) are reused in
between: with steps_per_generation 1 and gradient_accumulation_steps 1 each
rollout batch is trained on for mu consecutive optimizer steps, step k's
ratio being pi_theta_k / pi_theta_1 per sequence. The reference and the KL
penalty are computed once, at generation: nothing about them is recomputed
(or logged) at a reused step.

## 7. The optimizer step

As GRPO: the logged grad_norm is the global L2 norm of all trainable
gradients before clipping (transformers 5.24 logs it also when
max_grad_norm is 0, which turns clipping off). SGD (momentum 0): p -= lr g.
AdamW ("adamw_torch", betas (0.9, 0.999), eps 1e-8, weight_decay 0 here):
m = 0.9 m + 0.1 g; v = 0.999 v + 0.001 g^2; p -= lr / (1 - 0.9^k) m /
(sqrt(v) / sqrt(1 - 0.999^k) + eps), k the step number (every trainable
tensor counts, also with an all-zero gradient, as a fresh lora_A's at step
1). lr_scheduler "constant": lr every step.

## 8. Logged metrics (names as logged)

One log per optimizer step (logging_steps 1); with logging_steps > 1 each
is the mean of its values in the window (NaNs dropped).
From the Trainer: loss (section 5), grad_norm, learning_rate, epoch (step /
steps per epoch; an epoch = mu steps here: 0.5 and 1.0 for mu = 2).
Logged ONLY at the step that generated (over the whole generation batch):
- num_tokens: cumulative sum over rows of len(prompt_ids) +
  len(completion_ids) (unpadded, EOS included)
- completions/mean_length, /min_length, /max_length: of len(completion_ids)
- completions/clipped_ratio: fraction of rows whose last id is not in
  eos_token_ids + [pad_token_id]
- completions/mean_terminated_length, /min_..., /max_...: over the
  non-truncated rows (0.0 if none)
- kl (beta != 0 only): sum_{i,t} m (old - ref) / max(sum_{i,t} m, 1), the
  pooled token mean of the first-order log ratio AT GENERATION (not the
  current policy's; so NOT logged at a reused step: with mu = 2 step 2
  logs no kl)
- rewards/<f>/mean, rewards/<f>/std: per reward function f (its __name__),
  nanmean and unbiased nanstd of its UNWEIGHTED rewards
- reward, reward_std: nanmean and unbiased nanstd over rows of r_i, the
  weighted sum BEFORE reward clipping and BEFORE the KL penalty (TRL
  recomputes it from rewards_per_func for logging)
- frac_reward_zero_std: fraction of GROUPS (prompts) whose unbiased std of
  R (AFTER clipping and the KL penalty) is torch.isclose to 0 (rtol 1e-5,
  atol 1e-8). (Per group, GRPO's is per row: the same value when every
  group has G rows.)
Logged at every step, from that step's loss computation (rho_i, A_i of
section 5; the indicators are per SEQUENCE, not per token):
- entropy: pooled token mean of H[i,t] (current policy, temperature T):
  sum m H / max(sum m, 1)
- clip_ratio/low_mean:   mean_i [rho_i < 1 - epsilon and A_i < 0]
- clip_ratio/low_min:    min_i of that indicator (0 or 1)
- clip_ratio/high_mean:  mean_i [rho_i > 1 + eps_high and A_i > 0]
- clip_ratio/high_max:   max_i of that indicator (0 or 1)
- clip_ratio/region_mean: mean_i of the union of the two
- step_time: wall time (not recorded in the fixture)
So step 1 of a mu = 2, beta != 0 case logs: loss, grad_norm,
learning_rate, epoch, num_tokens, completions/{mean,min,max}_length,
completions/clipped_ratio, completions/{mean,min,max}_terminated_length, kl,
rewards/<f>/mean, rewards/<f>/std, reward, reward_std,
frac_reward_zero_std, entropy, clip_ratio/{low_mean, low_min, high_mean,
high_max, region_mean}; step 2 logs only loss, grad_norm, learning_rate,
epoch, entropy and the five clip_ratio/* (and step_time).
Not logged here: aux_loss (MoE), user metrics from reward functions
(log_metric).

## 9. TRL 1.16 RLOOConfig defaults (checked by the script)

beta 0.05 (NOT 0: a reference is used by default); num_iterations 1;
epsilon 0.2; epsilon_high None (= epsilon); reward_weights None (all 1.0);
normalize_advantages False; reward_clip_range None;
mask_truncated_completions False; temperature 1.0; top_p 1.0; top_k 0;
min_p None; repetition_penalty 1.0; num_generations 2 (at least 2
required); max_completion_length 512; steps_per_generation None (=
gradient_accumulation_steps); generation_batch_size None (=
per_device_train_batch_size x processes x steps_per_generation);
shuffle_dataset True; pad_to_multiple_of "auto" (None off Neuron);
disable_dropout False; sync_ref_model False; router_aux_loss_coef None;
remove_unused_columns False; use_vllm False;
use_transformers_continuous_batching False. Training defaults that differ
from transformers': learning_rate 1e-6, logging_steps 10,
gradient_checkpointing True, bf16 None (-> True unless fp16). From
TrainingArguments: max_grad_norm 1.0, lr_scheduler_type "linear",
warmup_steps 0, weight_decay 0.0, AdamW betas (0.9, 0.999), eps 1e-8,
gradient_accumulation_steps 1, seed 42.

## 10. The fixture (tests/fixtures/rloo)

The rollouts and adapters are tests/fixtures/grpo's (rollouts.jsonl,
rollouts_tied.jsonl, rollouts_two_rewards.jsonl: 8 rows, rows 1-4 prompt
1's group, rows 5-8 prompt 2's; adapters/fresh, init, ref), read, not
rewritten. How TRL ran them: the dataset's "prompt" column has the two
prompt strings, which TRL's own tokenization turns into exactly prompt_ids
(checked); RLOOTrainer._generate_single_turn (the transformers-generate
path) is replaced by one that hands out each prompt's completions in file
order; the reward functions ("reward", or "a" and "b") look up the file's
reward of (prompt, completion ids). The script checks that TRL's batch holds
the file's rows at every step. expected.safetensors holds the adapter after
each optimizer step, "<case>.step<k>.<PEFT key>".
"""


# ---------------------------------------------------------------------------
# Inputs (read only).

def rollouts(name):
    return grpo.read_rollouts(name)


def groups_of(rows):
    """{prompt_ids tuple: [completion ids, file order]}; the rows must be
    whole groups of G in a row, one prompt a group."""
    out = {}
    for k in range(0, len(rows), G):
        p = tuple(rows[k]["prompt_ids"])
        assert all(tuple(r["prompt_ids"]) == p for r in rows[k:k + G]) and p not in out, "rows not in groups"
        out[p] = [list(r["completion_ids"]) for r in rows[k:k + G]]
    return out


@step("inputs")
def check_inputs():
    tok = grpo.tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (grpo.BOS_ID, EOS_ID)
    for s, ids in zip(grpo.PROMPTS, grpo.PROMPT_IDS):
        assert tok(s)["input_ids"] == ids, (s, tok(s)["input_ids"], ids)
    for name in ("rollouts.jsonl", "rollouts_tied.jsonl", "rollouts_two_rewards.jsonl"):
        rows = rollouts(name)
        assert len(rows) == 8 and all(r["prompt_ids"] in grpo.PROMPT_IDS for r in rows), name
        groups_of(rows)
        for r in rows:
            c = r["completion_ids"]
            assert 1 <= len(c) <= MAX_COMPLETION and 2 not in c and EOS_ID not in c[:-1], (name, c)
            assert c[-1] == EOS_ID or len(c) == MAX_COMPLETION, (name, c)
    for a in ("fresh", "init", "ref"):
        assert os.path.exists(os.path.join(grpo.adapter_dir(a), "adapter_model.safetensors")), a


# ---------------------------------------------------------------------------
# TRL runs.

def trainer_class():
    """RLOOTrainer with (1) generation replaced by the file's completions,
    (2) the generation batch, each step's inputs and loss, and every
    per-token log-prob forward recorded."""
    from trl import RLOOTrainer

    class Fixed(RLOOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            # One list per row of the generation batch, each prompt G times
            # in a row: hand out its completions in file order.
            assert images is None and not multimodal_fields and not self.use_vllm
            handed = {}
            out = []
            for p in prompt_ids:
                key = tuple(int(i) for i in p)
                k = handed.get(key, 0)
                handed[key] = k + 1
                out.append(list(self.fixture_groups[key][k]))
            assert all(n == self.num_generations == len(self.fixture_groups[k]) for k, n in handed.items()), handed
            return out

        def _generate_and_score_completions(self, inputs):
            self.fixture_in_generation = True
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self.fixture_in_generation = False
            self.fixture_generated.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                           for k, v in out.items()})
            return out

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, **kw):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size=batch_size,
                                                             compute_entropy=compute_entropy, **kw)
            self.fixture_logp_calls.append({"generation": self.fixture_in_generation,
                                            "grad": torch.is_grad_enabled(), "entropy": compute_entropy,
                                            "logps": out[0].detach().clone()})
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            self.fixture_losses.append(loss.detach().float().item())
            self.fixture_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                        for k, v in inputs.items()})
            return loss

    return Fixed


def file_order(t, order, rows):
    """Per-token [B, C] tensor in batch order -> per file row, unpadded."""
    out = [None] * len(rows)
    for i, j in enumerate(order):
        out[j] = t[i, :len(rows[j]["completion_ids"])].tolist()
    return out


def vec_file_order(t, order):
    out = [None] * len(order)
    for i, j in enumerate(order):
        out[j] = t[i].item()
    return out


def run_trl(c):
    """Runs the case through RLOOTrainer. Returns a dict: initial adapter,
    adapter after each step, each step's loss and logged metrics, the
    advantages, old_logps and TRL's per-token log-probs in file order."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import RLOOConfig
    rows = rollouts(c["rollouts"])
    cls = trainer_class()
    states = []

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            states.append(grpo.adapter_state(model))

    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if c["rollouts"] == "rollouts_two_rewards.jsonl":
            extra["reward_weights"] = REWARD_WEIGHTS
        if c["epsilon_high"] is not None:
            extra["epsilon_high"] = c["epsilon_high"]
        if c["normalize_advantages"] != TRL_DEFAULTS["normalize_advantages"]:
            extra["normalize_advantages"] = c["normalize_advantages"]
        if c["reward_clip_range"] is not None:
            extra["reward_clip_range"] = tuple(c["reward_clip_range"])
        if c["temperature"] != TRL_DEFAULTS["temperature"]:
            extra["temperature"] = c["temperature"]
        args = RLOOConfig(
            output_dir=tmp, per_device_train_batch_size=len(rows), num_generations=G,
            max_completion_length=MAX_COMPLETION, gradient_accumulation_steps=1, max_steps=c["max_steps"],
            num_iterations=c["num_iterations"], beta=c["beta"], epsilon=c["epsilon"],
            optim=OPTS[c["opt"]]["optim"], learning_rate=c["learning_rate"], lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
            report_to="none", bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=SEED,
            use_vllm=False, dataloader_num_workers=0, disable_tqdm=True, **extra)
        assert args.steps_per_generation == 1 and args.generation_batch_size == len(rows)
        assert args.pad_to_multiple_of is None
        for key in ("normalize_advantages", "temperature", "epsilon_high", "num_iterations", "beta"):
            assert getattr(args, key) == c[key], (key, getattr(args, key), c[key])
        assert (None if args.reward_clip_range is None else tuple(args.reward_clip_range)) == \
            (None if c["reward_clip_range"] is None else tuple(c["reward_clip_range"]))
        kw = {}
        if c["start"] == "fresh":
            model = grpo.base_model()
            kw["peft_config"] = grpo.lora_config()
        else:
            model = grpo.load_adapter(grpo.adapter_dir("init"))
        trainer = cls(model=model, reward_funcs=grpo.reward_funcs(rows), args=args,
                      train_dataset=Dataset.from_list([{"prompt": p} for p in grpo.PROMPTS]),
                      processing_class=grpo.tokenizer(), callbacks=[AfterStep()], **kw)
        trainer.remove_callback(PrinterCallback)  # transformers prints every log dict with disable_tqdm
        trainer.fixture_groups = groups_of(rows)
        trainer.fixture_in_generation = False
        trainer.fixture_generated, trainer.fixture_inputs = [], []
        trainer.fixture_losses, trainer.fixture_logp_calls = [], []
        assert trainer.eos_token_ids == [EOS_ID, 2], trainer.eos_token_ids
        assert trainer.epsilon_high == settings_of(c)["epsilon_high"], (trainer.epsilon_high, c["name"])
        assert trainer.reward_func_names == grpo.reward_matrix(rows)[1], trainer.reward_func_names
        pm = trainer.model
        has_ref = "ref" in pm.peft_config
        # RLOOTrainer adds "ref" for every PeftModel, whatever beta.
        assert has_ref == (c["start"] != "fresh"), (c["name"], list(pm.peft_config))
        assert trainer.ref_model is None, "a PEFT model has no separate reference model"
        if has_ref:
            for n, p in pm.named_parameters():
                if ".ref." in n:
                    assert not p.requires_grad, n
                    assert torch.equal(p, pm.get_parameter(n.replace(".ref.", ".default."))), n
        if c["start"] == "ref":
            # TRL's "ref" adapter (a copy of the policy's) gets adapters/ref.
            want = grpo.load_safetensors(grpo.adapter_dir("ref"))
            loaded = 0
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if ".ref." in n:
                        p.copy_(want[n.replace(".ref.", ".")])
                        loaded += 1
            assert loaded == len(want), (loaded, len(want))
        init = grpo.adapter_state(pm)
        saved = grpo.load_safetensors(grpo.adapter_dir("fresh" if c["start"] == "fresh" else "init"))
        assert init.keys() == saved.keys() and all(torch.equal(init[k], saved[k]) for k in saved), \
            ("the trainer's initial adapter differs from the saved one", c["name"])
        trainer.train()
        logs = [dict(e) for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == c["max_steps"] == len(states) == len(trainer.fixture_losses), (len(logs), len(states))
    assert len(trainer.fixture_generated) == 1, "TRL generated more than once"
    gen = trainer.fixture_generated[0]
    order = batch_rows(gen, rows)
    calls = trainer.fixture_logp_calls
    gen_calls = [x for x in calls if x["generation"]]
    loss_calls = [x for x in calls if not x["generation"]]
    assert len(gen_calls) == 1 + (c["beta"] != 0.0) and not any(x["grad"] or x["entropy"] for x in gen_calls)
    assert len(loss_calls) == c["max_steps"] and all(x["grad"] and x["entropy"] for x in loss_calls)
    logps = {"old": file_order(gen_calls[0]["logps"], order, rows)}
    if c["beta"] != 0.0:
        logps["ref"] = file_order(gen_calls[1]["logps"], order, rows)
    first = trainer.fixture_inputs[0]
    for inputs in trainer.fixture_inputs:
        batch_rows(inputs, rows)
        for key in ("advantages", "completion_ids", "prompt_ids", "old_logps"):
            assert torch.equal(inputs[key], first[key]), (key, "batch differs between steps")
    o = batch_rows(first, rows)
    logps["policy"] = file_order(loss_calls[0]["logps"], o, rows)  # step 1's forward
    # TRL's step-1 sequence ratio, as _compute_loss forms it (f32).
    seq = (loss_calls[0]["logps"] * first["completion_mask"]).sum(1)
    ratio_dev = (torch.exp(seq - first["old_logps"]) - 1).abs().max().item()
    for k, e in enumerate(logs, start=1):
        assert e["step"] == k, (k, e)
    return {"init": init, "after": states, "losses": trainer.fixture_losses, "logs": logs,
            "advantages": vec_file_order(gen["advantages"], order),
            "old_logps": vec_file_order(gen["old_logps"], order), "logps": logps, "ratio_dev": ratio_dev}


def batch_rows(batch, rows):
    return grpo.batch_rows(batch, rows)


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

def unbiased_std(x):
    return grpo.unbiased_std(x)


def rewards_f64(c, rows, kl_row):
    """(advantages, the rewards R after clip and penalty, the unclipped
    weighted sums r, generation-time reward metrics); no penalty when
    kl_row is None."""
    R, names = grpo.reward_matrix(rows)
    weights = REWARD_WEIGHTS if c["rollouts"] == "rollouts_two_rewards.jsonl" else None
    w = torch.tensor(weights if weights is not None else [1.0] * R.size(1), dtype=torch.float64)
    r = (R * w).sum(1)
    metrics = {"reward": r.mean().item(), "reward_std": unbiased_std(r).item()}
    for k, n in enumerate(names):
        metrics[f"rewards/{n}/mean"] = R[:, k].mean().item()
        metrics[f"rewards/{n}/std"] = unbiased_std(R[:, k]).item()
    rr = r
    if c["reward_clip_range"] is not None:
        lo, hi = c["reward_clip_range"]
        rr = rr.clamp(min=lo, max=hi)
    if kl_row is not None:
        rr = rr - c["beta"] * kl_row
    g = rr.view(-1, G)
    A = (g - (g.sum(1, keepdim=True) - g) / (G - 1)).reshape(-1)
    if c["normalize_advantages"]:
        A = (A - A.mean()) / (unbiased_std(A) + 1e-4)
    std_g = torch.stack([unbiased_std(g) for g in rr.view(-1, G)])
    metrics["frac_reward_zero_std"] = torch.isclose(std_g, torch.zeros_like(std_g)).double().mean().item()
    return A, rr, r, metrics


def hand(c, rows):
    """The case by FORMULAS.md in f64: per step (loss, metrics, adapter after
    the step), advantages, start and reference log-probs, per-row KL."""
    from peft import get_peft_model_state_dict
    T, beta = c["temperature"], c["beta"]
    eps_lo = c["epsilon"]
    eps_hi = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    N = len(rows)
    mask = torch.zeros(N, MAX_COMPLETION, dtype=torch.float64)
    for i, r in enumerate(rows):
        mask[i, :len(r["completion_ids"])] = 1
    pol = grpo.f64_policy(c["start"])
    named = dict(pol.named_parameters())
    keys = list(get_peft_model_state_dict(pol).keys())
    pname = {k: k.replace(".weight", ".default.weight") for k in keys}
    with torch.no_grad():
        old, _ = grpo.token_stats(pol, rows, T)
        ref = grpo.token_stats(grpo.f64_reference(c["start"]), rows, T)[0] if beta != 0.0 else None
    old_seq = (old * mask).sum(-1)
    gen_metrics = {}
    kl_row = None
    if beta != 0.0:
        kl_row = ((old - ref) * mask).sum(-1)
        gen_metrics["kl"] = (((old - ref) * mask).sum() / mask.sum()).item()
    A, R_used, r_raw, reward_metrics = rewards_f64(c, rows, kl_row)
    A_plain = rewards_f64(c, rows, None)[0]  # the same without the KL penalty
    gen_metrics.update(reward_metrics)
    gen_metrics.update(grpo.completion_metrics(rows))
    lr = c["learning_rate"]
    mu = c["num_iterations"]
    adam = {k: (torch.zeros_like(named[pname[k]]), torch.zeros_like(named[pname[k]])) for k in keys}
    steps = []
    for k_step in range(1, c["max_steps"] + 1):
        for p in named.values():
            p.grad = None
        lp, ent = grpo.token_stats(pol, rows, T)
        S = (lp * mask).sum(-1)
        rho = torch.exp(S - old_seq)
        rhoc = torch.clamp(rho, 1 - eps_lo, 1 + eps_hi)
        per_seq = -torch.min(rho * A, rhoc * A)
        loss = per_seq.mean()
        loss.backward()
        grads = {k: named[pname[k]].grad.detach().clone() for k in keys}
        gnorm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
        rd = rho.detach()
        lo = ((rd < 1 - eps_lo) & (A < 0)).double()
        hi = ((rd > 1 + eps_hi) & (A > 0)).double()
        met = {"loss": loss.item(), "grad_norm": gnorm, "learning_rate": lr, "epoch": k_step / mu,
               "entropy": ((ent.detach() * mask).sum() / mask.sum()).item(),
               "clip_ratio/low_mean": lo.mean().item(), "clip_ratio/low_min": lo.min().item(),
               "clip_ratio/high_mean": hi.mean().item(), "clip_ratio/high_max": hi.max().item(),
               "clip_ratio/region_mean": torch.maximum(lo, hi).mean().item()}
        if k_step == 1:  # logged once per generation
            met.update(gen_metrics)
        # Every clipping decision is far from its bound (no f32/f64 flip).
        bounds = [1 - eps_lo, 1 + eps_hi] + ([1 + eps_lo] if eps_hi != eps_lo else [])
        margin = min((rd - b).abs().min().item() for b in bounds)
        assert margin > 1e-4, ("a ratio within 1e-4 of a clipping bound", c["name"], k_step, margin)
        # eps_high: sequences whose clipping the asymmetric bound decides
        between = ((rd > 1 + eps_lo) & (rd <= 1 + eps_hi) & (A > 0)).double().sum().item()
        hand_step({k: named[pname[k]] for k in keys}, grads, c["opt"], lr, k_step, adam)
        after = {k: named[pname[k]].detach().clone() for k in keys}
        steps.append({"metrics": met, "after": after, "between_eps": between, "margin": margin,
                      "ratios": rd.tolist()})

    def per_row(t):
        return [t[i, :len(r["completion_ids"])].tolist() for i, r in enumerate(rows)]
    return {"steps": steps, "advantages": A.tolist(), "advantages_plain": A_plain.tolist(),
            "rewards_used": R_used.tolist(), "rewards_raw": r_raw.tolist(), "logps": per_row(old),
            "old_seq": old_seq.tolist(), "ref_logps": None if ref is None else per_row(ref),
            "kl_row": None if kl_row is None else kl_row.tolist()}


# ---------------------------------------------------------------------------

def settings_of(c):
    eps_hi = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    reference = {"fresh": "base (adapter disabled)",
                 "init": "adapters/init (TRL's 'ref' copy of the policy's adapter)",
                 "ref": "adapters/ref (loaded into TRL's 'ref' adapter)"}[c["start"]]
    rows = rollouts(c["rollouts"])
    return {"per_device_train_batch_size": len(rows), "num_generations": G, "max_steps": c["max_steps"],
            "beta": c["beta"], "num_iterations": c["num_iterations"], "epsilon": c["epsilon"],
            "epsilon_high": eps_hi, "epsilon_high_given": c["epsilon_high"],
            "max_completion_length": MAX_COMPLETION, "temperature": c["temperature"],
            "optim": OPTS[c["opt"]]["optim"], "learning_rate": c["learning_rate"], "rollouts": c["rollouts"],
            "reward_funcs": grpo.reward_matrix(rows)[1],
            "reward_weights": REWARD_WEIGHTS if c["rollouts"] == "rollouts_two_rewards.jsonl" else None,
            "start": c["start"], "normalize_advantages": c["normalize_advantages"],
            "reward_clip_range": None if c["reward_clip_range"] is None else list(c["reward_clip_range"]),
            "policy_adapter": "adapters/fresh" if c["start"] == "fresh" else "adapters/init",
            "reference": reference if c["beta"] != 0.0 else "none (beta 0)",
            "weight_decay": 0.0, "max_grad_norm": 0.0, "lr_scheduler_type": "constant", "warmup_steps": 0,
            "gradient_accumulation_steps": 1, "steps_per_generation": 1, "mask_truncated_completions": False,
            "seed": SEED}


TIMING_KEYS = grpo.TIMING_KEYS


def max_diff(a, b):
    """Largest |a - b| over (nested) lists of numbers."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        return max([0.0] + [max_diff(x, y) for x, y in zip(a, b)])
    return abs(a - b)


def run_case(c):
    name = c["name"]
    rows = rollouts(c["rollouts"])
    t = run_trl(c)
    h = hand(c, rows)
    diffs = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0, "advantages": 0.0, "logps": 0.0, "old_logps": 0.0,
             "kl_per_row": 0.0}
    entry_steps = []
    tensors = {}
    for k, (hs, log, loss, after) in enumerate(zip(h["steps"], t["logs"], t["losses"], t["after"]), start=1):
        logged = {key: v for key, v in log.items() if key not in TIMING_KEYS and key != "step"}
        assert set(logged) == set(hs["metrics"]), (name, k, sorted(set(logged) ^ set(hs["metrics"])))
        assert logged["loss"] == loss, (name, k, logged["loss"], loss)
        diffs["loss"] = max(diffs["loss"], abs(hs["metrics"]["loss"] - loss))
        for key in logged:
            diffs["metrics"] = max(diffs["metrics"], abs(hs["metrics"][key] - logged[key]))
        for key, v in hs["after"].items():
            diffs["adapter"] = max(diffs["adapter"], (v - after[key].double()).abs().max().item())
            tensors[f"{name}.step{k}.{key}"] = after[key]
        entry_steps.append({"step": k, "loss": loss, "grad_norm": logged["grad_norm"], "logged": logged})
    diffs["advantages"] = max_diff(h["advantages"], t["advantages"])
    diffs["old_logps"] = max_diff(h["old_seq"], t["old_logps"])
    diffs["logps"] = max(max_diff(h["logps"], t["logps"]["old"]), max_diff(h["logps"], t["logps"]["policy"]))
    if "ref" in t["logps"]:
        diffs["logps"] = max(diffs["logps"], max_diff(h["ref_logps"], t["logps"]["ref"]))
        trl_kl = [sum(a - b for a, b in zip(ra, rb)) for ra, rb in zip(t["logps"]["old"], t["logps"]["ref"])]
        diffs["kl_per_row"] = max_diff(h["kl_row"], trl_kl)
    trl_ratio_dev = t["ratio_dev"]  # TRL's step-1 |exp(S - old_logps) - 1|
    print(f"{name:24s} loss " + " ".join(f"{s['loss']:.7f}" for s in entry_steps) +
          "  f64 check: " + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()) +
          f"  (ratios >= {min(s['margin'] for s in h['steps']):.1e} from a clip bound;"
          f" TRL's step-1 |ratio - 1| <= {trl_ratio_dev:.1e})")
    entry = {"settings": settings_of(c), "steps": entry_steps, "advantages": t["advantages"],
             "logps_start_f64": h["logps"]}
    if h["ref_logps"] is not None:
        entry["ref_logps_f64"] = h["ref_logps"]
        entry["kl_per_row_f64"] = h["kl_row"]
    return name, entry, tensors, diffs, h, trl_ratio_dev


def check_case(c, entry, h):
    """The per-case checks the docstring promises."""
    name = c["name"]
    steps = [s["logged"] for s in entry["steps"]]
    s1 = steps[0]
    if c["beta"] != 0.0:
        if c["start"] in ("fresh", "init"):  # reference == policy at generation
            assert abs(s1["kl"]) <= 1e-7 and max(abs(x) for x in h["kl_row"]) < 1e-12, (name, s1["kl"])
        else:  # "ref": the penalty moves the advantages
            moved = max_diff(h["advantages"], h["advantages_plain"])
            assert abs(s1["kl"]) > 1e-3 and moved > 1e-3, (name, s1["kl"], moved)
            print(f"  {name}: kl {s1['kl']:.6f}; the KL penalty moves the advantages by up to {moved:.6f}")
    if c["num_iterations"] == 2:
        assert "kl" not in steps[1] and "reward" not in steps[1] and "num_tokens" not in steps[1], steps[1]
        lo, hi = min(h["steps"][1]["ratios"]), max(h["steps"][1]["ratios"])
        assert hi - lo > 1e-3, (name, lo, hi)  # step 2's ratios have moved from 1
    if name.endswith(".eps_high"):
        s2 = steps[1]
        clip = {k: v for k, v in s2.items() if k.startswith("clip_ratio/")}
        assert any(v > 0 for v in clip.values()), clip
        assert all(v == 0 for k, v in s1.items() if k.startswith("clip_ratio/")), s1
        # epsilon_high decides step 2's loss value: a sequence with A > 0 is
        # clipped at 1.28, not 1.2 (its gradient is 0 either way).
        r2, a = h["steps"][1]["ratios"], h["advantages"]

        def loss_with(hi):
            return sum(-min(r * x, min(max(r, 1 - c["epsilon"]), 1 + hi) * x) for r, x in zip(r2, a)) / len(a)
        assert abs(loss_with(c["epsilon_high"]) - s2["loss"]) < 1e-5, (loss_with(c["epsilon_high"]), s2["loss"])
        assert abs(loss_with(c["epsilon"]) - s2["loss"]) > 1e-3, "epsilon_high does not change step 2's loss"
        print(f"  {name}: step 2 ratios {['%.4f' % x for x in h['steps'][1]['ratios']]}, advantages "
              f"{['%.3f' % x for x in h['advantages']]}; clip metrics {clip}; "
              f"{h['steps'][1]['between_eps']:.0f} sequence(s) with A > 0 and ratio in (1.2, 1.28]; step 2's loss "
              f"{s2['loss']:.6f}, with epsilon_high = epsilon it would be {loss_with(c['epsilon']):.6f}")
    if name.endswith(".tied"):
        assert s1["frac_reward_zero_std"] == 0.5, s1
    if c["normalize_advantages"]:
        a = torch.tensor(h["advantages"], dtype=torch.float64)
        assert abs(a.mean().item()) < 1e-9 and abs(unbiased_std(a).item() - 1.0) < 1e-3, a
    if c["reward_clip_range"] is not None:
        lo, hi = c["reward_clip_range"]
        raw = h["rewards_raw"]
        clipped = sum(1 for x in raw if x < lo or x > hi)
        clipped_mean = sum(min(max(x, lo), hi) for x in raw) / len(raw)
        assert clipped > 0, raw
        assert abs(s1["reward"] - sum(raw) / len(raw)) < 1e-6 and abs(s1["reward"] - clipped_mean) > 1e-3, \
            (s1["reward"], clipped_mean)
        print(f"  {name}: {clipped} rewards clipped; logged reward {s1['reward']} = the unclipped mean "
              f"(clipped mean {clipped_mean})")


@step("cases")
def cases():
    import dataclasses
    import accelerate, datasets, peft, transformers, trl
    from trl import RLOOConfig
    defaults = {f.name: f.default for f in dataclasses.fields(RLOOConfig)}
    for k, v in {**TRL_DEFAULTS, **HF_DEFAULTS}.items():
        assert defaults[k] == v, ("TRL default differs from TRL_DEFAULTS", k, defaults[k], v)
    os.makedirs(OUT, exist_ok=True)
    expected, tensors = {}, {}
    worst = {}
    worst_ratio = 0.0
    for c in CASES:
        name, entry, after, diffs, h, ratio_dev = run_case(c)
        for k, v in diffs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        worst_ratio = max(worst_ratio, ratio_dev)
        expected[name] = entry
        tensors.update(after)
        check_case(c, entry, h)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "accelerate": accelerate.__version__,
                     "datasets": datasets.__version__},
        "model": os.path.relpath(grpo.MODEL_DIR, ROOT),
        "tokenizer": os.path.relpath(grpo.TOKENIZER_DIR, ROOT),
        "inputs": os.path.relpath(GRPO_DIR, ROOT),
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": grpo.TARGETS, "dropout": 0.0},
        "bos_token_id": grpo.BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "trl_eos_token_ids": [EOS_ID, 2],
        "trl_rloo_defaults": TRL_DEFAULTS, "trainingarguments_defaults": HF_DEFAULTS,
        "f64_check_max_abs_diff": worst,
        "trl_step1_ratio_max_abs_dev_from_1": worst_ratio,
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected.safetensors"))
    os.chmod(os.path.join(OUT, "expected.safetensors"), 0o644)  # safetensors creates it 0600
    print("f64 check, worst over all cases:", worst, "; TRL's step-1 |ratio - 1| <=", worst_ratio)
    assert all(v < TOL for v in worst.values()), worst
    assert worst_ratio == 0.0, ("TRL's step-1 ratio is not exactly 1", worst_ratio)


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
