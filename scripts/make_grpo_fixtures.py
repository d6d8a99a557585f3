#!/usr/bin/env python3
"""Build the GRPO fixtures (offline GRPO on given completions, hlo-train's
`train --objective grpo --rollouts FILE`) from TRL's own GRPOTrainer.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets,
accelerate, safetensors and PyTorch are installed (made with torch
2.9.1+cu128 run on CPU, trl 1.16.0, transformers 5.24.0, peft 0.21.2,
accelerate 1.15.0, datasets 5.2.0, tokenizers 0.23.3, safetensors 0.8.0,
pyarrow 26.0.1); it needs no GPU and no network, and takes about a minute:

    python3 scripts/make_grpo_fixtures.py              # the files below
    python3 scripts/make_grpo_fixtures.py --variants   # only the --variants files

(e.g. `pip install --target DIR torch==2.9.1 trl==1.16.0 transformers==5.24.0
peft==0.21.2 accelerate==1.15.0 datasets==5.2.0 tokenizers==0.23.3
safetensors==0.8.0 pyarrow==26.0.1`, then `PYTHONPATH=DIR python3 ...`; two
runs reproduce the committed files byte for byte on the machine that made
them. Elsewhere the f32 numbers can move by an ulp or so: on an AMD EPYC
machine the default run's expected.json / expected.safetensors differed from
the committed ones by up to 8e-7, the same with the script before --variants
was added; every other file was identical. --variants' files were made on
that machine.)

It reads the tiny f32 model tests/fixtures/llama/gqa_llama3 (vocab 128;
its generation_config says eos_token_id 2, which TRL 1.16 also treats as an
EOS, so no completion contains id 2) and the tokenizer
tests/fixtures/preference/tokenizer/ (BOS id 0, EOS id 1, no pad token: TRL
pads with EOS; printable ASCII bytes are ids 2..95), and writes
tests/fixtures/grpo/ (about 350 KB):

  rollouts.jsonl             8 rows {"prompt_ids", "completion_ids",
                             "reward"}: 2 prompts x G = 4 completions, rows
                             1-4 prompt 1's group, rows 5-8 prompt 2's, in
                             the order TRL's batch receives them. Both
                             prompts are 5 ids (BOS first), so TRL's left
                             padding of prompts adds nothing (transformers 5
                             does not derive positions from the mask).
                             Completions: 2..6 ids, EOS (1) last when they
                             ended, 6 ids without EOS when truncated at
                             max_completion_length 6 (two rows), one of 6
                             ids ending in EOS; the completion mask covers
                             every id. Rewards: group 1 all distinct, group 2
                             two equal.
  rollouts_tied.jsonl        the same with group 2's rewards all 0.5 (std 0,
                             its advantages 0)
  rollouts_two_rewards.jsonl the same rows with {"rewards": {"a": x, "b": y}}
                             instead of "reward": two reward functions "a"
                             and "b" with reward_weights [1.0, 0.5]
  adapters/fresh/            PEFT adapter as GRPOTrainer creates it from
                             peft_config (set_seed(42): lora_A
                             kaiming-uniform, lora_B = 0; checked)
  adapters/init/             random adapter, A and B ~ N(0, 0.1) (seed 1)
  adapters/ref/              another, N(0, 0.1) (seed 2): the reference of
                             the "ref" cases
  expected.json              per case (schema below) and "_meta"
  expected.safetensors       "<case>.step<k>.<PEFT key>": the adapter after
                             optimizer step k (f32, keys as
                             adapter_model.safetensors writes them)
  FORMULAS.md                what TRL 1.16 GRPOTrainer computes, exactly
                             (from FORMULAS below), and its defaults
  expected_variants.json,    --variants only (below): the variant cases,
  expected_variants.safetensors  as expected.json / expected.safetensors

LoRA everywhere: r 4, lora_alpha 8 (scale 2), target_modules q_proj and
v_proj, dropout 0, no bias, f32.

Cases are named <loss_type>.b<beta>.mu<num_iterations>[.<variant>]. Every
case: GRPOTrainer on the CPU in f32, per_device_train_batch_size 8 (the
whole file), num_generations 4, max_completion_length 6,
gradient_accumulation_steps 1, steps_per_generation default (1), seed 42,
bf16 False, gradient_checkpointing False, max_grad_norm 0 (clipping OFF),
lr_scheduler "constant", warmup 0, weight_decay 0, use_vllm False,
logging_steps 1, report_to none; optim "sgd" (momentum 0) lr 0.1 unless
said; max_steps = num_iterations (mu = 2: the second step reuses the same
rollouts with the old log-probs computed before step 1). Every other GRPO
setting at TRL 1.16's default (temperature 1.0, epsilon 0.2, epsilon_high
= epsilon, scale_rewards "group", use_bias_correction_kl True, ...: see
FORMULAS.md section 10). Start "fresh" (peft_config, adapters/fresh;
reference, when beta != 0: the base with the adapter disabled) unless said.

  {grpo,dr_grpo,dapo,bnpo}.b{0.0,0.04}.mu{1,2}   the 16 base cases
  dapo.b0.0.mu1.scale_batch    scale_rewards "batch"
  dapo.b0.0.mu1.scale_none     scale_rewards "none"
  dapo.b0.0.mu2.eps_high       epsilon_high 0.28, SGD lr 1.0: at step 2
                               ratios are clipped on both sides, and some
                               ratio with A > 0 lies in (1.2, 1.28] (clipped
                               only with the default bound; checked)
  dapo.b0.04.mu{1,2}.init      policy = a PeftModel loaded from
                               adapters/init; TRL's reference: its frozen copy
                               of that adapter ("ref"), i.e. adapters/init
  dapo.b0.04.mu{1,2}.ref       policy adapters/init, reference adapters/ref
                               (TRL 1.16 has no option for a reference
                               adapter: the script loads adapters/ref into
                               TRL's "ref" adapter after the trainer is built,
                               so TRL's own code runs the reference forward
                               with it); the KL is non-zero from step 1
  dapo.b0.5.mu1.ref            the same with beta 0.5 (the KL term, and its
                               use_bias_correction_kl gradient, weigh more)
  dapo.b0.0.mu1.adamw,         optim "adamw_torch" (betas (0.9, 0.999), eps
  dapo.b0.04.mu2.adamw         1e-8), lr 1e-3
  dapo.b0.04.mu2.temp0.7       temperature 0.7 (TRL divides the logits by it
                               for every log-prob: policy, old, reference,
                               and for the entropy)
  dapo.b0.0.mu1.tied           rollouts_tied.jsonl
  dapo.b0.0.mu1.two_rewards    rollouts_two_rewards.jsonl, reward_weights
                               [1.0, 0.5]

expected.json, per case:
  "settings"          the settings above (loss_type, beta, num_iterations,
                      max_steps, epsilon, epsilon_high (the value used),
                      scale_rewards, temperature, optim, learning_rate,
                      rollouts, reward_funcs (TRL's order), reward_weights,
                      start, policy_adapter, reference, ...)
  "advantages"        TRL's advantage of each row, file order (f32 values)
  "logps_start_f64"   per row, the policy's log-prob of each completion
                      token before step 1 at the case's temperature (f64,
                      hand-computed; TRL's f32 agree within ~2e-6): mu = 2's
                      old log-probs
  "ref_logps_f64"     (beta != 0) the same for the reference
  "steps"             one per optimizer step: {"step": k, "loss": the loss
                      TRL's compute_loss returned, "grad_norm": as logged,
                      "logged": EVERY value TRL logged for step k, TRL's
                      names (loss, grad_norm, learning_rate, epoch, kl,
                      entropy, clip_ratio/..., and at the step that
                      generated: num_tokens, completions/..., reward,
                      reward_std, rewards/<fn>/mean|std,
                      frac_reward_zero_std), less step_time (a timing)}
"_meta": versions, model, LoRA, token ids, TRL's eos ids, TRL 1.16's GRPO
defaults and the f64 check's largest differences.

Checks, each failing the script: TRL's tokenization of the prompts gives the
file's prompt_ids; the prompt_ids, completion_ids and completion_mask in
TRL's batch are the file's rows (at every step; generation happens once);
TRL's initial adapter is adapters/fresh (fresh) or adapters/init, and its
"ref" adapter exists exactly for a PeftModel with beta != 0; TRL 1.16's
GRPOConfig defaults are those of FORMULAS.md; and every case is recomputed
independently in f64 (plain transformers + PEFT forward of each row
unpadded, the formulas of FORMULAS.md, autograd for the gradient, the SGD /
AdamW steps by hand), the set of logged metric names must be exactly the
recomputed one, and the loss, every logged metric, grad_norm, the
advantages, the start log-probs and the adapter after every step must agree
with TRL within 1e-5 (the largest differences are printed and stored in
_meta).

--variants runs only the cases below and writes only
expected_variants.json and expected_variants.safetensors (same schema as
expected.json / expected.safetensors; "_meta" adds
"trl_grpo_variant_defaults", TRL 1.16's sapo temperatures, checked), and
FORMULAS.md with the same text as the default run (section 12 documents
these cases); it reads rollouts.jsonl and adapters/ and leaves every other
file as it is. Its settings add "sapo_temperature_pos" / "_neg" for sapo;
"importance_sampling_level" and "use_bias_correction_kl" are the case's. The
same checks, and the same 1e-5 f64 check (FORMULAS.md section 12: the
sequence-level weight, cispo, sapo, the KL without its bias correction, and
the metrics each loss type logs); two runs give byte-identical files. Every
setting as above unless said:

  grpo.b0.04.mu2.gspo          importance_sampling_level "sequence" (one
                               ratio per row; at step 2 they differ from 1,
                               checked)
  dapo.b0.0.mu2.gspo           the same with dapo (TRL warns and runs); at
                               step 2 a row's ratio is clipped low
  cispo.b0.0.mu2               epsilon_high 1.05 (cispo's cap is the ratio's
                               absolute maximum, not 1 + epsilon_high), SGD lr
                               1.0: cispo_clip_ratio 0 at step 1, > 0 at
                               step 2 (checked)
  cispo.b0.04.mu2.ref          epsilon_high unset (TRL caps at epsilon, 0.2:
                               every token's weight is 0.2, cispo_clip_ratio
                               the fraction of tokens with A > 0; checked),
                               policy adapters/init, reference adapters/ref
                               as the .ref cases
  sapo.b0.0.mu2                sapo_temperature_pos 1.0, _neg 1.05 (TRL's
                               defaults), SGD lr 1.0
  sapo.b0.04.mu2.temps         sapo_temperature_pos 2.0, _neg 0.5
  dapo.b0.04.mu2.ref.nobias,   dapo.b0.04.mu2.ref and dapo.b0.5.mu1.ref with
  dapo.b0.5.mu1.ref.nobias     use_bias_correction_kl False

One workaround, not touching the numbers: datasets 5.2.0 could not
fingerprint a pyarrow table here (dill PicklingError on MonthDayNano), so the
fingerprint is replaced by a hash of the rows and caching is off.
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

from fixture_steps import contiguous, finish, q_v_lora, step, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
TOKENIZER_DIR = os.path.join(ROOT, "tests", "fixtures", "preference", "tokenizer")
OUT = os.path.join(ROOT, "tests", "fixtures", "grpo")
BOS_ID, EOS_ID = 0, 1
TARGETS = ["q_proj", "v_proj"]
SEED = 42
G = 4                    # num_generations
MAX_COMPLETION = 6       # max_completion_length

# Two prompts of the same length (5 tokens with BOS), so TRL's left padding
# of the prompts adds nothing. They are strings in TRL's dataset; TRL's own
# tokenization gives exactly these ids (checked).
PROMPTS = ["XYZ=", "A+B:"]
PROMPT_IDS = [[0, 57, 58, 59, 30], [0, 34, 12, 35, 27]]
# Per prompt, G completions in file order (each appears in TRL's batch in
# this order): lengths 2..6, EOS (1) last when the completion ended, none
# when it was truncated at max_completion_length. No id 2: the fixture
# model's generation_config declares eos_token_id 2, which TRL 1.16 also
# treats as an EOS (FORMULAS.md section 1).
COMPLETIONS = [
    [[58, 57, 56, 1], [50, 1], [40, 41, 42, 43, 44, 45], [70, 71, 72, 73, 1]],
    [[35, 12, 34, 1], [100, 101, 102, 103, 104, 105], [20, 21, 1], [90, 80, 70, 60, 50, 1]],
]
# rollouts.jsonl: group 1 four distinct rewards, group 2 two equal.
REWARDS = [[1.0, 0.25, -0.5, 0.75], [0.5, 0.5, 1.5, -1.0]]
# rollouts_tied.jsonl: group 2 all equal (std 0: its advantages are 0).
REWARDS_TIED = [[1.0, 0.25, -0.5, 0.75], [0.5, 0.5, 0.5, 0.5]]
# rollouts_two_rewards.jsonl: two reward functions "a" and "b", weights
# REWARD_WEIGHTS (TRL's reward_weights), summed before normalising.
REWARDS_TWO = [[{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}, {"a": -0.5, "b": 2.0}, {"a": 0.5, "b": -1.0}],
               [{"a": 0.25, "b": 0.5}, {"a": 1.0, "b": -0.5}, {"a": 1.0, "b": 1.0}, {"a": -1.0, "b": 0.0}]]
REWARD_WEIGHTS = [1.0, 0.5]
ROLLOUT_FILES = {"rollouts.jsonl": REWARDS, "rollouts_tied.jsonl": REWARDS_TIED,
                 "rollouts_two_rewards.jsonl": REWARDS_TWO}

OPTS = {"sgd": dict(optim="sgd", learning_rate=0.1), "adamw": dict(optim="adamw_torch", learning_rate=1e-3)}

# TRL 1.16.0's GRPOConfig defaults (checked against the dataclass below);
# the cases keep them unless they say otherwise.
TRL_DEFAULTS = {
    "loss_type": "dapo", "beta": 0.0, "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize", "reward_weights": None,
    "importance_sampling_level": "token", "mask_truncated_completions": False, "top_entropy_quantile": 1.0,
    "use_bias_correction_kl": True, "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "off_policy_mask_threshold": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
    "repetition_penalty": 1.0, "num_generations": 8, "max_completion_length": 512, "steps_per_generation": None,
    "generation_batch_size": None, "shuffle_dataset": True, "pad_to_multiple_of": "auto", "disable_dropout": False,
    "cast_lm_head_to_fp32": False, "sync_ref_model": False, "learning_rate": 1e-6, "logging_steps": 10,
    "gradient_checkpointing": True, "bf16": None, "remove_unused_columns": False, "use_vllm": False,
    "vllm_importance_sampling_correction": True,
}
# TrainingArguments defaults that matter here (checked too).
HF_DEFAULTS = {"max_grad_norm": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 0, "weight_decay": 0.0,
               "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "gradient_accumulation_steps": 1,
               "seed": 42}


def case(loss_type="dapo", beta=0.0, mu=1, variant=None, **kw):
    """A case's settings: every GRPO setting TRL's default unless given."""
    name = f"{loss_type}.b{beta}.mu{mu}" + (f".{variant}" if variant else "")
    c = {"name": name, "loss_type": loss_type, "beta": beta, "num_iterations": mu, "max_steps": mu,
         "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group", "temperature": 1.0, "opt": "sgd",
         "learning_rate": None, "start": "fresh", "rollouts": "rollouts.jsonl",
         "importance_sampling_level": "token", "use_bias_correction_kl": True,
         "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}
    assert set(kw) <= set(c), sorted(set(kw) - set(c))
    c.update(kw)
    if c["learning_rate"] is None:
        c["learning_rate"] = OPTS[c["opt"]]["learning_rate"]
    return c


CASES = [case(lt, b, mu) for lt in ("grpo", "dr_grpo", "dapo", "bnpo") for b in (0.0, 0.04) for mu in (1, 2)] + [
    case(variant="scale_batch", scale_rewards="batch"),
    case(variant="scale_none", scale_rewards="none"),
    case(mu=2, variant="eps_high", epsilon_high=0.28, learning_rate=1.0),
    case(beta=0.04, variant="init", start="init"),
    case(beta=0.04, mu=2, variant="init", start="init"),
    case(beta=0.04, variant="ref", start="ref"),
    case(beta=0.04, mu=2, variant="ref", start="ref"),
    case(beta=0.5, variant="ref", start="ref"),
    case(variant="adamw", opt="adamw"),
    case(beta=0.04, mu=2, variant="adamw", opt="adamw"),
    case(beta=0.04, mu=2, variant="temp0.7", temperature=0.7),
    case(variant="tied", rollouts="rollouts_tied.jsonl"),
    case(variant="two_rewards", rollouts="rollouts_two_rewards.jsonl"),
]

# --variants: the other importance-sampling level and loss types, and the KL
# without its bias correction (expected_variants.json / .safetensors).
VARIANT_CASES = [
    case("grpo", 0.04, 2, "gspo", importance_sampling_level="sequence"),
    case("dapo", 0.0, 2, "gspo", importance_sampling_level="sequence"),
    # cispo caps the ratio at epsilon_high itself (not 1 + epsilon_high):
    # 1.05 and SGD lr 1.0 clip some tokens with A > 0 at step 2 (checked).
    case("cispo", 0.0, 2, epsilon_high=1.05, learning_rate=1.0),
    # epsilon_high unset: TRL's cap is epsilon, 0.2, below every ratio.
    case("cispo", 0.04, 2, "ref", start="ref"),
    case("sapo", 0.0, 2, learning_rate=1.0),
    case("sapo", 0.04, 2, "temps", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    case(beta=0.04, mu=2, variant="ref.nobias", start="ref", use_bias_correction_kl=False),
    case(beta=0.5, variant="ref.nobias", start="ref", use_bias_correction_kl=False),
]
# TRL 1.16.0's GRPOConfig defaults the variant cases rely on, besides
# TRL_DEFAULTS (checked with --variants).
TRL_VARIANT_DEFAULTS = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}

FORMULAS = r"""# GRPO in TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/grpo_trainer.py, grpo_config.py,
base_config.py, trainer/utils.py: RepeatSampler, nanstd, use_adapter,
add_fused_lm_head, shuffle_sequence_dict; kernels/chunked_logprob.py) with
transformers 5.24.0 and peft 0.21.2. scripts/make_grpo_fixtures.py checks it
numerically: every case of tests/fixtures/grpo/expected.json is recomputed
in f64 from these formulas, and every logged metric, the loss, grad_norm,
the advantages and the adapter after each step agree with TRL within 1e-5.
Notation: N rows (completions) in the batch, G = num_generations per prompt,
i indexes rows, t completion tokens, m[i,t] the completion mask, L_i =
sum_t m[i,t] (the length of completion i, its EOS included).

## 1. Rollouts and the batch

- The dataset has a "prompt" column (strings here). GRPOTrainer tokenizes
  with `processing_class(text=prompts)` (add_special_tokens default: the
  tokenizer's template adds BOS, id 0 for the fixture tokenizer).
- RepeatSampler: a generation batch holds generation_batch_size rows =
  per_device_train_batch_size x processes x steps_per_generation (8 here),
  i.e. generation_batch_size / G prompts, each repeated G times in a row;
  with shuffle_dataset True (default) the prompt order is a seeded random
  permutation (torch.Generator seeded with args.seed), and the same prompts
  are yielded num_iterations x steps_per_generation times (the dataloader
  batches are reused, not regenerated: section 5).
- Generation (replaced by the fixture, see below) returns per row the
  completion ids up to and including the first EOS, where the EOS ids are
  `[tokenizer.eos_token_id] + model.generation_config.eos_token_id` (TRL
  reads the model's generation_config in __init__, BEFORE transformers'
  Trainer aligns that config to the tokenizer). For the fixture model
  (generation_config eos_token_id 2) that is [1, 2]: the byte token "!" (id
  2) would end a completion, so no completion of the fixture contains id 2.
  A completion that hit max_completion_length without an EOS is truncated
  (it keeps all its max_completion_length tokens).
- Padding: prompts are LEFT-padded with the pad id (tokenizer.pad_token,
  else EOS, 1 here) to the longest prompt of the batch (prompt_mask 0 on
  padding); completions RIGHT-padded with the pad id to the longest
  completion of the batch (not to max_completion_length), completion_mask
  1 on the completion ids (EOS included), 0 on padding. pad_to_multiple_of
  "auto" pads nothing off Neuron. input = cat(prompt_ids, completion_ids),
  attention_mask = cat(prompt_mask, completion_mask). No position_ids are
  passed: transformers 5 uses positions 0..len-1 whatever the mask, so a
  left-padded prompt would shift its positions; the fixture's prompts all
  have 5 tokens, so no padding happens and every row is prompt + completion
  at positions 0..len-1 (right padding after it changes nothing: causal).
- After scoring, the generation batch's rows are permuted
  (shuffle_sequence_dict: torch.randperm from the global RNG) and split into
  steps_per_generation micro-batches. Row order changes nothing but the
  order of float sums.

## 2. Per-token log-probabilities and entropies (temperature T)

Only completion tokens are scored (labels -100 on the prompt and on
attention-mask-0 padding). For completion token t of row i, with z the LM
head's logits at the position before it, times 1/T (`z * (1/T)`: TRL's
fused LM head, f32):
    logp[i,t] = z[target] - logsumexp(z)
    H[i,t]    = logsumexp(z) - sum_v softmax(z)_v z_v  (= -sum_v p_v log p_v)
0 on padding. The same T (GRPOConfig.temperature, default 1.0) is used for
the policy, the old and the reference log-probs, and the entropy metric.

## 3. Rewards and advantages

rewards_per_func[i,k] (f32): reward function k on row i (a None is NaN).
With multi_objective_aggregation "sum_then_normalize" (default), weights
w_k (reward_weights, default all 1.0):
    r_i = sum_k w_k rewards_per_func[i,k]   (nansum; a row whose every
          function returned None is NaN and gets advantage 0)
    mean_g(i) = mean of r over row i's group of G rows
    std       = nanstd: sqrt( sum (x - mean)^2 / (n - 1) )  UNBIASED (Bessel)
scale_rewards (default "group"; True = "group", False = "none"):
    "group": s_i = std over row i's group           A_i = (r_i - mean_g(i)) / (s_i + 1e-4)
    "batch": s_i = std over ALL rows of the generation batch (all processes),
             the mean still the GROUP's          A_i = (r_i - mean_g(i)) / (s_i + 1e-4)
    "none":  s_i = group std (only for frac_reward_zero_std)   A_i = r_i - mean_g(i)
The 1e-4 is added to the std (not the variance). A group with equal
rewards has A = 0 for all its rows (0 / 1e-4). Advantages are computed
once per generation batch, in f32, and are one number per row, broadcast
over its tokens. ("normalize_then_sum", not in the fixture: each function
normalised per group first, (x - mean_k)/(std_k + 1e-4), weighted sum,
then (R - mean over batch)/(batch std + 1e-4).)

## 4. The per-token loss

    rho[i,t]  = exp(logp[i,t] - old[i,t])                      (importance_sampling_level "token")
    rhoc[i,t] = clamp(rho[i,t], 1 - eps_low, 1 + eps_high)
                eps_low = epsilon (0.2), eps_high = epsilon_high if set, else epsilon
    l[i,t]    = -min(rho A_i, rhoc A_i)        (delta None: no extra cap on rho)
    with beta != 0:
    x[i,t]    = ref[i,t] - logp[i,t]
    kl[i,t]   = (exp(x) - x - 1) * rho[i,t]    (the "k3" estimator; the factor rho is
                use_bias_correction_kl, default TRUE, and rho is differentiable)
    l[i,t]   += beta * kl[i,t]
Gradients (autograd; old and ref are constants): where the clip is not
active d l = -A rho dlogp; where it is (rho > 1+eps_high with A > 0, or
rho < 1-eps_low with A < 0) the policy term has zero gradient. With
use_bias_correction_kl the KL term's gradient is
    beta * rho * (1 - exp(x) + (exp(x) - x - 1)) dlogp,
i.e. it has the extra beta*rho*kl3 dlogp term EVEN ON-POLICY (rho = 1 in
value, derivative rho). (sequence level, not in the fixture: one
rho_i = exp(sum_t m (logp - old) / max(L_i, 1)) per row.)

## 5. num_iterations (mu) and the old log-probs

generate_every = steps_per_generation x mu. A generation batch is made at
optimizer micro-steps 0, generate_every, 2 generate_every, ...; in between,
the buffered micro-batches are reused (the same rows, the same advantages,
the same old and ref log-probs, the same permuted order): with
steps_per_generation 1 and gradient_accumulation_steps 1, each rollout batch
is trained on for mu consecutive optimizer steps.
- old: if gradient_accumulation_steps % generate_every != 0 (here: mu >= 2)
  TRL computes old[i,t] ONCE, at generation time, under no_grad, with the
  policy as it is before the first of those steps; every one of the mu steps
  uses that same old (so at the first step rho = 1 up to float rounding, at
  step k it is pi_theta_k / pi_theta_1). Otherwise (mu = 1) old =
  logp.detach() (rho == 1 in value).
- ref: computed once per generation batch too (section 6), reused for all mu
  steps.
- The log-probs `logp` (and H) are recomputed at every step with the
  current policy (train mode; no dropout here).

## 6. The reference model (only when beta != 0)

- beta == 0.0 (the default): none at all; no reference forward, no KL, no
  "kl" metric, and no "ref" adapter is created even for a PeftModel.
- A plain model + peft_config (the fixture's "fresh" start): the reference
  is the same model with every adapter disabled (`model.disable_adapter()`),
  i.e. the BASE.
- A PeftModel (an existing adapter: the fixture's "init" start): TRL adds a
  second adapter "ref" with the "default" adapter's LoraConfig and copies
  every ".default." tensor into ".ref." (it is not trainable, the optimizer
  never sees it); the reference forward runs with "ref" as the active
  adapter (`use_adapter(model, "ref")`). So the reference is a frozen COPY
  of the starting adapter on the same base. (peft 0.17-0.19 with a LoRA
  using target_parameters: the base instead.)
- A plain model without PEFT: a SECOND model loaded again from
  `model.config`'s name or path (from disk/hub, not a copy of the instance).
- No option names another adapter as the reference; sync_ref_model is
  refused with PEFT. The fixture's "ref" start loads adapters/ref into TRL's
  "ref" adapter after the trainer is built (policy adapters/init).
Consequence: with "fresh" or "init" the reference equals the policy of the
first step after generation, so kl = 0 and the KL term's gradient is 0 at
that step (exp(0) - 0 - 1 = 0 and its derivative 0); beta only acts from the
second step on a rollout batch (mu >= 2) or after later generations. The
"ref" cases exercise a non-zero KL at step 1.

## 7. Normalisation per loss_type (loss of one micro-batch of B rows)

    grpo:    loss = (1/B) sum_i [ sum_t m l / max(L_i, 1) ]        / GA
    bnpo:    loss = sum_{i,t} m l / max(sum_{i,t} m, 1)            / GA
    dr_grpo: loss = sum_{i,t} m l / (B * max_completion_length)    / GA
             (the CONFIG's max_completion_length, 6 here, not the batch's
             longest completion)
    dapo:    loss = sum_{i,t} m l / D,  D = max(num_items_in_batch, 1)
                    / num_processes * GA / steps_per_generation
             num_items_in_batch = sum of m over the WHOLE generation batch
             of all processes (computed at generation time); no further
             division by GA.
(GA = current gradient_accumulation_steps; GRPOTrainer sets
loss_is_scaled_for_ga = True, so transformers' Trainer divides nothing
more; GA is 1 here anyway). With one process, GA 1 and steps_per_generation 1, dapo == bnpo
(the cases show it). The beta*kl term sits inside l, so each loss_type
normalises it the same way. B is the rows of the micro-batch (8 here).
At the first step of a rollout batch with mu = 1 (rho = 1, kl = 0) the loss
value does not depend on the model: grpo's is -mean_i A_i (0 with group
scaling: the advantages of a group sum to 0), the others' -sum_i L_i A_i
/ (their denominator).

## 8. The optimizer step

One optimizer step per GA window; the logged grad_norm is the global L2
norm of all trainable gradients before any clipping (transformers 5.24 logs
it also when max_grad_norm is 0, which turns clipping off; TRL's default
1.0 clips to norm 1). SGD (optim "sgd", momentum 0): p -= lr g. AdamW
(optim "adamw_torch": betas (0.9, 0.999), eps 1e-8, weight_decay 0 here):
m = 0.9 m + 0.1 g; v = 0.999 v + 0.001 g^2; p -= lr / (1 - 0.9^k) * m /
(sqrt(v) / sqrt(1 - 0.999^k) + eps), k the step number (counted for every
trainable tensor, also when its gradient is all zero, as a fresh lora_A's is
at step 1 since lora_B = 0). lr_scheduler "constant": lr every step.

## 9. Logged metrics (names as logged)

Logged once per optimizer step (logging_steps 1), values of that step.
With logging_steps > 1 each is the mean of its per-step values in the
window (NaNs dropped). "Pooled mean" = sum over all completion tokens of the
micro-batch (m = 1) / their count.
From the Trainer:
- loss: the value compute_loss returned (section 7; includes beta*kl)
- grad_norm: section 8;  learning_rate: the step's lr
- epoch: step / steps per epoch (an epoch = the dataloader once = mu steps
  per rollout batch here: 0.5 and 1.0 for mu = 2)
Logged ONLY at the step that generated (and scored) the rollouts (so not at
the second step of a mu = 2 case), over the whole generation batch:
- num_tokens: cumulative count of tokens seen: sum over rows of
  len(prompt_ids) + len(completion_ids) (unpadded, EOS included), added up
  over generations
- completions/mean_length, /min_length, /max_length: of len(completion_ids)
  (EOS included)
- completions/clipped_ratio: fraction of rows whose last completion id is
  not in eos_token_ids + [pad_token_id] (truncated)
- completions/mean_terminated_length, /min_..., /max_...: of the lengths of
  the non-truncated rows (0.0 if there are none)
- rewards/<f>/mean, rewards/<f>/std: per reward function f (its __name__),
  nanmean and unbiased nanstd of its UNWEIGHTED rewards over all rows
- reward: nanmean over rows of r_i (weighted sum); reward_std: its unbiased
  std over all rows
- frac_reward_zero_std: fraction of ROWS whose s_i (section 3: the group
  std for "group" and "none", the batch std for "batch") is
  torch.isclose(s_i, 0) (rtol 1e-5, atol 1e-8)
Logged at every step, from that step's loss computation:
- kl (beta != 0 only): pooled mean of kl[i,t] (INCLUDING the factor rho)
- entropy: pooled mean of H[i,t] (the current policy, temperature T)
- clip_ratio/low_mean: pooled mean of [rho < 1 - eps_low and A_i < 0]
- clip_ratio/high_mean: pooled mean of [rho > 1 + eps_high and A_i > 0]
- clip_ratio/region_mean: pooled mean of the union of the two
- clip_ratio/low_min: min over rows of (sum_t m [low]) / L_i
- clip_ratio/high_max: max over rows of (sum_t m [high]) / L_i
- step_time: wall time of the step (not recorded in the fixture)
Not logged here: policy_loss and entropy_coef (only with an entropy bonus),
aux_loss (MoE), sampling/* (vLLM), tools/* (tools).

## 10. TRL 1.16 GRPOConfig defaults (checked by the script)

loss_type "dapo"; beta 0.0; num_iterations 1; epsilon 0.2; epsilon_high
None (= epsilon); delta None; scale_rewards "group";
multi_objective_aggregation "sum_then_normalize"; reward_weights None (all
1.0); importance_sampling_level "token"; mask_truncated_completions False
(True would zero the completion mask of truncated rows); top_entropy_quantile
1.0 (no entropy mask); use_bias_correction_kl True; entropy_coef 0.0;
use_adaptive_entropy False; off_policy_mask_threshold None; temperature
1.0; top_p 1.0; top_k 0; min_p None; repetition_penalty 1.0;
num_generations 8; max_completion_length 512; steps_per_generation None
(= gradient_accumulation_steps); generation_batch_size None (=
per_device_train_batch_size x processes x steps_per_generation);
shuffle_dataset True; pad_to_multiple_of "auto" (None off Neuron);
disable_dropout False; cast_lm_head_to_fp32 False; sync_ref_model False;
remove_unused_columns False; use_vllm False (and
vllm_importance_sampling_correction True, which only acts with vLLM).
Training defaults that differ from transformers': learning_rate 1e-6,
logging_steps 10, gradient_checkpointing True, bf16 None (-> True unless
fp16). From TrainingArguments: max_grad_norm 1.0, lr_scheduler_type
"linear", warmup_steps 0, weight_decay 0.0, AdamW betas (0.9, 0.999), eps
1e-8, gradient_accumulation_steps 1, seed 42.

## 11. The fixture (tests/fixtures/grpo)

Rollout files, one JSON object a line, 8 rows: rows 1-4 are prompt 1's
group, rows 5-8 prompt 2's, completions in the order TRL's batch receives
them:
- rollouts.jsonl, rollouts_tied.jsonl:
  {"prompt_ids": [...], "completion_ids": [...], "reward": float}
- rollouts_two_rewards.jsonl:
  {"prompt_ids": [...], "completion_ids": [...], "rewards": {"a": float, "b": float}}
  two reward functions named "a" and "b" (TRL's reward_funcs order a, b),
  reward_weights [1.0, 0.5]: r = a + 0.5 b.
prompt_ids start with BOS (0); completion_ids end with EOS (1) unless
truncated (then 6 = max_completion_length ids); the completion mask covers
every completion id. How TRL ran them: the dataset's "prompt" column has
the two prompt strings, which TRL's own tokenization turns into exactly
prompt_ids (checked); GRPOTrainer._generate_single_turn (the
transformers-generate path, which returns the completion ids per row) is
replaced by one that hands out each prompt's completions in file order;
the reward functions look up the file's reward of (prompt, completion ids).
The script checks that the prompt_ids, completion_ids and completion_mask of
TRL's batch are the file's rows (up to row order), at every step.

## 12. Sequence-level weights, cispo, sapo, the KL without its correction

The cases of tests/fixtures/grpo/expected_variants.json (written by
`scripts/make_grpo_fixtures.py --variants`, checked in f64 like the others).
rho is TRL's coef_1, A_i the row's advantage, x[i,t] = ref[i,t] - logp[i,t].

- importance_sampling_level "sequence" (GSPO): one weight per row,
      log_w_i = sum_t m[i,t] (logp[i,t] - old[i,t]) / max(L_i, 1)
      rho_i   = exp(log_w_i)                          ([B, 1])
  broadcast over the row's tokens: every formula of section 4 and below
  takes rho_i for rho[i,t] (l[i,t] is the same for every token of row i,
  but each token's logp gets the gradient through log_w_i). With
  use_bias_correction_kl the KL is (exp(x) - x - 1)[i,t] * rho_i. The
  loss_type pools l[i,t] as in section 7 (a row counts once per token: dapo
  weighs row i by L_i; TRL warns for bnpo, dr_grpo, dapo and cispo at the
  sequence level, and runs). With mu = 1, log_w = 0 in value.
  Metrics of a [B, 1] tensor (TRL's global_masked_mean and masked_seq_mean):
  clip_ratio/low_mean, /high_mean, /region_mean are the plain mean over the
  B ROWS of the row's indicator (sum_i [.] / B, not weighted by L_i);
  clip_ratio/low_min and /high_max the min / max over rows of the row's
  indicator (0 or 1). kl and entropy stay pooled means over tokens.
- loss_type "cispo":
      w[i,t] = min(rho[i,t], epsilon_high)   DETACHED (a constant weight)
      l[i,t] = -w[i,t] A_i logp[i,t]          (+ beta kl[i,t])
  epsilon_high is an ABSOLUTE cap on the ratio (not 1 + epsilon_high), from
  above only (whatever the sign of A); unset it is epsilon, 0.2, below every
  ratio near 1, so every token's weight is 0.2. The gradient is -w A dlogp;
  the loss value is not ~0 at rho = 1 (it contains logp). Pooled as dapo
  (sum m l / max(num_items_in_batch, 1)). Logged instead of clip_ratio/*:
  cispo_clip_ratio = pooled mean over tokens of [rho > epsilon_high and
  A_i > 0].
- loss_type "sapo":
      tau_i  = sapo_temperature_pos if A_i > 0 else sapo_temperature_neg
               (defaults 1.0 and 1.05; A_i = 0 takes the negative one)
      l[i,t] = -sigmoid(tau_i (rho[i,t] - 1)) * 4 / tau_i * A_i   (+ beta kl[i,t])
  No clipping (epsilon, epsilon_high unused). At rho = 1 the value is
  -2 A_i / tau_i (the first step's loss is not 0 when the temperatures
  differ) and the gradient -A_i dlogp (d l / d logp = -4 s (1 - s) rho A_i,
  s the sigmoid). Pooled as grpo: (1/B) sum_i sum_t m l / max(L_i, 1).
  No clip metric is logged (neither clip_ratio/* nor cispo_clip_ratio).
- use_bias_correction_kl False: kl[i,t] = exp(x) - x - 1 without the factor
  rho, its gradient beta (1 - exp(x)) dlogp; the "kl" metric is its pooled
  mean (equal in value to the corrected one where rho = 1).

The cases (every other setting as the base cases': SGD lr 0.1, start
"fresh", 8 rows, G = 4, max_completion_length 6, no gradient clipping):
grpo.b0.04.mu2.gspo and dapo.b0.0.mu2.gspo (sequence
level); cispo.b0.0.mu2 (epsilon_high 1.05, SGD lr 1.0: no token capped at
step 1, some with A > 0 at step 2); cispo.b0.04.mu2.ref (epsilon_high unset,
so 0.2; policy adapters/init, reference adapters/ref); sapo.b0.0.mu2 (SGD lr
1.0); sapo.b0.04.mu2.temps (temperatures 2.0 and 0.5);
dapo.b0.04.mu2.ref.nobias and dapo.b0.5.mu1.ref.nobias (the .ref cases with
use_bias_correction_kl False).
"""


# ---------------------------------------------------------------------------
# Models, adapters, files.

def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def base_model(dtype=torch.float32):
    return tiny_llama(MODEL_DIR, dtype)


def lora_config():
    return q_v_lora(TARGETS)


def adapter_dir(name):
    return os.path.join(OUT, "adapters", name)


def save_adapter(peft_model, d):
    """save_pretrained, less the boilerplate model card (README.md)."""
    peft_model.save_pretrained(d)
    card = os.path.join(d, "README.md")
    if os.path.exists(card):
        os.remove(card)


def adapter_state(model, name="default"):
    from peft import get_peft_model_state_dict
    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def load_adapter(d, dtype=torch.float32):
    from peft import PeftModel
    return PeftModel.from_pretrained(base_model(dtype), d, is_trainable=True)


def load_safetensors(d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "adapter_model.safetensors"))


def rollout_rows(rewards):
    rows = []
    for g, (p, comps) in enumerate(zip(PROMPT_IDS, COMPLETIONS)):
        for c, r in zip(comps, rewards[g]):
            key = "rewards" if isinstance(r, dict) else "reward"
            rows.append({"prompt_ids": p, "completion_ids": c, key: r})
    return rows


def read_rollouts(name):
    with open(os.path.join(OUT, name)) as f:
        return [json.loads(line) for line in f]


def reward_matrix(rows):
    """([N, K] f64 rewards, reward function names): one column "reward",
    or one per key of "rewards" (sorted)."""
    if "rewards" in rows[0]:
        names = sorted(rows[0]["rewards"])
        return torch.tensor([[r["rewards"][n] for n in names] for r in rows], dtype=torch.float64), names
    return torch.tensor([[r["reward"]] for r in rows], dtype=torch.float64), ["reward"]


# ---------------------------------------------------------------------------
# Inputs: rollouts and adapters.

def write_formulas():
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)


@step("inputs")
def write_inputs():
    from peft import get_peft_model
    from transformers import set_seed
    os.makedirs(OUT, exist_ok=True)
    tok = tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    for s, ids in zip(PROMPTS, PROMPT_IDS):
        assert tok(s)["input_ids"] == ids, (s, tok(s)["input_ids"], ids)
    assert len({len(p) for p in PROMPT_IDS}) == 1, "prompts must have one length (no left padding)"
    for comps in COMPLETIONS:
        assert len(comps) == G and len({tuple(c) for c in comps}) == G, "completions of a group must differ"
        for c in comps:
            assert 2 <= len(c) <= MAX_COMPLETION and all(0 <= i < 128 for i in c), c
            assert BOS_ID not in c and 2 not in c and EOS_ID not in c[:-1], c
            assert c[-1] == EOS_ID or len(c) == MAX_COMPLETION, ("a completion without EOS must be truncated", c)
    lens = [len(c) for comps in COMPLETIONS for c in comps]
    assert min(lens) == 2 and max(lens) == MAX_COMPLETION
    for name, rewards in ROLLOUT_FILES.items():
        with open(os.path.join(OUT, name), "w") as f:
            for r in rollout_rows(rewards):
                f.write(json.dumps(r) + "\n")
    write_formulas()
    # Random adapters: every LoRA tensor from N(0, 0.1).
    for name, seed in [("init", 1), ("ref", 2)]:
        torch.manual_seed(seed)
        pm = get_peft_model(base_model(), lora_config())
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.1)
        save_adapter(pm, adapter_dir(name))
    # The fresh adapter exactly as GRPOTrainer makes it: set_seed(args.seed),
    # then get_peft_model(model, peft_config) (checked in every fresh case).
    m = base_model()
    set_seed(SEED)
    save_adapter(get_peft_model(m, lora_config()), adapter_dir("fresh"))


# ---------------------------------------------------------------------------
# TRL runs.

def trainer_class():
    """GRPOTrainer with (1) generation replaced by the file's completions,
    (2) the generation batch, each step's inputs, loss and the policy's
    per-token log-probs recorded."""
    from trl import GRPOTrainer

    class Fixed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            # prompt_ids: one list per row of the generation batch, each
            # prompt num_generations times in a row (RepeatSampler). Hand out
            # each prompt's completions in file order, as if sampled.
            assert images is None and not multimodal_fields and not self.use_vllm
            handed = {}
            out = []
            for p in prompt_ids:
                key = tuple(int(i) for i in p)
                k = handed.get(key, 0)
                handed[key] = k + 1
                out.append(list(self.fixture_groups[key][k]))
            assert all(n == num_generations == len(self.fixture_groups[k]) for k, n in handed.items()), handed
            return out, None  # no sampling log-probs (as TRL's transformers path)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.fixture_generated.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                           for k, v in out.items()})
            return out

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, **kw):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size=batch_size,
                                                             compute_entropy=compute_entropy, **kw)
            if compute_entropy:  # the policy forward of _compute_loss
                self.fixture_policy_logps.append(out[0].detach().clone())
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            self.fixture_losses.append(loss.detach().float().item())
            self.fixture_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v
                                        for k, v in inputs.items()})
            return loss

    return Fixed


def reward_funcs(rows):
    """Reward functions that return the file's reward of each (prompt,
    completion): one named "reward", or one per key of "rewards"."""
    table = {}
    for r in rows:
        prompt = PROMPTS[PROMPT_IDS.index(r["prompt_ids"])]
        table[(prompt, tuple(r["completion_ids"]))] = r
    names = reward_matrix(rows)[1]

    def make(name):
        def f(prompts, completions, completion_ids, **kw):
            out = []
            for p, c in zip(prompts, completion_ids):
                row = table[(p, tuple(c))]
                out.append(row["reward"] if name == "reward" and "reward" in row else row["rewards"][name])
            return out
        f.__name__ = name  # TRL names the metrics rewards/<__name__>/...
        return f
    return [make(n) for n in names]


TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def row_index(rows):
    return {(tuple(r["prompt_ids"]), tuple(r["completion_ids"])): i for i, r in enumerate(rows)}


def batch_rows(batch, rows):
    """For each row of a TRL batch dict, its index in `rows` (checks the ids
    and masks: prompt unpadded, completion right-padded with EOS/pad 1, mask
    1 on the file's completion ids exactly)."""
    index = row_index(rows)
    order = []
    for i in range(batch["prompt_ids"].size(0)):
        pm, cm = batch["prompt_mask"][i], batch["completion_mask"][i]
        assert bool(pm.all()), "prompt left-padded"
        p = batch["prompt_ids"][i].tolist()
        n = int(cm.sum())
        assert cm[:n].all() and not cm[n:].any(), cm
        c = batch["completion_ids"][i][:n].tolist()
        assert all(x == EOS_ID for x in batch["completion_ids"][i][n:].tolist()), "padding is not the pad id 1"
        order.append(index[(tuple(p), tuple(c))])
    assert sorted(order) == list(range(len(rows))), order
    assert batch["completion_ids"].size(1) == max(len(r["completion_ids"]) for r in rows)
    return order


def run_trl(c):
    """Runs the case through GRPOTrainer. Returns a dict: initial adapter,
    adapter after each step, each step's loss and logged metrics, the
    advantages and TRL's start log-probs in file order."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig
    rows = read_rollouts(c["rollouts"])
    cls = trainer_class()
    states = []

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            states.append(adapter_state(model))

    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if c["rollouts"] == "rollouts_two_rewards.jsonl":
            extra["reward_weights"] = REWARD_WEIGHTS
        if c["epsilon_high"] is not None:
            extra["epsilon_high"] = c["epsilon_high"]
        for key in ("importance_sampling_level", "use_bias_correction_kl", "sapo_temperature_pos",
                    "sapo_temperature_neg"):
            default = TRL_DEFAULTS.get(key, TRL_VARIANT_DEFAULTS.get(key))
            if c[key] != default:
                extra[key] = c[key]
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=len(rows), num_generations=G,
            max_completion_length=MAX_COMPLETION, gradient_accumulation_steps=1, max_steps=c["max_steps"],
            num_iterations=c["num_iterations"], loss_type=c["loss_type"], beta=c["beta"],
            scale_rewards=c["scale_rewards"], temperature=c["temperature"], optim=OPTS[c["opt"]]["optim"],
            learning_rate=c["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, seed=SEED, use_vllm=False, dataloader_num_workers=0,
            disable_tqdm=True, **extra)
        assert args.steps_per_generation == 1 and args.generation_batch_size == len(rows)
        assert args.pad_to_multiple_of is None
        for key in ("importance_sampling_level", "use_bias_correction_kl", "sapo_temperature_pos",
                    "sapo_temperature_neg"):
            assert getattr(args, key) == c[key], (key, getattr(args, key), c[key])
        kw = {}
        if c["start"] == "fresh":
            model = base_model()
            kw["peft_config"] = lora_config()
        else:
            model = load_adapter(adapter_dir("init"))
        trainer = cls(model=model, reward_funcs=reward_funcs(rows), args=args,
                      train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                      processing_class=tokenizer(), callbacks=[AfterStep()], **kw)
        trainer.remove_callback(PrinterCallback)  # transformers prints every log dict with disable_tqdm
        trainer.fixture_groups = {tuple(p): comps for p, comps in zip(PROMPT_IDS, COMPLETIONS)}
        trainer.fixture_generated, trainer.fixture_inputs = [], []
        trainer.fixture_losses, trainer.fixture_policy_logps = [], []
        assert trainer.eos_token_ids == [EOS_ID, 2], trainer.eos_token_ids
        assert trainer.epsilon_high == settings_of(c)["epsilon_high"], (trainer.epsilon_high, c["name"])
        pm = trainer.model
        has_ref = "ref" in pm.peft_config
        assert has_ref == (c["start"] != "fresh" and c["beta"] != 0.0), (c["name"], list(pm.peft_config))
        assert (trainer.ref_model is None), "a PEFT model has no separate reference model"
        if has_ref:
            for n, p in pm.named_parameters():
                if ".ref." in n:
                    assert not p.requires_grad, n
                    assert torch.equal(p, pm.get_parameter(n.replace(".ref.", ".default."))), n
        if c["start"] == "ref":
            # TRL's "ref" adapter (a copy of the policy's) gets adapters/ref.
            want = load_safetensors(adapter_dir("ref"))
            loaded = 0
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if ".ref." in n:
                        p.copy_(want[n.replace(".ref.", ".")])
                        loaded += 1
            assert loaded == len(want), (loaded, len(want))
        init = adapter_state(pm)
        saved = load_safetensors(adapter_dir("fresh" if c["start"] == "fresh" else "init"))
        assert init.keys() == saved.keys() and all(torch.equal(init[k], saved[k]) for k in saved), \
            ("the trainer's initial adapter differs from the saved one", c["name"])
        trainer.train()
        logs = [dict(e) for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == c["max_steps"] == len(states) == len(trainer.fixture_losses), (len(logs), len(states))
    assert len(trainer.fixture_generated) == 1, "TRL generated more than once"
    gen = trainer.fixture_generated[0]
    order = batch_rows(gen, rows)
    adv = [0.0] * len(rows)
    for i, j in enumerate(order):
        adv[j] = gen["advantages"][i].item()

    def file_order(t, o):
        out = [None] * len(rows)
        for i, j in enumerate(o):
            out[j] = t[i, :len(rows[j]["completion_ids"])].tolist()
        return out
    first = trainer.fixture_inputs[0]
    for inputs in trainer.fixture_inputs:
        batch_rows(inputs, rows)
        for key in ("advantages", "completion_ids", "prompt_ids"):
            assert torch.equal(inputs[key], first[key]), (key, "batch differs between steps")
        assert ("old_per_token_logps" in inputs) == (c["num_iterations"] > 1)
        assert ("ref_per_token_logps" in inputs) == (c["beta"] != 0.0)
    o = batch_rows(first, rows)
    # The policy's log-probs at step 1, and (computed at generation) the old
    # and the reference log-probs.
    logps = {"policy": file_order(trainer.fixture_policy_logps[0], o)}
    for key, name in (("old_per_token_logps", "old"), ("ref_per_token_logps", "ref")):
        if key in first:
            logps[name] = file_order(first[key], o)
    for k, e in enumerate(logs, start=1):
        assert e["step"] == k, (k, e)
    return {"init": init, "after": states, "losses": trainer.fixture_losses, "logs": logs, "advantages": adv,
            "logps": logps}


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

def f64_policy(start):
    pm = load_adapter(adapter_dir("fresh" if start == "fresh" else "init"), dtype=torch.float64).eval()
    for n, p in pm.named_parameters():
        p.requires_grad_("lora_" in n)
        assert p.dtype == torch.float64, (n, p.dtype)
    return pm


def f64_reference(start):
    """The reference of FORMULAS.md section 6: the base (fresh), the initial
    adapter (init), adapters/ref (ref)."""
    if start == "fresh":
        return base_model(torch.float64).eval()
    return load_adapter(adapter_dir("init" if start == "init" else "ref"), dtype=torch.float64).eval()


def token_stats(model, rows, T):
    """Per row, unpadded (prompt + completion, no attention mask): the
    log-probs and entropies at temperature T of the completion tokens, as
    [N, MAX_COMPLETION] tensors, zero past each completion."""
    N = len(rows)
    lp = torch.zeros(N, MAX_COMPLETION, dtype=torch.float64)
    ent = torch.zeros(N, MAX_COMPLETION, dtype=torch.float64)
    lps, ents = [], []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        logits = model(input_ids=ids).logits[0, P - 1:P + C - 1] / T
        logq = torch.log_softmax(logits, -1)
        lps.append(logq.gather(-1, torch.tensor(r["completion_ids"])[:, None])[:, 0])
        ents.append(-(logq.exp() * logq).sum(-1))
    lp = torch.stack([torch.cat([x, x.new_zeros(MAX_COMPLETION - x.numel())]) for x in lps])
    ent = torch.stack([torch.cat([x, x.new_zeros(MAX_COMPLETION - x.numel())]) for x in ents])
    return lp, ent


def unbiased_std(x):
    return ((x - x.mean()) ** 2).sum().div(x.numel() - 1).sqrt()


def advantages_f64(rows, scale, weights):
    R, names = reward_matrix(rows)
    w = torch.tensor(weights if weights is not None else [1.0] * R.size(1), dtype=torch.float64)
    r = (R * w).sum(1)
    groups = r.view(-1, G)
    mean = groups.mean(1).repeat_interleave(G)
    if scale == "batch":
        std = unbiased_std(r).expand_as(r)
    else:
        std = torch.stack([unbiased_std(g) for g in groups]).repeat_interleave(G)
    A = r - mean
    if scale != "none":
        A = A / (std + 1e-4)
    metrics = {"reward": r.mean().item(), "reward_std": unbiased_std(r).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).double().mean().item()}
    for k, n in enumerate(names):
        metrics[f"rewards/{n}/mean"] = R[:, k].mean().item()
        metrics[f"rewards/{n}/std"] = unbiased_std(R[:, k]).item()
    return A, metrics, names


def completion_metrics(rows):
    lens = torch.tensor([len(r["completion_ids"]) for r in rows], dtype=torch.float64)
    trunc = torch.tensor([r["completion_ids"][-1] not in (EOS_ID, 2) for r in rows])
    term = lens[~trunc] if (~trunc).any() else torch.zeros(1, dtype=torch.float64)
    return {"num_tokens": float(sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)),
            "completions/mean_length": lens.mean().item(), "completions/min_length": lens.min().item(),
            "completions/max_length": lens.max().item(), "completions/clipped_ratio": trunc.double().mean().item(),
            "completions/mean_terminated_length": term.mean().item(),
            "completions/min_terminated_length": term.min().item(),
            "completions/max_terminated_length": term.max().item()}


def hand(c, rows):
    """The case by FORMULAS.md in f64: per step (loss, metrics, adapter after
    the step), advantages, start log-probs (and the reference's)."""
    from peft import get_peft_model_state_dict
    T, beta, mu = c["temperature"], c["beta"], c["num_iterations"]
    eps_lo = c["epsilon"]
    eps_hi = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    weights = REWARD_WEIGHTS if c["rollouts"] == "rollouts_two_rewards.jsonl" else None
    N = len(rows)
    mask = torch.zeros(N, MAX_COMPLETION, dtype=torch.float64)
    for i, r in enumerate(rows):
        mask[i, :len(r["completion_ids"])] = 1
    A, reward_metrics, _ = advantages_f64(rows, c["scale_rewards"], weights)
    pol = f64_policy(c["start"])
    named = dict(pol.named_parameters())
    keys = list(get_peft_model_state_dict(pol).keys())
    pname = {k: k.replace(".weight", ".default.weight") for k in keys}
    with torch.no_grad():
        old, _ = token_stats(pol, rows, T)
        ref = token_stats(f64_reference(c["start"]), rows, T)[0] if beta != 0.0 else None
    lr = c["learning_rate"]
    adam = {k: (torch.zeros_like(named[pname[k]]), torch.zeros_like(named[pname[k]])) for k in keys}
    steps = []
    for k_step in range(1, c["max_steps"] + 1):
        for p in named.values():
            p.grad = None
        lp, ent = token_stats(pol, rows, T)
        old_s = lp.detach() if mu == 1 else old
        lt = c["loss_type"]
        clipped = lt in ("grpo", "dr_grpo", "dapo", "bnpo")
        if c["importance_sampling_level"] == "token":
            coef1 = torch.exp(lp - old_s)
        else:  # "sequence": one weight per row, [N, 1], broadcast over its tokens
            log_w = ((lp - old_s) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
            coef1 = torch.exp(log_w)[:, None]
        a = A[:, None]
        if lt == "cispo":  # the ratio capped at epsilon_high itself, a constant weight
            ptl = -torch.clamp(coef1, max=eps_hi).detach() * a * lp
        elif lt == "sapo":
            tau = torch.where(a > 0, torch.full_like(a, c["sapo_temperature_pos"]),
                              torch.full_like(a, c["sapo_temperature_neg"]))
            ptl = -(torch.sigmoid(tau * (coef1 - 1)) * 4 / tau) * a
        else:
            coef2 = torch.clamp(coef1, 1 - eps_lo, 1 + eps_hi)
            ptl = -torch.min(coef1 * a, coef2 * a)
        if beta != 0.0:
            x = ref - lp
            kl = torch.exp(x) - x - 1
            if c["use_bias_correction_kl"]:
                kl = kl * coef1
            ptl = ptl + beta * kl
        if lt in ("grpo", "sapo"):
            loss = ((ptl * mask).sum(-1) / mask.sum(-1)).mean()
        elif lt == "dr_grpo":
            loss = (ptl * mask).sum() / (N * MAX_COMPLETION)
        else:  # bnpo, dapo, cispo (one process, no accumulation: the same)
            loss = (ptl * mask).sum() / mask.sum()
        loss.backward()
        grads = {k: named[pname[k]].grad.detach().clone() for k in keys}
        gnorm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()

        def gmean(t):
            if t.size(1) == 1:  # sequence level: the plain mean over rows
                return (t.sum() / t.size(0)).item()
            return ((t * mask).sum() / mask.sum()).item()

        def seq_mean(t):
            if t.size(1) == 1:
                return t[:, 0]
            return (t * mask).sum(-1) / mask.sum(-1)
        met = {"loss": loss.item(), "grad_norm": gnorm, "learning_rate": lr, "epoch": k_step / mu,
               "entropy": gmean(ent.detach())}
        if clipped:
            lo = ((coef1 < 1 - eps_lo) & (a < 0)).double()
            hi = ((coef1 > 1 + eps_hi) & (a > 0)).double()
            met.update({"clip_ratio/low_mean": gmean(lo), "clip_ratio/high_mean": gmean(hi),
                        "clip_ratio/region_mean": gmean(torch.maximum(lo, hi)),
                        "clip_ratio/low_min": seq_mean(lo).min().item(),
                        "clip_ratio/high_max": seq_mean(hi).max().item()})
        elif lt == "cispo":
            met["cispo_clip_ratio"] = gmean(((coef1 > eps_hi) & (a > 0)).double())
        if beta != 0.0:
            met["kl"] = gmean(kl.detach())
        if k_step == 1:  # logged once per generation
            met.update(reward_metrics)
            met.update(completion_metrics(rows))
        # Every clipping decision is far from its bound (no f32/f64 flip).
        if clipped:
            bounds = [1 - eps_lo, 1 + eps_hi] + ([1 + eps_lo] if eps_hi != eps_lo else [])
        else:  # cispo: its cap; sapo: no bound
            bounds = [eps_hi] if lt == "cispo" else []
        ratios = coef1.detach().expand_as(mask)[mask.bool()]
        margin = min([(ratios - b).abs().min().item() for b in bounds] + [math.inf])
        assert margin > 1e-4, ("a ratio within 1e-4 of a clipping bound", c["name"], k_step, margin)
        # eps_high: tokens whose clipping the asymmetric bound decides
        between = ((coef1 > 1 + eps_lo) & (coef1 <= 1 + eps_hi) & (a > 0)).double().sum().item()
        with torch.no_grad():
            r_min, r_max = ratios.min().item(), ratios.max().item()
        with torch.no_grad():
            for k in keys:
                p, g = named[pname[k]], grads[k]
                if c["opt"] == "sgd":
                    p -= lr * g
                else:
                    m, v = adam[k]
                    m.mul_(0.9).add_(0.1 * g)
                    v.mul_(0.999).add_(0.001 * g * g)
                    bc1, bc2 = 1 - 0.9 ** k_step, 1 - 0.999 ** k_step
                    p -= (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + 1e-8)
        after = {k: named[pname[k]].detach().clone() for k in keys}
        steps.append({"metrics": met, "after": after, "between_eps": between, "margin": margin,
                      "ratio_range": (r_min, r_max)})
    rows_lp = [old[i, :len(r["completion_ids"])].tolist() for i, r in enumerate(rows)]
    rows_ref = None if ref is None else [ref[i, :len(r["completion_ids"])].tolist() for i, r in enumerate(rows)]
    return {"steps": steps, "advantages": A.tolist(), "logps": rows_lp, "ref_logps": rows_ref}


# ---------------------------------------------------------------------------

def settings_of(c):
    eps_hi = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    reference = {"fresh": "base (adapter disabled)", "init": "adapters/init (TRL's 'ref' copy of the policy's adapter)",
                 "ref": "adapters/ref (loaded into TRL's 'ref' adapter)"}[c["start"]]
    rows = read_rollouts(c["rollouts"])
    extra = {}
    if c["loss_type"] == "sapo":
        extra = {"sapo_temperature_pos": c["sapo_temperature_pos"], "sapo_temperature_neg": c["sapo_temperature_neg"]}
    return {**extra, "loss_type": c["loss_type"], "beta": c["beta"], "num_iterations": c["num_iterations"],
            "max_steps": c["max_steps"], "epsilon": c["epsilon"], "epsilon_high": eps_hi,
            "epsilon_high_given": c["epsilon_high"], "scale_rewards": c["scale_rewards"],
            "temperature": c["temperature"], "optim": OPTS[c["opt"]]["optim"], "learning_rate": c["learning_rate"],
            "weight_decay": 0.0, "max_grad_norm": 0.0, "lr_scheduler_type": "constant", "warmup_steps": 0,
            "rollouts": c["rollouts"], "reward_funcs": reward_matrix(rows)[1],
            "reward_weights": REWARD_WEIGHTS if c["rollouts"] == "rollouts_two_rewards.jsonl" else None,
            "start": c["start"], "policy_adapter": "adapters/fresh" if c["start"] == "fresh" else "adapters/init",
            "reference": reference if c["beta"] != 0.0 else "none (beta 0)",
            "per_device_train_batch_size": 8, "num_generations": G, "max_completion_length": MAX_COMPLETION,
            "gradient_accumulation_steps": 1, "steps_per_generation": 1,
            "use_bias_correction_kl": c["use_bias_correction_kl"],
            "importance_sampling_level": c["importance_sampling_level"], "mask_truncated_completions": False,
            "top_entropy_quantile": 1.0, "multi_objective_aggregation": "sum_then_normalize", "seed": SEED}


def run_case(c):
    name = c["name"]
    rows = read_rollouts(c["rollouts"])
    t = run_trl(c)
    h = hand(c, rows)
    diffs = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0, "advantages": 0.0, "logps": 0.0}
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
    diffs["advantages"] = max(abs(a - b) for a, b in zip(h["advantages"], t["advantages"]))
    for key, want in t["logps"].items():  # policy (step 1), old (mu > 1): the start's; ref: the reference's
        got = h["ref_logps"] if key == "ref" else h["logps"]
        diffs["logps"] = max([diffs["logps"]] + [abs(a - b) for ra, rb in zip(got, want) for a, b in zip(ra, rb)])
    print(f"{name:28s} loss " + " ".join(f"{s['loss']:.7f}" for s in entry_steps) +
          "  f64 check: " + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()) +
          f"  (ratios >= {min(s['margin'] for s in h['steps']):.1e} from a clip bound)")
    entry = {"settings": settings_of(c), "steps": entry_steps, "advantages": t["advantages"],
             "logps_start_f64": h["logps"]}
    if h["ref_logps"] is not None:
        entry["ref_logps_f64"] = h["ref_logps"]
    return name, entry, tensors, diffs, h


def run_cases(case_list, stem, checked_defaults, meta_extra, check):
    """Runs `case_list` (TRL and the f64 recomputation), writes
    <stem>.json and <stem>.safetensors; `check(name, entry, h)` adds the
    checks of particular cases."""
    import peft, trl, transformers, accelerate, datasets
    from trl import GRPOConfig
    import dataclasses
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for k, v in checked_defaults.items():
        assert defaults[k] == v, ("TRL default differs from TRL_DEFAULTS", k, defaults[k], v)
    expected, tensors = {}, {}
    worst = {}
    for c in case_list:
        name, entry, after, diffs, h = run_case(c)
        for k, v in diffs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        expected[name] = entry
        tensors.update(after)
        check(name, entry, h)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "accelerate": accelerate.__version__,
                     "datasets": datasets.__version__},
        "model": os.path.relpath(MODEL_DIR, ROOT),
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "trl_eos_token_ids": [EOS_ID, 2],
        "trl_grpo_defaults": TRL_DEFAULTS, "trainingarguments_defaults": HF_DEFAULTS,
        "f64_check_max_abs_diff": worst,
        **meta_extra,
    }
    with open(os.path.join(OUT, stem + ".json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, stem + ".safetensors"))
    print("f64 check, worst over all cases:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst


@step("cases")
def cases():
    def check(name, entry, h):
        if name.endswith(".eps_high"):
            s2 = entry["steps"][1]["logged"]
            assert s2["clip_ratio/high_mean"] > 0 and s2["clip_ratio/low_mean"] > 0, s2
            between = h["steps"][1]["between_eps"]
            assert between > 0, "no ratio in (1 + epsilon, 1 + epsilon_high] with A > 0"
            print(f"  {name}: step 2 has {between:.0f} token(s) with A > 0 and ratio in (1.2, 1.28]")
    run_cases(CASES, "expected", {**TRL_DEFAULTS, **HF_DEFAULTS}, {}, check)


@step("variants")
def variants():
    def check(name, entry, h):
        if len(entry["steps"]) == 1:
            return
        s1, s2 = (s["logged"] for s in entry["steps"])
        lo, hi = h["steps"][1]["ratio_range"]
        print(f"  {name}: step 2 ratios (per {entry['settings']['importance_sampling_level']}) in "
              f"[{lo:.4f}, {hi:.4f}]")
        # At step 2 the ratios have moved away from 1 (each case tests them).
        assert hi - lo > 1e-3, (name, lo, hi)
        if name == "cispo.b0.0.mu2":
            assert s1["cispo_clip_ratio"] == 0 and s2["cispo_clip_ratio"] > 0, (s1, s2)
            print(f"  {name}: cispo_clip_ratio step 1 {s1['cispo_clip_ratio']}, step 2 "
                  f"{s2['cispo_clip_ratio']:.6f} (ratio > epsilon_high 1.05 with A > 0)")
        if name == "cispo.b0.04.mu2.ref":  # TRL's default cap 0.2 clips every token with A > 0
            assert s1["cispo_clip_ratio"] == s2["cispo_clip_ratio"] > 0, (s1, s2)
    run_cases(VARIANT_CASES, "expected_variants", {**TRL_DEFAULTS, **HF_DEFAULTS, **TRL_VARIANT_DEFAULTS},
              {"trl_grpo_variant_defaults": TRL_VARIANT_DEFAULTS}, check)


if __name__ == "__main__":
    import accelerate, datasets, peft, safetensors, tokenizers, transformers, trl
    print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "peft",
          peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "tokenizers",
          tokenizers.__version__, "safetensors", safetensors.__version__)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--variants"]:
        write_formulas()
        variants()
    elif sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [--variants]")
    else:
        write_inputs()
        cases()
    finish()
