#!/usr/bin/env python3
"""Build the preference-optimisation fixtures (DPO, IPO, SimPO, ORPO) from TRL's
own trainers, for the Rust tests of issue 36.

Run by hand (not by CI) where TRL, HF transformers, PEFT, datasets, accelerate,
safetensors and PyTorch are installed (made with torch 2.9.1+cu128 run on CPU, trl 1.16.0,
transformers 5.24.0, peft 0.21.2, accelerate 1.15.0, datasets 5.2.0,
tokenizers 0.23.3, safetensors 0.8.0, pyarrow 26.0.1; --more also needs
bitsandbytes, made with 0.50.2, whose 4-bit code runs on the CPU); it needs
no GPU and no network:

    python3 scripts/make_preference_fixtures.py          # the files below
    python3 scripts/make_preference_fixtures.py --more   # only the --more files
    python3 scripts/make_preference_fixtures.py --two-adapters  # only its files
    python3 scripts/make_preference_fixtures.py --cpo    # only cpo/'s files

(e.g. `pip install --target DIR torch==2.9.1 trl==1.16.0 transformers==5.24.0
peft==0.21.2 accelerate==1.15.0 datasets==5.2.0 tokenizers==0.23.3
safetensors==0.8.0 pyarrow==26.0.1 bitsandbytes==0.50.2`, then
`PYTHONPATH=DIR python3 ...`; each run reproduces the committed files
byte for byte on the machine that made them. Elsewhere the f32 numbers can
move by an ulp or so: on an AMD EPYC (AVX-512) machine the default run's
expected.json / expected.safetensors differed from the committed ones by up
to 4e-7, the same with the script before --two-adapters was added; every
other file was identical. --two-adapters' files were made on that machine.)

It reads the tiny f32 model tests/fixtures/llama/gqa_llama3 (vocab 128) and
the BPE tokenizer tests/fixtures/tokenizer/tokenizer.json (vocab 300; its
byte tokens of printable ASCII have ids 2..95, so the strings below are
chosen to tokenize to ids < 128 without merges) and writes
tests/fixtures/preference/ (about 250 KB):

  tokenizer/                 that tokenizer saved by PreTrainedTokenizerFast
                             with bos_token "<|begin_of_text|>" (id 0) and
                             eos_token "<|end_of_text|>" (id 1); no pad token,
                             so every trainer pads with the EOS id 1
  data.jsonl                 4 string pairs {"prompt","chosen","rejected"}
                             (no BOS/EOS in the text: TRL adds them)
  data_ids.jsonl             the same 4 pairs pre-tokenized
                             {"prompt_ids","chosen_ids","rejected_ids"}: the
                             ids TRL derives from data.jsonl (BOS first in
                             prompt_ids, EOS last in each completion), to be
                             used verbatim (nothing added)
  adapters/fresh/            PEFT adapter as TRL creates it from peft_config
                             (seed 42: lora_A kaiming-uniform, lora_B = 0)
  adapters/init/             random adapter, A and B ~ N(0, 0.1) (the
                             --init-adapter case)
  adapters/ref/              another random adapter, N(0, 0.1) (the
                             --ref-adapter case)
  expected.json              per case: settings, the loss of step 1 (before
                             the update), every metric TRL logged for step 1,
                             and per-pair log-probabilities (hand-computed)
  expected.safetensors       per case, "<case>.<PEFT key>": the adapter after
                             the one optimizer step (f32, keys as
                             adapter_model.safetensors writes them)
  FORMULAS.md                what TRL 1.16 computes, exactly (the account
                             below, with the data layout)

Cases are named <method>.<start>.<opt>:
  method  dpo (DPOTrainer, loss_type ["sigmoid"]), ipo (DPOTrainer,
          loss_type ["ipo"]), simpo (experimental CPOTrainer,
          loss_type "simpo", cpo_alpha 1.0 = TRL's default, i.e. with the
          NLL term), simpo_a0 (same with cpo_alpha 0.0, pure SimPO), orpo
          (experimental ORPOTrainer). Every other setting at TRL's default:
          beta 0.1 for all; simpo_gamma 0.5; label_smoothing 0.
  start   fresh: the trainer wraps the base with peft_config (its reference,
                 for DPO/IPO, is the base with the adapter disabled);
          init:  the trainer gets a PeftModel loaded from adapters/init
                 (DPO/IPO: TRL copies it to a frozen second adapter "ref"
                 and uses that as the reference);
          ref:   DPO/IPO only. The policy starts from adapters/fresh (loaded as
                 a PeftModel), and the reference is adapters/ref. TRL 1.16 has
                 no option naming a reference adapter; it only creates "ref"
                 as a copy of the policy's adapter. The script overwrites that
                 "ref" adapter's tensors with adapters/ref after the trainer
                 is built, so TRL's own code (use_adapter(model, "ref")) runs
                 the reference forward with it.
  opt     sgd:   optim "sgd" (torch.optim.SGD, momentum 0), lr 0.1;
          adamw: optim "adamw_torch" (torch.optim.AdamW, betas (0.9, 0.999),
                 eps 1e-8), lr 1e-3;
          both: weight_decay 0, lr_scheduler "constant", warmup 0,
          max_grad_norm 0 (clipping OFF; TRL's default is 1.0, i.e. the
          global L2 norm clipped to 1, as hlo-train's --clip-norm 1),
          one step (max_steps 1), per_device_train_batch_size 4 (= all 4
          pairs in one batch), gradient_accumulation_steps 1,
          train_sampling_strategy "sequential" (file order), seed 42,
          bf16 False (TRL's default is True!), gradient_checkpointing False
          (TRL's default is True; it does not change the numbers), CPU, f32.
LoRA everywhere: r 4, lora_alpha 8 (scale 2), target_modules q_proj and
v_proj, dropout 0, no bias.

Every case is run twice, from data.jsonl (TRL's real tokenization) and from
data_ids.jsonl (TRL 1.16 has no pre-tokenized input path for these trainers:
DPOTrainer._prepare_dataset and CPO/ORPO tokenize_row require strings, so the
script bypasses them for that run and feeds the ids verbatim); the two must
give bitwise the same loss, metrics and adapter, else the script fails. Each
case is then recomputed independently in f64 (plain transformers + PEFT
forward, the formulas of FORMULAS.md, autograd for the gradient, and the
first SGD / AdamW step by hand: SGD p - lr*g, AdamW step 1 p - lr*g/(|g|+eps))
and the largest differences are printed.

Two workarounds, neither touching the numbers: datasets 5.2.0 could not
fingerprint a pyarrow table here (dill PicklingError on MonthDayNano), so the
fingerprint is replaced by a hash of the rows and caching is off; and
CPO/ORPOTrainer get a tokenizer whose pad_token is already EOS (they build
their collator before defaulting it, and fail otherwise). Two runs give
byte-identical expected.json and expected.safetensors.

The account of TRL 1.16's formulas is in FORMULAS.md (written by this script,
from FORMULAS below).

--more writes, leaving every file above as it is (FORMULAS.md is rewritten
with the same text):

  chat_tokenizer/            tokenizer/ plus the special tokens "<|user|>"
                             (id 96) and "<|assistant|>" (id 97) (the byte
                             tokens from id 96 on move up by 2; printable
                             ASCII keeps ids 2..95) and a tokenizer_config.json
                             whose chat_template renders BOS, then per message
                             "<|role|>" + content + EOS, and "<|assistant|>"
                             as the generation prompt (CHAT_TEMPLATE)
  data_chat.jsonl            4 conversational pairs (CHAT_PAIRS): two with a
                             "prompt" message list (one of three turns) and
                             one-message chosen/rejected, two without
                             "prompt" (chosen/rejected full conversations
                             sharing the user message: TRL's implicit prompt)
  data_chat_ids.jsonl        the ids TRL derives from them (DPOTrainer's
                             _prepare_dataset; the same from ORPOTrainer's
                             tokenize_row, checked), used verbatim
  adapters_nf4/fresh/        the NF4 cases' adapters (the base below is
  adapters_nf4/init/         128 wide): fresh as TRL creates it from
                             peft_config (seed 42: lora_A kaiming-uniform,
                             lora_B = 0; checked against DPOTrainer's own),
                             init random, A and B ~ N(0, 0.1) (seed 1); f32,
                             LoRA as above (r 4, alpha 8, q_proj and v_proj)
  expected_more.json,        as expected.json / expected.safetensors, for
  expected_more.safetensors  the cases below; settings (and _meta) say what
                             differs

Cases (<method>.<start>.<opt>.<variant>, every other setting as the case
of the same name above; data.jsonl / data_ids.jsonl unless chat):
  nf4          dpo.init.sgd, dpo.fresh.sgd, dpo.init.adamw, orpo.init.sgd,
               ipo.init.sgd on the QLoRA fixture model tests/fixtures/qlora/
               llama (hidden 128, intermediate 128, vocab 128, 2 layers: every
               projection's in_features is 128, a multiple of the NF4 block
               of 64, which hlo-train's NF4 needs, models/src/decoder/
               config.rs; the preference tokenizer's ids, < 128, fit its
               vocab, checked) with adapters_nf4/, loaded by transformers with
               BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
               bnb_4bit_compute_dtype=float32, bnb_4bit_use_double_quant=False)
               on the CPU: the 14 layer projections NF4 (blocks of 64, absmax
               f32), embeddings, norms and lm_head f32, as hlo-train quantizes
               (checked: each projection equals bitsandbytes'
               quantize_4bit/dequantize_4bit round trip of the f32 weight, as
               scripts/make_qlora_fixtures.py does; the rest is the checkpoint).
               LoRA in f32: TRL 1.16's DPOTrainer itself would cast the
               trainable LoRA tensors to bf16 on a 4-bit base (FORMULAS.md
               section 9) and train a bf16 LoRA; the script checks that cast
               and undoes it (the adapter's f32 values, for fresh TRL's own
               f32 init, put back after the trainer is built, before train()
               builds the optimizer), so the cases are an f32 adapter on the
               NF4 base, as hlo-train trains it. ORPOTrainer casts nothing.
  chat         dpo.init.sgd, dpo.fresh.sgd, orpo.init.sgd on gqa_llama3 with
               data_chat.jsonl and chat_tokenizer/ (TRL's conversational path,
               FORMULAS.md section 8). TRL 1.16's DPOTrainer cannot take
               explicit- and implicit-prompt rows in one dataset (it decides
               from the first row), so its string run gets the rows through
               TRL's maybe_extract_prompt first (see dpo_chat_rows).
Checks as above: strings == ids bitwise (and the same first batch), and the
f64 recomputation (for nf4 on the NF4 round-tripped base), within 1e-5.

--two-adapters writes, leaving every file above as it is (it reads
tokenizer/ and data_ids.jsonl, and adapters/fresh as the policy; FORMULAS.md
is not touched):

  adapters/ref_other/        a random adapter, A and B ~ N(0, 0.1) (seed 3),
                             with OTHER LoRA settings than the policy's:
                             r 2, lora_alpha 6 (scale 3), target_modules
                             q_proj, o_proj and down_proj (q_proj shared with
                             the policy; o_proj and down_proj only here;
                             v_proj only in the policy), dropout 0, no bias,
                             no rslora (REF_OTHER_LORA)
  expected_two.json,         as expected.json / expected.safetensors (same
  expected_two.safetensors   per-case keys: settings, loss, logged_loss,
                             metrics, pairs_f64; "<case>.<PEFT key>" the
                             policy adapter after the step), for the cases
                             below; _meta also gives both LoRA settings
                             ("lora" the policy's, "reference_lora") and the
                             reference-forward checks

Cases dpo.ref_other.sgd, dpo.ref_other.adamw, ipo.ref_other.sgd: every
setting as dpo.ref.* / ipo.ref.* (policy adapters/fresh loaded as a
trainable PeftModel, one step, ...), but the reference is adapters/ref_other,
a PEFT model holding two adapters of different LoraConfigs. TRL 1.16's
DPOTrainer creates its "ref" adapter with the policy's LoraConfig, which
cannot hold ref_other's tensors, so after the trainer is built the script
deletes that adapter (PeftModel.delete_adapter("ref")) and loads
adapters/ref_other in its place under the same name
(PeftModel.load_adapter(adapters/ref_other, adapter_name="ref",
is_trainable=False): ref_other's own LoraConfig, new LoRA layers on o_proj
and down_proj, rank-2 ones next to the policy's on q_proj). TRL's own code
then runs the reference forward (use_adapter(model, "ref"): only "ref"
active, so base + ref_other's LoRA, nothing of the policy's). Checked:
"default" stays the active adapter, its tensors the only trainable ones,
"ref" frozen with exactly ref_other's config and tensors (also after the
step); the forward TRL runs under use_adapter is with "ref" active, and its
per-row log-prob sums equal bitwise those of adapters/ref_other loaded alone
into a fresh PeftModel (same fused LM head) and differ from the base's
(adapters disabled) and from the policy's (fresh: lora_B = 0, so the base
at step 1); the f64 recomputation loads the policy and adapters/ref_other
as two separate PeftModels. Strings == ids bitwise as above.

--cpo writes only tests/fixtures/preference/cpo/ (it reads tokenizer/,
data_ids.jsonl, adapters/fresh and adapters/init; no file outside cpo/ is
written, FORMULAS.md is not touched; made with the versions above, torch
2.9.1+cu128 run on CPU, on an AMD EPYC machine where the default run
reproduces every committed file above byte for byte, while --two-adapters'
files come out up to 3e-6 off):

  cpo/FORMULAS.md            what TRL 1.16's CPOTrainer computes for
                             loss_type "sigmoid" (CPO_FORMULAS below)
  cpo/expected.json,         as expected.json / expected.safetensors (same
  cpo/expected.safetensors   per-case keys: settings, loss, logged_loss,
                             metrics, pairs_f64; "<case>.<PEFT key>" the
                             adapter after the step), for the cases below

Cases (CPO_CASES): experimental CPOTrainer with loss_type "sigmoid" (CPO:
summed completion log-probs, no reference model), every other setting as
the simpo cases (beta 0.1, the optimizers, seeds and data above):
  cpo     cpo_alpha 1.0 (TRL's default: with the NLL term), label_smoothing
          0: cpo.fresh.sgd, cpo.fresh.adamw, cpo.init.sgd, cpo.init.adamw
  cpo_ls  label_smoothing 0.1, cpo_alpha 0.5: cpo_ls.fresh.sgd,
          cpo_ls.init.adamw
  cpo_a0  cpo_alpha 0.0 (no NLL term; nll_loss logged as 0.0):
          cpo_a0.fresh.sgd
settings has no simpo_gamma for them (CPOTrainer reads it only for
loss_type "simpo"); pairs_f64 gives the per-pair SUMS
(policy_chosen_sum, policy_rejected_sum) and token counts. Checks as
above: strings == ids bitwise, and the f64 recomputation within 1e-5.
"""

import json
import os
import shutil
import sys
import tempfile

from fixture_steps import trl_environment

trl_environment()

import torch
from safetensors.torch import save_file

from fixture_steps import contiguous, failures, finish, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")
# --more's NF4 cases: the QLoRA fixture model (128 wide, vocab 128), whose
# projections all have in_features 128, a multiple of hlo-train's NF4 block.
NF4_MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "qlora", "llama")
TOKENIZER_JSON = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "tokenizer.json")
OUT = os.path.join(ROOT, "tests", "fixtures", "preference")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

# Prompts 4-7 tokens with BOS, completions 2-6 tokens with EOS; chosen and
# rejected of a pair differ in length, so right padding matters. Each prompt
# ends in punctuation and each completion starts with a letter, so the
# pre-tokenizer splits at the boundary and no merge crosses it.
PAIRS = [
    {"prompt": "XYZ=", "chosen": "ZYX", "rejected": "Q"},
    {"prompt": "KP=", "chosen": "PK", "rejected": "PKPK?"},
    {"prompt": "A+B:", "chosen": "B+A", "rejected": "AB"},
    {"prompt": "QUIET#", "chosen": "W", "rejected": "WON"},
]
TARGETS = ["q_proj", "v_proj"]
SEED = 42
OPTS = {"sgd": dict(optim="sgd", learning_rate=0.1), "adamw": dict(optim="adamw_torch", learning_rate=1e-3)}
METHODS = {
    "dpo": ("dpo", dict(loss_type=["sigmoid"])),
    "ipo": ("dpo", dict(loss_type=["ipo"])),
    "simpo": ("cpo", dict(loss_type="simpo")),
    "simpo_a0": ("cpo", dict(loss_type="simpo", cpo_alpha=0.0)),
    "orpo": ("orpo", dict()),
}
# --cpo: CPOTrainer's loss_type "sigmoid" (CPO), in cpo/ (not in CASES).
CPO_OUT = os.path.join(OUT, "cpo")
CPO_METHODS = {
    "cpo": ("cpo", dict(loss_type="sigmoid")),
    "cpo_ls": ("cpo", dict(loss_type="sigmoid", label_smoothing=0.1, cpo_alpha=0.5)),
    "cpo_a0": ("cpo", dict(loss_type="sigmoid", cpo_alpha=0.0)),
}
CPO_CASES = [("cpo", "fresh", "sgd"), ("cpo", "fresh", "adamw"), ("cpo", "init", "sgd"), ("cpo", "init", "adamw"),
             ("cpo_ls", "fresh", "sgd"), ("cpo_ls", "init", "adamw"), ("cpo_a0", "fresh", "sgd")]


def method_spec(method):
    """(trainer kind, config keywords) of a method of METHODS or CPO_METHODS."""
    return METHODS[method] if method in METHODS else CPO_METHODS[method]


FORMULAS = r"""# Preference losses of TRL 1.16.0, exactly

Read from trl 1.16.0's source (trl/trainer/dpo_trainer.py, dpo_config.py,
base_config.py, trainer/utils.py add_fused_lm_head, kernels/chunked_logprob.py,
experimental/cpo/cpo_trainer.py + cpo_config.py,
experimental/orpo/orpo_trainer.py + orpo_config.py, experimental/utils.py)
with transformers 5.24.0 and peft 0.21.2, and checked numerically by
scripts/make_preference_fixtures.py (every case recomputed in f64 from these
formulas). B = pairs in the batch; i indexes pairs.

## 1. Tokenization

### DPOTrainer (dpo, ipo)
String rows {"prompt","chosen","rejected"} (`_prepare_dataset`):
1. no "prompt" key: `extract_prompt` splits the longest common prefix of
   chosen/rejected off as the prompt (for strings: character prefix, moved
   back one char if the char before the split is a space);
2. non-conversational rows: the EOS token's TEXT is appended to chosen and to
   rejected unless the string already ends with it;
3. `prompt_ids = tok(prompt)`, `pc = tok(prompt + chosen)`,
   `pr = tok(prompt + rejected)`, each with the tokenizer's default
   add_special_tokens=True, i.e. the tokenizer's post-processor runs: a BOS
   is added only if the tokenizer's template adds one (ours does: id 0).
   Prompt and completion are tokenized TOGETHER, so merges across the
   boundary can happen;
4. `n = min(common_prefix_len(prompt_ids, pc), common_prefix_len(prompt_ids, pr))`,
   `prompt_ids = prompt_ids[:n]`, `chosen_ids = pc[n:]`,
   `rejected_ids = pr[n:]` (a warning if n < len(prompt_ids));
5. rows with len(prompt_ids) >= max_length are dropped (keep_start).
Conversational rows go through the chat template instead (prompt with
add_generation_prompt=True, prompt+chosen and prompt+rejected without), no EOS
text added, same common-prefix split.
Pre-tokenized rows {"prompt_ids","chosen_ids","rejected_ids"}: NOT accepted
by 1.16's DPOTrainer (`_prepare_dataset` calls extract_prompt, which needs
"chosen"); the collator below takes such ids verbatim, with nothing added.

### CPOTrainer (simpo) and ORPOTrainer (orpo) -- identical `tokenize_row`
Strings only (pre-tokenized rows are not accepted):
1. `maybe_extract_prompt`, `maybe_apply_chat_template` (conversational
   rows are rendered to strings by the chat template first);
2. `prompt_ids = tok(prompt, add_special_tokens=False)`;
   for each answer: `full = tok(prompt + answer, add_special_tokens=False)`,
   answer ids = `full[len(prompt_ids):]`, moved one token left if the prompt's
   last token merged with the answer;
3. BOS (tokenizer.bos_token_id) is prepended to the prompt unless it already
   starts with it; EOS (tokenizer.eos_token_id) is appended to each answer
   unless it already ends with it (ids, not text);
4. if len(prompt) + len(answer) > max_length the ANSWER is cut to
   max_length - len(prompt) (the prompt is never cut); no max_prompt_length
   exists in 1.16 (nor in DPOConfig).
For a tokenizer with a BOS template and no cross-boundary merges (the
fixture) both trainers give the same ids: prompt_ids = [BOS] + tok(prompt),
completion_ids = tok(completion) + [EOS].

### Defaults
max_length 1024 (all three); DPO truncation_mode "keep_start": each
prompt+completion sequence is cut to its first max_length tokens in the
collator (the completion mask cut with it). pad token: tokenizer.pad_token,
else the EOS token (set on the tokenizer by the trainer). ORPOConfig has
padding_value (None -> pad_token_id).

## 2. Batch layout (all three trainers)
One forward over 2B rows: rows 0..B-1 are prompt_i + chosen_i, rows B..2B-1
are prompt_i + rejected_i (same pair order), each RIGHT-padded with the pad
id to L = the longest of the 2B sequences; attention_mask 1 on real tokens, 0
on padding. No position_ids are passed (HF derives them 0..L-1 per row). The
completion mask is 1 on chosen/rejected tokens only (not prompt, not pad).
DPO: `model(input_ids, attention_mask, labels=input_ids masked to -100 off
the completion, fused_lm_head=True)`; CPO/ORPO: `model(input_ids,
attention_mask)`, full logits.

## 3. Sequence log-probabilities
logp_t = log_softmax(logits[t-1])[ids[t]] for t >= 1 (the logits at position
t-1 score token t), f32. Over a row's completion tokens C (tokens whose
completion mask is 1, position >= 1):
  S = sum_{t in C} logp_t,   N = |C|,   A = S / N.
- dpo, ipo: policy and reference use S (sum). (DPO's ld_alpha None, no
  f-divergence: reverse_kl.)
- simpo (CPO loss_type in {ipo, simpo}): A (average), policy only.
- orpo: A (average), policy only.

## 4. Losses (then averaged over the B pairs with .mean())
Let c_i, r_i be the policy's and c0_i, r0_i the reference's values for chosen
and rejected; beta = 0.1 by default in all three configs.
- dpo (loss_type "sigmoid"):
    d_i = (S(c_i) - S(c0_i)) - (S(r_i) - S(r0_i))
    loss = mean_i[ -logsigmoid(beta * d_i) ]
  label_smoothing is NOT used by "sigmoid" in 1.16 (only by "robust",
  "exo_pair", "aot", "aot_unpaired").
- ipo (loss_type "ipo"): the log-ratios are length-normalised by the
  completion-token count of each row (completion_mask.sum, clamped >= 1):
    h_i = (S(c_i) - S(c0_i)) / N(c_i) - (S(r_i) - S(r0_i)) / N(r_i)
    loss = mean_i[ (h_i - 1 / (2 beta))^2 ]
  (N counts completion-mask ones; same as the tokens summed unless
  max_length truncation cut into the completion.)
- simpo (CPOTrainer loss_type "simpo"; defaults beta 0.1, simpo_gamma 0.5,
  label_smoothing 0, cpo_alpha 1.0, alpha 0):
    z_i = A(c_i) - A(r_i) - simpo_gamma / beta
    L_i = -logsigmoid(beta z_i) (1 - ls) - logsigmoid(-beta z_i) ls
    nll = CrossEntropy mean over the chosen rows' completion tokens (all
          chosen completion tokens of the batch pooled: sum of -logp_t over
          them / their count), computed only if cpo_alpha != 0
    loss = mean_i L_i + cpo_alpha * nll
  With TRL's default cpo_alpha 1.0 this is CPO-SimPO, not the SimPO paper's
  loss; cpo_alpha 0.0 (or loss_type "alphapo") gives pure SimPO.
- orpo (ORPOConfig beta 0.1 = the paper's lambda):
    lo_i = (A(c_i) - A(r_i)) - (log1mexp(A(c_i)) - log1mexp(A(r_i))),
      log1mexp(x) = log(1 - e^x), computed as log1p(-exp(x)) if
      x < -ln 2 else log(-expm1(x)), in f32;
    nll = CrossEntropy mean over ALL non-pad tokens of the chosen rows except
          each row's first (prompt included: labels = input_ids where
          attention_mask is 1, shifted by one), pooled over the batch;
    loss = nll - beta * mean_i logsigmoid(lo_i)

## 5. Reference model (DPOTrainer; SimPO and ORPO have none)
- ref_model None and a peft_config given (fresh adapter): the reference is
  the same model with all adapters disabled (`model.disable_adapter()`), i.e.
  the base.
- ref_model None and the model already a PeftModel (existing adapter): the
  trainer adds a second adapter "ref" with the same LoraConfig and copies
  every ".default." parameter into ".ref." (frozen: not active, so not
  trainable); the reference forward runs with "ref" as the active adapter.
  (Exception: peft 0.17-0.19 with target_parameters: base instead.)
- ref_model given: that model (a full second model).
- precompute_ref_log_probs True: reference S computed once before training
  (same model choice), then read from the batch.
- There is no option to name another adapter as the reference.
The reference forward runs under no_grad, with gradient checkpointing off.

## 6. Logged metrics, step 1 (names as logged; values computed on the
batch before the optimizer step; means over the B pairs unless said)
### DPOTrainer (dpo, ipo)
- loss: as above
- rewards/chosen = mean_i beta (S(c_i) - S(c0_i));
  rewards/rejected = mean_i beta (S(r_i) - S(r0_i)) -- SUMS, also for ipo
  (not the length-normalised values the ipo loss uses)
- rewards/accuracies = mean_i [chosen reward > rejected reward] (strict)
- rewards/margins = mean_i (chosen reward - rejected reward)
- logps/chosen = mean_i S(c_i); logps/rejected = mean_i S(r_i) (policy, sums)
- logits/chosen = mean over all chosen completion tokens t of the batch
  (pooled, token-weighted) of mean_v logits[t-1, v] (the mean over the
  vocabulary of the logits that score token t); logits/rejected likewise
- entropy = token-weighted mean over ALL completion tokens (chosen and
  rejected rows) of the entropy of softmax(logits[t-1])
- mean_token_accuracy = fraction of chosen completion tokens t whose
  argmax(logits[t-1]) == ids[t] (ties: the first maximal index wins)
- num_tokens = total attention-mask ones of the batch (both halves, padding
  excluded), cumulative over steps
- also learning_rate, epoch and grad_norm (see section 7)
### CPOTrainer (simpo)
- loss as above; nll_loss = nll (0.0 when cpo_alpha == 0)
- rewards/chosen = mean_i beta A(c_i); rewards/rejected = mean_i beta A(r_i)
  (policy only, averages); rewards/accuracies, rewards/margins from those
- logps/chosen = mean_i A(c_i); logps/rejected = mean_i A(r_i)
- logits/chosen = mean of the WHOLE chosen-half logits tensor [B, L, V]:
  every position (prompt, completion AND right padding, including the last
  position) and every vocabulary entry; logits/rejected likewise
### ORPOTrainer (orpo)
- loss; nll_loss = nll
- rewards/chosen = mean_i beta A(c_i), rewards/rejected = mean_i beta A(r_i);
  rewards/accuracies, rewards/margins from those
- logps/chosen = mean_i A(c_i); logps/rejected = mean_i A(r_i)
- logits/chosen = mean of the chosen-half logits [B, L-1, V] (all positions
  but the last, padding included); logits/rejected likewise
- log_odds_ratio = mean_i logsigmoid(lo_i); log_odds_chosen = mean_i lo_i
CPO/ORPO metrics pass through f32 tensors (torch.tensor(list).mean()).

## 7. Training-loop defaults worth knowing (TRL 1.16 configs)
learning_rate 1e-6 (all three); bf16 defaults to True (when fp16 is unset);
gradient_checkpointing True; logging_steps 10; max_grad_norm 1.0 (from
TrainingArguments: global-L2 clipping on by default); optim: transformers'
default (adamw_torch_fused where available, else adamw_torch), betas (0.9,
0.999), eps 1e-8, weight_decay 0; lr_scheduler "linear", warmup 0;
disable_dropout True; grad_norm (logged by transformers 5.24 for every
trainer, also when clipping is off: max_grad_norm 0) is the global L2 norm
of all trainable gradients before clipping; the train sampler shuffles ("random") unless
train_sampling_strategy="sequential". DPO's loss is a plain mean per batch
(loss_is_scaled_for_ga False).

## 8. Conversational rows (data_chat.jsonl, chat_tokenizer/)
Rows are {"prompt", "chosen", "rejected"} message lists ({"role",
"content"}), or {"chosen", "rejected"} full conversations whose shared
leading messages are the prompt (`extract_prompt`: the messages before the
first index where chosen and rejected differ; the rest are the
completions).
### DPOTrainer (`_prepare_dataset`, `data_utils._tokenize`)
1. extract_prompt runs on the WHOLE dataset if the first row has no
   "prompt" key, else on none (so 1.16 cannot mix the two kinds in one
   dataset: see the script's dpo_chat_rows; per row, as CPO/ORPO do, is
   what a mixed file means);
2. is_conversational: no EOS text is added;
3. `prompt_ids = apply_chat_template(prompt, add_generation_prompt=True,
   tokenize=True)`, `pc = apply_chat_template(prompt + chosen)`,
   `pr = apply_chat_template(prompt + rejected)` (no generation prompt);
   transformers 5.24's apply_chat_template renders the Jinja template
   (trim_blocks, lstrip_blocks) and tokenizes the text with
   add_special_tokens=False: the template writes BOS itself; special tokens
   in the text (BOS, EOS, "<|user|>", ...) are matched as such;
4. the same split as strings: `n = min(common_prefix_len(prompt_ids, pc),
   common_prefix_len(prompt_ids, pr))`, prompt = `prompt_ids[:n]`, chosen =
   `pc[n:]`, rejected = `pr[n:]`. The prompt is the shared prefix of ids,
   not of text.
### CPO/ORPOTrainer
`maybe_extract_prompt` per row (a row whose "prompt" is missing or None is
split; one with a message-list prompt is kept), then
`maybe_apply_chat_template` renders to strings: prompt = the template with
add_generation_prompt=True (continue_final_message if the prompt ends with
an assistant message), cut to its longest common CHARACTER prefix with the
renderings of prompt + chosen and prompt + rejected; chosen = rendering of
prompt + chosen after that prefix, likewise rejected. Then `tokenize_row`
as for strings (section 1): add_special_tokens=False, BOS id prepended
unless there, EOS id appended unless there.
### The fixture's template
`{{ bos_token }}` then per message `<|role|>` + content + `{{ eos_token }}`,
and `<|assistant|>` as the generation prompt. Since the text starts with
BOS and each assistant turn ends with EOS, DPO and CPO/ORPO get the same
ids: prompt = [BOS, <|user|>, ..., EOS, <|assistant|>], completion =
content + [EOS] (data_chat_ids.jsonl). A template that ends turns with
another token (Llama 3's <|eot_id|>) would give CPO/ORPO one more token
(EOS after it) than DPO.

## 9. A quantized base (QLoRA: BitsAndBytesConfig load_in_4bit, nf4)
transformers' bitsandbytes integration makes every nn.Linear but the LM
head a bnb Linear4bit: in a Llama the seven layer projections; embeddings,
norms and lm_head stay in the checkpoint's dtype. Each weight is quantized
flat (row-major) in blocks of 64, absmax f32, NF4 codes; the forward with
bnb_4bit_compute_dtype f32 dequantizes and multiplies in f32. PEFT wraps
Linear4bit in lora.Linear4bit: result = base(x) + lora_B(lora_A(x)) *
scale with x cast to the LoRA tensors' dtype and the LoRA output cast back.
- DPOTrainer 1.16, whatever bf16 says: `if _is_quantized_model:` every
  trainable tensor (LoRA A and B of "default") is cast to bf16 after the
  trainer built its "ref" adapter (which stays f32). So on a quantized
  base the policy starts from the adapter ROUNDED to bf16 (with an
  existing adapter the policy then differs from the reference at step 1:
  the loss is not log 2), its LoRA path runs in bf16, and its gradients,
  grad_norm and the optimizer step (SGD; AdamW with bf16 state) are bf16.
- ORPOTrainer (and CPOTrainer) 1.16: with peft_config on a 4-bit model,
  prepare_model_for_kbit_training (freezes the base, casts fp16/bf16
  non-quantized parameters to f32; gradient checkpointing only if asked)
  then get_peft_model; with a PeftModel, nothing. The LoRA tensors are cast
  to bf16 only if bf16=True. So their LoRA stays f32.
### The fixture's NF4 cases (expected_more.*: `<method>.<start>.<opt>.nf4`)
dpo.init.sgd, dpo.fresh.sgd, dpo.init.adamw, orpo.init.sgd and
ipo.init.sgd, each with the settings of the f32 case of the same name
(data_ids.jsonl, SGD lr 0.1 / AdamW lr 1e-3 weight decay 0, no clipping,
beta 0.1), on the QLoRA fixture model tests/fixtures/qlora/llama (hidden
128, intermediate 128, vocab 128, 2 layers) loaded with load_in_4bit, nf4,
compute dtype f32, no double quant: its 14 projections NF4 (each
in_features 128, so every block of 64 lies within one row, as hlo-train's
NF4 stores them; the bitsandbytes weights equal quantize_4bit /
dequantize_4bit of the f32 checkpoint), embeddings, norms and lm_head f32.
Adapters: adapters_nf4/fresh (TRL's fresh adapter from peft_config, seed
42, lora_B = 0) and adapters_nf4/init (A and B ~ N(0, 0.1)), r 4, alpha 8,
q_proj and v_proj, f32. The LoRA is f32 throughout: TRL 1.16's DPOTrainer
would itself train a bf16 LoRA here (the cast above); the fixture script
undoes that cast, putting the adapter's f32 values back after the trainer
is built and before train() builds the optimizer, so the numbers are those
of an f32 adapter on the NF4 base (what hlo-train trains), with everything
else as TRL runs it. ORPOTrainer keeps f32 by itself. With the init
adapter the policy equals DPO's "ref" copy, so the step-1 DPO loss is
log 2 and the IPO loss (1 / (2 beta))^2 = 25.
"""

CPO_FORMULAS = r"""# CPO (CPOTrainer, loss_type "sigmoid") of TRL 1.16.0, exactly

Read from trl 1.16.0's source: trl/experimental/cpo/cpo_trainer.py (line
numbers below are of that file unless another is named), cpo_config.py,
trl/experimental/utils.py (DPODataCollatorWithPadding, pad_to_length) and
trl/trainer/utils.py (selective_log_softmax), with transformers 5.24.0 and
peft 0.21.2; checked numerically by scripts/make_preference_fixtures.py
--cpo (every case recomputed in f64 from these formulas, within 1e-5).
B = pairs in the batch, i indexes pairs. Tokenization, batch layout and the
pad id are those of ../FORMULAS.md sections 1-2 (CPOTrainer's tokenize_row;
for the fixture data: prompt_ids = [BOS] + tok(prompt), completion_ids =
tok(completion) + [EOS], data_ids.jsonl).

## 1. Config (CPOConfig, cpo_config.py)
loss_type "sigmoid" is CPOConfig's DEFAULT (choices "sigmoid", "hinge",
"ipo", "simpo", "alphapo"; "alphapo" becomes "simpo" with cpo_alpha 0 in
__post_init__). beta 0.1, label_smoothing 0.0, cpo_alpha 1.0, alpha 0.0
(AlphaPO reward shaping, off), simpo_gamma 0.5 (read only for "simpo",
line 367), max_length 1024, disable_dropout True. A label_smoothing > 0
is warned about and ignored only for "hinge" and "ipo" (lines 345-349); for
"sigmoid" it is used.

## 2. Labels and the batch
tokenize_row (lines 476-612) builds chosen_labels / rejected_labels = the
sequence's ids with -100 on the prompt tokens; DPODataCollatorWithPadding
(experimental/utils.py) right-pads *_input_ids with the pad id (EOS, 1,
here), *_attention_mask with 0 and *_labels with -100; concatenated_inputs
(lines 614-676) pads chosen and rejected to the same length L and stacks
them: rows 0..B-1 prompt_i + chosen_i, rows B..2B-1 prompt_i + rejected_i.
One forward (lines 818-824): model(input_ids, attention_mask,
use_cache=False), full logits [2B, L, V] (no position_ids). So the labels
that count are exactly the completion tokens (EOS included), never the
prompt or the padding.

## 3. Sequence log-probabilities: SUMS for "sigmoid"
get_batch_logps (lines 752-790): labels[:, 1:], logits[:, :-1] (the logits
at position t-1 score token t), loss_mask = labels != -100,
per-token logp_t = selective_log_softmax(logits, labels) (trl/trainer/
utils.py line 538; on the CPU in f32/f64: gather(logits) - logsumexp(logits)
per position), then
  S = sum_{t in C} logp_t            (average_log_prob False)
  A = S / |C|                        (average_log_prob True)
with C the row's completion tokens. concatenated_forward passes
average_log_prob = loss_type in ["ipo", "simpo"] (line 850), so "sigmoid"
(and "hinge") use the SUM S; "ipo" and "simpo" the average A. Policy
only: CPOTrainer has no reference model. c_i = S(chosen row i),
r_i = S(rejected row i), N(c_i) = |C| of chosen row i.

## 4. Loss
cpo_loss (lines 678-749), alpha == 0 (the default; lines 707-709):
  z_i = c_i - r_i
loss_type "sigmoid" (lines 723-728), ls = label_smoothing:
  L_i = -logsigmoid(beta z_i) (1 - ls) - logsigmoid(-beta z_i) ls
(for ls = 0: -logsigmoid(beta (c_i - r_i)), the DPO sigmoid loss without a
reference: CPO's Eq. 3). No gamma/margin term (that is "simpo" only,
lines 715-717).
NLL term (concatenated_forward lines 826-845):
  nll = nn.CrossEntropyLoss()(logits[:B, :-1].flatten, labels[:B, 1:].flatten)
i.e. reduction "mean", ignore_index -100: the mean of -logp_t over ALL
chosen completion tokens of the batch POOLED (sum over the B chosen rows'
completion tokens / their total count, EOS included; not a mean of
per-row means; the rejected rows never enter). If cpo_alpha == 0 it is not
computed: nll = tensor(0.0) (lines 842-843).
  loss = mean_i L_i + cpo_alpha * nll                         (line 890)
(plus aux_loss_coef * aux_loss only for MoE models with
output_router_logits). The NLL's log-softmax is torch's cross_entropy, the
sums' is selective_log_softmax: the same values up to f32 rounding.

## 5. Logged metrics (get_batch_loss_metrics, lines 865-917; names as
logged; step 1 = this batch, before the optimizer step)
rewards (cpo_loss lines 745-747, alpha == 0): chosen_reward_i = beta c_i,
rejected_reward_i = beta r_i (policy SUMS, detached; no reference).
- loss               = the loss above (logged by transformers' Trainer)
- rewards/chosen     = mean_i beta c_i                          (line 894)
- rewards/rejected   = mean_i beta r_i                          (line 895)
- rewards/accuracies = mean_i [beta c_i > beta r_i] (strict, as f32)
                                                            (lines 891, 896)
- rewards/margins    = mean_i (beta c_i - beta r_i)         (lines 897-899)
- logps/rejected     = mean_i r_i  (sums)                   (lines 900-902)
- logps/chosen       = mean_i c_i  (sums)                   (lines 903-905)
- logits/rejected    = mean of the WHOLE rejected-half logits tensor
                       [B, L, V]: every position (prompt, completion, right
                       padding, the last position too) and every vocabulary
                       entry                                (lines 906-908)
- logits/chosen      = the same over the chosen half        (lines 909-911)
- nll_loss           = nll, UNweighted (not times cpo_alpha); 0.0 when
                       cpo_alpha == 0                       (line 912)
- grad_norm          = transformers' global L2 norm of the trainable
                       gradients before clipping (logged also with
                       max_grad_norm 0); learning_rate; epoch
Each metric is a Python float per batch, stored (store_metrics, line
1000) and at logging time averaged over the stored batches as
torch.tensor(list).mean() (f32; log, lines 1068-1069): with one step
logged per batch (logging_steps 1), the batch's value rounded to f32.

## 6. The fixture's cases (cpo/expected.json, cpo/expected.safetensors)
CPOTrainer, loss_type "sigmoid", beta 0.1, no reference; settings and
optimizers as ../FORMULAS.md's simpo cases (one step, 4 pairs in one
batch, SGD lr 0.1 or AdamW lr 1e-3, weight decay 0, no clipping, constant
schedule, seed 42, f32, CPU):
- cpo.{fresh,init}.{sgd,adamw}: cpo_alpha 1.0, label_smoothing 0;
- cpo_ls.fresh.sgd, cpo_ls.init.adamw: label_smoothing 0.1, cpo_alpha 0.5;
- cpo_a0.fresh.sgd: cpo_alpha 0.0 (nll_loss logged 0.0).
fresh: the trainer wraps the base with peft_config (adapters/fresh, lora_B
= 0, so at step 1 the policy IS the base, and lora_A's gradient is 0: the
step changes only lora_B); init: a PeftModel loaded from adapters/init.
pairs_f64: per pair the f64 recomputation's policy_chosen_sum (c_i),
policy_rejected_sum (r_i), chosen_tokens and rejected_tokens (|C|).
"""


def tokenizer(folder="tokenizer"):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.join(OUT, folder))


def nf4_config():
    """QLoRA's storage, as --more's NF4 cases load the base (see NF4 below)."""
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_use_double_quant=False)


def base_model(dtype=torch.float32, nf4=False, model_dir=MODEL_DIR):
    """The base in dtype; nf4: NF4_MODEL_DIR loaded in 4 bits (dtype f32)."""
    from transformers import LlamaForCausalLM
    if not nf4:
        return LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype)
    import bitsandbytes as bnb
    model = LlamaForCausalLM.from_pretrained(NF4_MODEL_DIR, attn_implementation="eager", dtype=torch.float32,
                                             quantization_config=nf4_config(), device_map="cpu")
    # On a CPU with AVX512-BF16 bitsandbytes' inference forward (eval mode,
    # no grad) repacks the weight and runs a bf16 kernel; off, it
    # dequantizes to the f32 compute dtype and multiplies, as on a GPU (as
    # scripts/make_qlora_fixtures.py does).
    quantized = []
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False
            quantized.append(name)
    assert sorted(quantized) == sorted(nf4_modules()), quantized
    return model


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")


# --two-adapters: the reference adapter's LoRA settings, unlike the policy's
# (lora_config: r 4, alpha 8, q_proj and v_proj).
REF_OTHER_LORA = dict(r=2, lora_alpha=6, target_modules=["q_proj", "o_proj", "down_proj"], lora_dropout=0.0,
                      bias="none", use_rslora=False)
REF_OTHER_SEED = 3
POLICY_LORA = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, bias="none", use_rslora=False)


def ref_other_config():
    from peft import LoraConfig
    return LoraConfig(**REF_OTHER_LORA, task_type="CAUSAL_LM")


def save_adapter(peft_model, d):
    """save_pretrained, less the boilerplate model card (README.md)."""
    peft_model.save_pretrained(d)
    card = os.path.join(d, "README.md")
    if os.path.exists(card):
        os.remove(card)


def adapter_state(model, name="default"):
    from peft import get_peft_model_state_dict
    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def load_adapter(d, trainable=True, dtype=torch.float32, nf4=False):
    from peft import PeftModel
    m = base_model(dtype, nf4=nf4)
    m.name_or_path = None
    return PeftModel.from_pretrained(m, d, is_trainable=trainable)


def adapter_dir(name, nf4=False):
    """adapters/<name>, or adapters_nf4/<name> (the NF4 base's adapters)."""
    return os.path.join(OUT, "adapters_nf4" if nf4 else "adapters", name)


def rel(path):
    return os.path.relpath(path, OUT)


# ---------------------------------------------------------------------------
# --more: the NF4 (QLoRA) base.

NF4_PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
_nf4_cache = {}


def nf4_modules():
    """What transformers' bitsandbytes integration makes Linear4bit: every
    nn.Linear but the LM head (embeddings and norms are not Linear), the
    same seven projections hlo-train stores in NF4 (models/src/nf4.rs)."""
    with open(os.path.join(NF4_MODEL_DIR, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    return [f"model.layers.{i}.{p}" for i in range(layers) for p in NF4_PROJECTIONS]


def nf4_dequantized():
    """{weight name: f32}: each quantized projection of the f32 checkpoint
    NF4 round-tripped by bitsandbytes (blocksize 64 over the row-major
    flattened weight, absmax f32, no double quant), as
    scripts/make_qlora_fixtures.py's nf4_roundtrip. Every in_features is a
    multiple of 64, so each block lies in one row (hlo-train's layout)."""
    if not _nf4_cache:
        import bitsandbytes.functional as BF
        from safetensors.torch import load_file
        sd = load_file(os.path.join(NF4_MODEL_DIR, "model.safetensors"))
        for m in nf4_modules():
            w = sd[m + ".weight"].float().contiguous()
            assert w.shape[1] % 64 == 0, (m, tuple(w.shape))
            q, st = BF.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
            _nf4_cache[m + ".weight"] = BF.dequantize_4bit(q, st).float()
    return _nf4_cache


def check_nf4_base(pm):
    """The trainer's base is exactly the NF4 round trip of the f32
    checkpoint's projections (everything else f32, unchanged)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as BF
    from safetensors.torch import load_file
    want = nf4_dequantized()
    seen = set()
    for name, mod in pm.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            key = name.replace("base_model.model.", "", 1).replace(".base_layer", "") + ".weight"
            qs = mod.weight.quant_state
            assert qs.blocksize == 64 and qs.quant_type == "nf4" and not qs.nested, (key, qs.blocksize)
            assert qs.absmax.dtype == torch.float32 and qs.dtype == torch.float32, (key, qs.absmax.dtype, qs.dtype)
            assert torch.equal(BF.dequantize_4bit(mod.weight.data, qs).float(), want[key]), key
            seen.add(key)
    assert seen == set(want), sorted(seen ^ set(want))
    sd = load_file(os.path.join(NF4_MODEL_DIR, "model.safetensors"))
    params = {n.replace("base_model.model.", "", 1): p for n, p in pm.named_parameters()}
    for k, v in sd.items():
        if k not in want:
            assert params[k].dtype == torch.float32 and torch.equal(params[k].detach(), v), k


class FreshAdapterRecorder:
    """Records the adapter get_peft_model creates inside a trainer's
    __init__ (f32, before DPOTrainer's bf16 cast), by wrapping the
    get_peft_model the trainer's module imported."""

    def __init__(self, trainer_cls):
        import importlib
        trl_cls = next(c for c in trainer_cls.__mro__ if c.__module__.startswith("trl."))
        self.module = importlib.import_module(trl_cls.__module__)
        self.state = None

    def __enter__(self):
        self.orig = self.module.get_peft_model

        def wrapped(*a, **k):
            pm = self.orig(*a, **k)
            self.state = adapter_state(pm)
            return pm
        self.module.get_peft_model = wrapped
        return self

    def __exit__(self, *exc):
        self.module.get_peft_model = self.orig


def restore_f32_lora(pm, kind, f32):
    """TRL 1.16's DPOTrainer casts every trainable tensor to bf16 when the
    base is quantized (`if _is_quantized_model: param.data =
    param.data.to(torch.bfloat16)`, after it copied "default" into its
    f32 "ref" adapter); ORPOTrainer does not (its cast needs bf16=True).
    Checks that the trainable tensors are `f32` ({PEFT key: f32 tensor},
    the adapter the trainer started from), rounded to bf16 by DPOTrainer,
    and puts the exact f32 values back (the optimizer is built later, in
    train(), so it steps the f32 tensors)."""
    n = 0
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        assert ".default." in name, name
        want = f32[name.replace(".default.", ".")]
        assert want.dtype == torch.float32, (name, want.dtype)
        assert p.dtype == (torch.bfloat16 if kind == "dpo" else torch.float32), (name, p.dtype)
        assert torch.equal(p.detach().float(), want.to(p.dtype).float()), name
        p.data = want.clone()
        n += 1
    assert n == len(f32), (n, len(f32))


# ---------------------------------------------------------------------------
# --two-adapters: a reference adapter with its own LoraConfig.

def install_ref_other(pm):
    """Replaces TRL's "ref" adapter (a copy of the policy's, with the
    policy's LoraConfig) by adapters/ref_other under the same name, with
    ref_other's own LoraConfig, frozen; checks that "default" stays the
    active, only trainable adapter."""
    from safetensors.torch import load_file
    d = adapter_dir("ref_other")
    assert pm.active_adapter == "default" and list(pm.peft_config) == ["default", "ref"], list(pm.peft_config)
    trainable = sorted(n for n, p in pm.named_parameters() if p.requires_grad)
    pm.delete_adapter("ref")
    pm.load_adapter(d, adapter_name="ref", is_trainable=False, torch_device="cpu")
    assert pm.active_adapter == "default" and pm.active_adapters == ["default"], pm.active_adapters
    assert sorted(n for n, p in pm.named_parameters() if p.requires_grad) == trainable, "trainable set changed"
    for n, p in pm.named_parameters():
        assert p.requires_grad == (".default." in n), (n, p.requires_grad)
    check_ref_other(pm)
    cfg = pm.peft_config["ref"]
    pol = pm.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.inference_mode) == (2, 6, False, True), cfg
    assert set(cfg.target_modules) == set(REF_OTHER_LORA["target_modules"]), cfg.target_modules
    assert (pol.r, pol.lora_alpha, set(pol.target_modules)) == (4, 8, set(TARGETS)), pol
    # Every LoRA layer: only "default" active; ref's scale alpha / r = 3.
    layers = {}
    for n, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and hasattr(mod, "active_adapters") and len(mod.lora_A):
            assert mod.active_adapters == ["default"], (n, mod.active_adapters)
            layers[n.rsplit(".", 1)[-1]] = sorted(mod.lora_A.keys())
            if "ref" in mod.lora_A:
                assert mod.scaling["ref"] == 3.0, (n, mod.scaling)
    assert layers == {"q_proj": ["default", "ref"], "v_proj": ["default"], "o_proj": ["ref"],
                      "down_proj": ["ref"]}, layers
    assert len(load_file(os.path.join(d, "adapter_model.safetensors"))) == 12


def check_ref_other(pm):
    """pm's "ref" adapter is exactly adapters/ref_other's tensors."""
    from safetensors.torch import load_file
    want = load_file(os.path.join(adapter_dir("ref_other"), "adapter_model.safetensors"))
    got = adapter_state(pm, "ref")
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for k in want:
        assert torch.equal(got[k], want[k]), ("'ref' is not adapters/ref_other", k)


class ReferenceRecorder:
    """Records, for the first training step, the forward TRL's DPOTrainer
    runs under its use_adapter(model, name) (the reference: the adapter name,
    the active adapters inside, the per-token log-probs) and the one outside
    it (the policy), by wrapping the use_adapter DPOTrainer's module
    imported and hooking the PeftModel's forward."""

    def __init__(self, pm):
        import trl.trainer.dpo_trainer as module
        self.module, self.pm = module, pm
        self.inside = None
        self.ref = self.policy = self.adapter = self.active = None

    def __enter__(self):
        import contextlib
        self.orig = self.module.use_adapter
        rec = self

        @contextlib.contextmanager
        def wrapped(model, adapter_name):
            with rec.orig(model, adapter_name):
                if rec.adapter is None:
                    rec.adapter, rec.active = adapter_name, list(model.active_adapters)
                rec.inside = adapter_name
                try:
                    yield
                finally:
                    rec.inside = None
        self.module.use_adapter = wrapped
        self.hook = self.pm.register_forward_hook(self._record)
        return self

    def _record(self, module, args, out):
        lp = out.log_probs.detach().clone()
        if self.inside is not None:
            if self.ref is None:
                self.ref = lp
        elif self.policy is None:
            self.policy = lp

    def __exit__(self, *exc):
        self.module.use_adapter = self.orig
        self.hook.remove()


def check_reference_forward(rec, batch):
    """The reference forward TRL ran (rec) used adapters/ref_other: its
    per-row log-prob sums equal those of adapters/ref_other loaded alone
    into a fresh PeftModel (TRL's fused LM head, the same batch), and
    differ from the base's and the policy's. Returns the checks' numbers."""
    from peft import PeftModel
    from trl.trainer.utils import add_fused_lm_head
    assert rec.adapter == "ref" and rec.active == ["ref"], (rec.adapter, rec.active)
    assert rec.ref is not None and rec.policy is not None
    ids, attn, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    labels = ids.masked_fill(cm == 0, -100)
    seq_len = ids.shape[1] - 1
    m = base_model()
    m.name_or_path = None
    add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    alone = PeftModel.from_pretrained(m, adapter_dir("ref_other"), is_trainable=False)
    alone.train()  # as the trainer's model (dropout 0: the same)
    kw = dict(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True, use_cache=False)
    with torch.no_grad():
        lp_alone = alone(**kw).log_probs
        with alone.disable_adapter():
            lp_base = alone(**kw).log_probs

    def sums(lp):
        return lp[:, -seq_len:].sum(dim=1)

    ref, pol, solo, base = sums(rec.ref), sums(rec.policy), sums(lp_alone), sums(lp_base)
    d_solo = (ref - solo).abs().max().item()
    d_base = (ref - base).abs().max().item()
    d_pol = (ref - pol).abs().max().item()
    assert torch.equal(rec.ref, lp_alone), ("TRL's reference forward != adapters/ref_other alone", d_solo)
    assert d_base > 1e-2 and d_pol > 1e-2, (d_base, d_pol)
    return {"ref_vs_ref_other_alone": d_solo, "ref_vs_base": d_base, "ref_vs_policy": d_pol,
            "ref_sums": [float(x) for x in ref], "policy_sums": [float(x) for x in pol]}


REF_CHECKS = {}


# ---------------------------------------------------------------------------
# Inputs: tokenizer, data, adapters.

@step("inputs")
def write_inputs():
    from transformers import PreTrainedTokenizerFast
    from peft import get_peft_model
    os.makedirs(OUT, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER_JSON, bos_token=BOS, eos_token=EOS)
    tok.save_pretrained(os.path.join(OUT, "tokenizer"))
    write_jsonl("data.jsonl", PAIRS)
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)
    # Random adapters (b) and (c): every LoRA tensor from N(0, 0.1).
    for name, seed in [("init", 1), ("ref", 2)]:
        torch.manual_seed(seed)
        m = base_model()
        m.name_or_path = None
        pm = get_peft_model(m, lora_config())
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.1)
        save_adapter(pm, os.path.join(OUT, "adapters", name))
    # The fresh adapter exactly as TRL makes it: set_seed(args.seed), then
    # get_peft_model(model, peft_config) (checked against the trainers below).
    from transformers import set_seed
    m = base_model()
    m.name_or_path = None
    set_seed(SEED)
    pm = get_peft_model(m, lora_config())
    save_adapter(pm, os.path.join(OUT, "adapters", "fresh"))


@step("nf4_inputs")
def write_nf4_inputs():
    """adapters_nf4/: the adapters of --more's NF4 cases, on NF4_MODEL_DIR
    (made on its f32 weights; LoRA sees only the shapes): init, A and B ~
    N(0, 0.1) (seed 1, as adapters/init), and fresh, as TRL creates it
    from peft_config (set_seed(42), get_peft_model; checked against
    DPOTrainer's own in run_trl). Also checks that data_ids.jsonl fits the
    base's vocabulary."""
    from peft import get_peft_model
    from transformers import set_seed
    with open(os.path.join(NF4_MODEL_DIR, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    for r in read_ids():
        for k, v in r.items():
            assert all(0 <= i < vocab for i in v), ("id outside the NF4 base's vocab", k, v)
    torch.manual_seed(1)
    m = base_model(model_dir=NF4_MODEL_DIR)
    m.name_or_path = None
    pm = get_peft_model(m, lora_config())
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    save_adapter(pm, adapter_dir("init", nf4=True))
    m = base_model(model_dir=NF4_MODEL_DIR)
    m.name_or_path = None
    set_seed(SEED)
    pm = get_peft_model(m, lora_config())
    save_adapter(pm, adapter_dir("fresh", nf4=True))
    for name in ("init", "fresh"):
        from safetensors.torch import load_file
        sd = load_file(os.path.join(adapter_dir(name, nf4=True), "adapter_model.safetensors"))
        assert all(v.dtype == torch.float32 for v in sd.values()), name
        layers = len(nf4_modules()) // len(NF4_PROJECTIONS)
        assert len(sd) == layers * len(TARGETS) * 2, (name, sorted(sd))  # lora_A and lora_B per target
        if name == "fresh":
            assert all(not v.any() for k, v in sd.items() if "lora_B" in k), "fresh lora_B must be 0"


@step("two_inputs")
def write_two_inputs():
    """adapters/ref_other/ (--two-adapters): A and B ~ N(0, 0.1) (seed 3, as
    adapters/init and adapters/ref), LoRA settings REF_OTHER_LORA."""
    from peft import get_peft_model
    torch.manual_seed(REF_OTHER_SEED)
    m = base_model()
    m.name_or_path = None
    pm = get_peft_model(m, ref_other_config())
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    d = adapter_dir("ref_other")
    save_adapter(pm, d)
    from safetensors.torch import load_file
    sd = load_file(os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (2, 6, False), cfg
    assert sorted(cfg["target_modules"]) == sorted(REF_OTHER_LORA["target_modules"]), cfg["target_modules"]
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert len(sd) == 2 * 3 * 2, sorted(sd)  # 2 layers, 3 targets, lora_A and lora_B
    for k, v in sd.items():
        assert v.shape[0 if "lora_A" in k else 1] == 2, (k, tuple(v.shape))


def check_vocab(rows):
    """Every id of the pre-tokenized rows is within the model's vocab (128)."""
    for r in rows:
        for k in r:
            assert all(0 <= i < 128 for i in r[k]), ("id outside the model's vocab", r)


def write_jsonl(name, rows, sources=None):
    """Writes `rows` to OUT/name, one JSON object a line; with `sources`,
    prints which row each source became."""
    with open(os.path.join(OUT, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for p, r in zip(sources or [], rows):
        print(f"  {p} -> {r}")


def tokenized_rows():
    """The ids DPOTrainer's own _prepare_dataset derives from data.jsonl, and
    the same from CPO/ORPO's tokenize_row (must agree)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, report_to="none", bf16=False, use_cpu=True)
        trainer = DPOTrainer(model=base_model(), args=args, train_dataset=Dataset.from_list(PAIRS),
                             processing_class=tok, peft_config=lora_config())
        rows = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                for r in trainer.train_dataset]
    check_vocab(rows)
    return rows


@step("data_ids")
def write_ids():
    write_jsonl("data_ids.jsonl", tokenized_rows(), PAIRS)


def read_ids():
    with open(os.path.join(OUT, "data_ids.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_jsonl(name):
    with open(os.path.join(OUT, name)) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------
# --more: conversational rows.

CHAT_SPECIAL = ["<|user|>", "<|assistant|>"]  # ids 96 and 97 of chat_tokenizer/
# Each message is "<|role|>" + content + EOS; the conversation starts with
# BOS; the generation prompt is "<|assistant|>". The assistant's turn ends
# with the EOS token, so DPOTrainer's ids (no EOS added to conversations)
# and CPO/ORPOTrainer's (BOS/EOS ids added unless there) are the same.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


# Two rows with an explicit prompt (the second a three-turn prompt), two
# without (the leading user message shared by chosen and rejected is the
# prompt, TRL's extract_prompt). Contents tokenize without merges (as PAIRS).
CHAT_PAIRS = [
    {"prompt": [_u("XYZ=")], "chosen": [_a("ZYX")], "rejected": [_a("Q")]},
    {"prompt": [_u("KP="), _a("PK"), _u("AGAIN?")], "chosen": [_a("PK!")], "rejected": [_a("KP")]},
    {"chosen": [_u("A+B:"), _a("B+A")], "rejected": [_u("A+B:"), _a("AB")]},
    {"chosen": [_u("QUIET#"), _a("W")], "rejected": [_u("QUIET#"), _a("WON")]},
]


@step("chat_inputs")
def write_chat_inputs():
    """chat_tokenizer/: the fixture tokenizer with "<|user|>" and
    "<|assistant|>" added as special tokens at ids 96 and 97 (every byte
    token from id 96 on moves up by 2, so printable ASCII keeps ids
    2..95), and a tokenizer_config.json with CHAT_TEMPLATE; data_chat.jsonl."""
    from tokenizers import Tokenizer
    with open(TOKENIZER_JSON) as f:
        t = json.load(f)
    first = 96
    vocab = {s: (i if i < first else i + len(CHAT_SPECIAL)) for s, i in t["model"]["vocab"].items()}
    for k, s in enumerate(CHAT_SPECIAL):
        assert s not in vocab, s
        vocab[s] = first + k
    t["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    for k, s in enumerate(CHAT_SPECIAL):
        t["added_tokens"].append({"id": first + k, "content": s, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    d = os.path.join(OUT, "chat_tokenizer")
    os.makedirs(d, exist_ok=True)
    Tokenizer.from_str(json.dumps(t)).save(os.path.join(d, "tokenizer.json"))
    config = {"backend": "tokenizers", "bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE,
              "model_max_length": 1024, "tokenizer_class": "TokenizersBackend"}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    tok = tokenizer("chat_tokenizer")
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token) == (0, 1, None)
    assert tok.convert_tokens_to_ids(CHAT_SPECIAL) == [96, 97]
    assert tok("AZ!~", add_special_tokens=False)["input_ids"] == [34, 59, 2, 95]
    write_jsonl("data_chat.jsonl", CHAT_PAIRS)
    with open(os.path.join(OUT, "FORMULAS.md"), "w") as f:
        f.write(FORMULAS)


def dpo_chat_rows(rows):
    """TRL 1.16's DPOTrainer decides from the FIRST row whether to run
    extract_prompt on the whole dataset, so it cannot take rows with and
    without "prompt" together (first row explicit: the implicit rows'
    prompt is None and tokenizing fails, "You need to specify either
    `text` or `text_target`"; first row implicit: the explicit rows'
    prompt is replaced by an empty list, "Cannot apply chat template to an
    empty conversation"). TRL's per-row maybe_extract_prompt (what
    CPO/ORPOTrainer map over the dataset) first makes every prompt
    explicit; tokenized_chat_rows checks that this gives the ids
    DPOTrainer gives each kind of row on its own."""
    from trl.data_utils import maybe_extract_prompt
    return [maybe_extract_prompt(dict(r)) for r in rows]


def tokenized_chat_rows():
    """The ids DPOTrainer's own _prepare_dataset derives from
    data_chat.jsonl (checked against the explicit and the implicit rows
    each on their own, and against ORPOTrainer's tokenize_row)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    rows_in = read_jsonl("data_chat.jsonl")

    def dpo_ids(rows):
        with tempfile.TemporaryDirectory() as tmp:
            args = DPOConfig(output_dir=tmp, report_to="none", bf16=False, use_cpu=True)
            trainer = DPOTrainer(model=base_model(), args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=tokenizer("chat_tokenizer"), peft_config=lora_config())
            return [{k: list(r[k]) for k in keys} for r in trainer.train_dataset]

    rows = dpo_ids(dpo_chat_rows(rows_in))
    explicit = [i for i, r in enumerate(rows_in) if "prompt" in r]
    implicit = [i for i, r in enumerate(rows_in) if "prompt" not in r]
    assert explicit and implicit
    for idx, got in ((explicit, dpo_ids([rows_in[i] for i in explicit])),
                     (implicit, dpo_ids([rows_in[i] for i in implicit]))):
        assert [rows[i] for i in idx] == got, (idx, got)
    tok = tokenizer("chat_tokenizer")
    tok.pad_token = tok.eos_token
    with tempfile.TemporaryDirectory() as tmp:
        args = ORPOConfig(output_dir=tmp, report_to="none", bf16=False, use_cpu=True)
        trainer = ORPOTrainer(model=base_model(), args=args, train_dataset=Dataset.from_list(rows_in),
                              processing_class=tok, peft_config=lora_config())
        for want, r in zip(rows, trainer.train_dataset):
            p = list(r["prompt_input_ids"])
            c, j = list(r["chosen_input_ids"]), list(r["rejected_input_ids"])
            assert c[:len(p)] == p and j[:len(p)] == p, r
            assert {"prompt_ids": p, "chosen_ids": c[len(p):], "rejected_ids": j[len(p):]} == want, (r, want)
    check_vocab(rows)
    return rows


@step("data_chat_ids")
def write_chat_ids():
    write_jsonl("data_chat_ids.jsonl", tokenized_chat_rows(), CHAT_PAIRS)


# ---------------------------------------------------------------------------
# TRL runs.

def trainer_classes():
    """TRL's trainers, each with (1) the loss of its first compute_loss kept
    and (2) a pass-through for pre-tokenized rows (1.16 has none)."""
    from trl import DPOTrainer
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    def keep_loss(cls):
        class Kept(cls):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)
                loss = out[0] if isinstance(out, tuple) else out
                if not hasattr(self, "first_loss"):
                    self.first_loss = loss.detach().float().item()
                    self.first_batch = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
                return out
        return Kept

    class DPO(keep_loss(DPOTrainer)):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:
                return dataset  # verbatim: the collator concatenates, nothing added
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def ids_row(feature):
        p, c, r = feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"]
        return {"prompt_input_ids": p, "prompt_attention_mask": [1] * len(p),
                "chosen_input_ids": p + c, "chosen_attention_mask": [1] * (len(p) + len(c)),
                "chosen_labels": [-100] * len(p) + c,
                "rejected_input_ids": p + r, "rejected_attention_mask": [1] * (len(p) + len(r)),
                "rejected_labels": [-100] * len(p) + r}

    class CPO(keep_loss(CPOTrainer)):
        def tokenize_row(self, feature, model=None):
            return ids_row(feature) if "prompt_ids" in feature else super().tokenize_row(feature, model)

    class ORPO(keep_loss(ORPOTrainer)):
        def tokenize_row(self, feature, model=None):
            return ids_row(feature) if "prompt_ids" in feature else super().tokenize_row(feature, model)

    return {"dpo": DPO, "cpo": CPO, "orpo": ORPO}


def run_trl(method, start, opt, form, variant=None):
    """One optimizer step of TRL's trainer. Returns (loss, metrics, initial
    adapter, adapter after the step, first batch). variant (--more): None
    (the base in f32, data.jsonl / data_ids.jsonl), "nf4" (NF4_MODEL_DIR
    loaded in NF4 by bitsandbytes, the adapters of adapters_nf4/, and
    DPOTrainer's bf16 cast of the trainable LoRA tensors undone: f32 LoRA),
    "chat" (data_chat.jsonl / data_chat_ids.jsonl with chat_tokenizer/)."""
    from datasets import Dataset
    from trl import DPOConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig
    kind, method_kw = method_spec(method)
    cls = trainer_classes()[kind]
    config_cls = {"dpo": DPOConfig, "cpo": CPOConfig, "orpo": ORPOConfig}[kind]
    nf4 = variant == "nf4"
    if variant == "chat":
        rows = read_jsonl("data_chat.jsonl") if form == "strings" else read_jsonl("data_chat_ids.jsonl")
        if form == "strings" and kind == "dpo":
            rows = dpo_chat_rows(rows)
    else:
        rows = PAIRS if form == "strings" else read_ids()
    with tempfile.TemporaryDirectory() as tmp:
        args = config_cls(
            output_dir=tmp, per_device_train_batch_size=len(rows), gradient_accumulation_steps=1, max_steps=1,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
            logging_steps=1, save_strategy="no", report_to="none", bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, seed=SEED, data_seed=SEED,
            train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
            **OPTS[opt], **method_kw)
        kw = {}
        if start == "fresh":
            model = base_model(nf4=nf4)
            model.name_or_path = None
            kw["peft_config"] = lora_config()
        else:
            model = load_adapter(adapter_dir("init" if start == "init" else "fresh", nf4=nf4), nf4=nf4)
        tok = tokenizer("chat_tokenizer" if variant == "chat" else "tokenizer")
        if kind != "dpo":
            # CPO/ORPOTrainer build their collator with tokenizer.pad_token_id
            # BEFORE they default the pad token to EOS, so a tokenizer without
            # one fails at the first batch ("Padding is enabled, but the
            # tokenizer is not configured with a padding token"). Set it as
            # the error asks: the same id (EOS, 1) DPOTrainer pads with.
            tok.pad_token = tok.eos_token
        with FreshAdapterRecorder(cls) as fresh:
            trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                          **kw)
        pm = trainer.model
        if kind == "dpo" and start != "fresh":
            assert "ref" in pm.peft_config, "TRL did not add its 'ref' adapter"
            for n, p in pm.named_parameters():
                assert (".ref." not in n) or not p.requires_grad, n
        if start == "ref":
            from safetensors.torch import load_file
            want = load_file(os.path.join(OUT, "adapters", "ref", "adapter_model.safetensors"))
            loaded = 0
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if ".ref." in n:
                        key = n.replace(".ref.", ".")
                        p.copy_(want[key])
                        loaded += 1
            assert loaded == len(want), (loaded, len(want))
        if start == "ref_other":
            install_ref_other(pm)
        if nf4:
            assert start != "ref", "no NF4 case with a reference adapter"
            check_nf4_base(pm)
            from safetensors.torch import load_file
            saved = load_file(os.path.join(adapter_dir(start, nf4=True), "adapter_model.safetensors"))
            if start == "fresh":
                # TRL's own f32 adapter, before DPOTrainer's bf16 cast, is adapters_nf4/fresh.
                assert fresh.state is not None and fresh.state.keys() == saved.keys(), "no fresh adapter seen"
                for k in saved:
                    assert torch.equal(fresh.state[k], saved[k]), ("TRL's fresh adapter differs", k)
            restore_f32_lora(pm, kind, saved)
        init = adapter_state(pm)
        if start == "ref_other":
            with ReferenceRecorder(pm) as rec:
                trainer.train()
            check_ref_other(pm)  # frozen: unchanged by the step
            assert pm.active_adapters == ["default"], pm.active_adapters
            REF_CHECKS.setdefault(f"{method}.{start}.{opt}", {})[form] = check_reference_forward(
                rec, trainer.first_batch)
        else:
            trainer.train()
        logs = dict(trainer.state.log_history[0])
        after = adapter_state(pm)
        return trainer.first_loss, logs, init, after, trainer.first_batch


# ---------------------------------------------------------------------------
# Independent recomputation in f64.

def batch_of(rows, pad_id):
    seqs = [r["prompt_ids"] + r["chosen_ids"] for r in rows] + [r["prompt_ids"] + r["rejected_ids"] for r in rows]
    comp = [[0] * len(r["prompt_ids"]) + [1] * len(r["chosen_ids"]) for r in rows] + \
           [[0] * len(r["prompt_ids"]) + [1] * len(r["rejected_ids"]) for r in rows]
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (L - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    cmask = torch.tensor([c + [0] * (L - len(c)) for c in comp])
    return ids, attn, cmask


def f64_model(adapter, nf4=False):
    """Base in f64 with the adapter from folder `adapter` (None: no adapter).
    nf4: NF4_MODEL_DIR with its layer projections replaced by their NF4
    round trip."""
    if not nf4:
        if adapter is None:
            return base_model(torch.float64).eval()
        return load_adapter(adapter, trainable=True, dtype=torch.float64).eval()
    from peft import PeftModel
    m = base_model(torch.float64, model_dir=NF4_MODEL_DIR)
    with torch.no_grad():
        for name, w in nf4_dequantized().items():
            m.get_parameter(name).copy_(w.double())
    if adapter is None:
        return m.eval()
    m.name_or_path = None
    return PeftModel.from_pretrained(m, adapter, is_trainable=True).eval()


def per_token(logits, ids):
    """logp[:, t] for t >= 1 (logits[:, t-1] score ids[:, t]); shape [2B, L-1]."""
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def hand(method, policy_dir, ref_dir, rows, beta=0.1, gamma=0.5, nf4=False):
    """Loss, metrics and gradients (by LoRA key) from the formulas, in f64.
    nf4: on the NF4 round-tripped NF4_MODEL_DIR."""
    import torch.nn.functional as F
    from peft import get_peft_model_state_dict
    ids, attn, cmask = batch_of(rows, pad_id=1)
    B = len(rows)
    pol = f64_model(policy_dir, nf4=nf4)
    for n, p in pol.named_parameters():
        p.requires_grad_("lora_" in n)
    logits = pol(input_ids=ids, attention_mask=attn).logits
    lp = per_token(logits, ids)
    m = cmask[:, 1:].double()
    S = (lp * m).sum(1)
    N = m.sum(1)
    A = S / N
    out = {}
    if method in ("dpo", "ipo"):
        with torch.no_grad():
            ref = f64_model(ref_dir, nf4=nf4)
            lp0 = per_token(ref(input_ids=ids, attention_mask=attn).logits, ids)
        S0 = (lp0 * m).sum(1)
        cr, rr = S[:B] - S0[:B], S[B:] - S0[B:]
        if method == "dpo":
            loss = (-F.logsigmoid(beta * (cr - rr))).mean()
        else:
            h = cr / N[:B] - rr / N[B:]
            loss = ((h - 1 / (2 * beta)) ** 2).mean()
        rc, rj = beta * cr.detach(), beta * rr.detach()
        logits_d = logits.detach()[:, :-1]
        mean_v = logits_d.mean(-1)
        mc, mr = m[:B].bool(), m[B:].bool()
        probs = torch.softmax(logits_d, -1)
        ent = -(probs * torch.log_softmax(logits_d, -1)).sum(-1)
        top1 = logits_d.argmax(-1) == ids[:, 1:]
        out.update({"logits/chosen": mean_v[:B][mc].mean().item(), "logits/rejected": mean_v[B:][mr].mean().item(),
                    "entropy": ent[m.bool()].mean().item(),
                    "mean_token_accuracy": top1[:B][mc].double().mean().item(),
                    "num_tokens": float(attn.sum())})
        logps_c, logps_r = S[:B], S[B:]
        pairs = {"policy_chosen_sum": S[:B], "policy_rejected_sum": S[B:], "ref_chosen_sum": S0[:B],
                 "ref_rejected_sum": S0[B:], "chosen_tokens": N[:B], "rejected_tokens": N[B:]}
    else:
        logits_d = logits.detach()
        if method in ("simpo", "simpo_a0"):
            alpha = 1.0 if method == "simpo" else 0.0
            z = A[:B] - A[B:] - gamma / beta
            L_i = -F.logsigmoid(beta * z)
            nll = -(lp[:B] * m[:B]).sum() / m[:B].sum()
            loss = L_i.mean() + alpha * nll
            out["nll_loss"] = nll.item() if alpha else 0.0
            out["logits/chosen"] = logits_d[:B].mean().item()
            out["logits/rejected"] = logits_d[B:].mean().item()
        elif method in CPO_METHODS:  # CPOTrainer loss_type "sigmoid": sums S, no reference
            kw = CPO_METHODS[method][1]
            alpha, ls = kw.get("cpo_alpha", 1.0), kw.get("label_smoothing", 0.0)
            z = S[:B] - S[B:]
            L_i = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
            nll = -(lp[:B] * m[:B]).sum() / m[:B].sum()
            loss = L_i.mean() + alpha * nll
            out["nll_loss"] = nll.item() if alpha else 0.0
            out["logits/chosen"] = logits_d[:B].mean().item()
            out["logits/rejected"] = logits_d[B:].mean().item()
        else:  # orpo
            def log1mexp(x):
                return torch.log(-torch.expm1(x))
            lo = (A[:B] - A[B:]) - (log1mexp(A[:B]) - log1mexp(A[B:]))
            am = attn[:B, 1:].double()
            nll = -(lp[:B] * am).sum() / am.sum()
            loss = nll - beta * F.logsigmoid(lo).mean()
            out.update({"nll_loss": nll.item(), "log_odds_ratio": F.logsigmoid(lo).mean().item(),
                        "log_odds_chosen": lo.mean().item(),
                        "logits/chosen": logits_d[:B, :-1].mean().item(),
                        "logits/rejected": logits_d[B:, :-1].mean().item()})
        if method in CPO_METHODS:
            rc, rj = beta * S[:B].detach(), beta * S[B:].detach()
            logps_c, logps_r = S[:B], S[B:]
            pairs = {"policy_chosen_sum": S[:B], "policy_rejected_sum": S[B:], "chosen_tokens": N[:B],
                     "rejected_tokens": N[B:]}
        else:
            rc, rj = beta * A[:B].detach(), beta * A[B:].detach()
            logps_c, logps_r = A[:B], A[B:]
            pairs = {"policy_chosen_avg": A[:B], "policy_rejected_avg": A[B:], "chosen_tokens": N[:B],
                     "rejected_tokens": N[B:]}
    out.update({"rewards/chosen": rc.mean().item(), "rewards/rejected": rj.mean().item(),
                "rewards/accuracies": (rc > rj).double().mean().item(), "rewards/margins": (rc - rj).mean().item(),
                "logps/chosen": logps_c.mean().item(), "logps/rejected": logps_r.mean().item()})
    loss.backward()
    grads = {}
    named = dict(pol.named_parameters())
    keys = get_peft_model_state_dict(pol).keys()
    for k in keys:
        pname = k.replace(".weight", ".default.weight")
        grads[k] = named[pname].grad.detach().clone()
    params = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pol).items()}
    return loss.item(), out, params, grads, {k: [float(x) for x in v.detach()] for k, v in pairs.items()}


# ---------------------------------------------------------------------------

CASES = [(m, s, o) for m in METHODS for s in ("fresh", "init", "ref") for o in OPTS
         if s != "ref" or m in ("dpo", "ipo")]
LR = {"sgd": 0.1, "adamw": 1e-3}


TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def run_case(method, start, opt, variant=None):
    """One case through TRL twice (strings through TRL's tokenization, and
    the pre-tokenized rows verbatim: must agree bitwise) and once by hand in
    f64. Returns (name, expected entry, tensors, diffs to the f64 check)."""
    name = f"{method}.{start}.{opt}" + (f".{variant}" if variant else "")
    nf4 = variant == "nf4"
    kind, method_kw = method_spec(method)
    loss, logs, init, after, batch = run_trl(method, start, opt, "strings", variant)
    loss2, logs2, init2, after2, batch2 = run_trl(method, start, opt, "ids", variant)
    # Strings through TRL's tokenization == the pre-tokenized rows verbatim.
    assert loss == loss2, (name, loss, loss2)
    for k in logs:
        if k not in TIMING_KEYS:
            assert logs[k] == logs2.get(k), (name, k, logs[k], logs2.get(k))
    for k in after:
        assert torch.equal(after[k], after2[k]) and torch.equal(init[k], init2[k]), (name, k)
    if variant is not None:
        assert batch.keys() == batch2.keys(), (name, sorted(batch), sorted(batch2))
        for k in batch:
            assert torch.equal(batch[k], batch2[k]), (name, "batch", k)
    if start == "fresh":
        from safetensors.torch import load_file
        fresh_init = load_file(os.path.join(adapter_dir("fresh", nf4=nf4), "adapter_model.safetensors"))
        assert init.keys() == fresh_init.keys(), name
        for k in init:
            assert torch.equal(init[k], fresh_init[k]), ("TRL's fresh adapter differs from the saved one", k)
    # Independent f64 recomputation.
    policy = {"fresh": "fresh", "init": "init", "ref": "fresh", "ref_other": "fresh"}[start]
    policy_dir = adapter_dir(policy, nf4=nf4)
    ref_dir = {"fresh": None, "init": adapter_dir("init", nf4=nf4), "ref": adapter_dir("ref"),
               "ref_other": adapter_dir("ref_other")}[start]
    rows = read_jsonl("data_chat_ids.jsonl") if variant == "chat" else read_ids()
    h_loss, h_metrics, h_params, h_grads, pairs = hand(method, policy_dir, ref_dir, rows, nf4=nf4)
    d_loss = abs(h_loss - loss)
    d_met = max(abs(h_metrics[k] - logs[k]) for k in h_metrics)
    missing = [k for k in h_metrics if k not in logs]
    assert not missing, (name, missing)
    # transformers 5 logs grad_norm (global L2 norm of the trainable
    # gradients, before any clipping) even with clipping off.
    g_norm = sum((g ** 2).sum() for g in h_grads.values()).sqrt().item()
    h_metrics["grad_norm"] = g_norm
    d_ad = 0.0
    for k, p0 in h_params.items():
        g = h_grads[k]
        want = p0 - LR[opt] * g if opt == "sgd" else p0 - LR[opt] * g / (g.abs() + 1e-8)
        d_ad = max(d_ad, (want - after[k].double()).abs().max().item())
    diffs = {"loss": d_loss, "metrics": d_met, "adapter": d_ad, "grad_norm": abs(g_norm - logs["grad_norm"])}
    print(f"{name:26s} loss {loss:.7f}  f64 check: |dloss| {d_loss:.1e}  max|dmetric| {d_met:.1e}  "
          f"max|dadapter| {d_ad:.1e}")
    settings = {"trainer": {"dpo": "DPOTrainer", "cpo": "CPOTrainer", "orpo": "ORPOTrainer"}[kind],
                **{k: v for k, v in method_kw.items()}, "beta": 0.1,
                "start": start, "policy_adapter": rel(policy_dir),
                "reference": ("none" if kind != "dpo" else "base (adapter disabled)" if start == "fresh" else
                              f"{rel(ref_dir)} " + {"init": "(TRL's 'ref' copy)",
                                                    "ref": "(loaded into TRL's 'ref' adapter)",
                                                    "ref_other": "(replaces TRL's 'ref' adapter, with its own "
                                                                 "LoraConfig)"}[start]),
                "optim": OPTS[opt]["optim"], "learning_rate": LR[opt], "weight_decay": 0.0,
                "max_grad_norm": 0.0, "lr_scheduler_type": "constant", "batch_pairs": 4}
    if kind == "cpo":
        if method_kw["loss_type"] == "simpo":
            settings["simpo_gamma"] = 0.5  # read by CPOTrainer only for loss_type "simpo"
        settings.update(cpo_alpha=method_kw.get("cpo_alpha", 1.0),
                        label_smoothing=method_kw.get("label_smoothing", 0.0))
    if variant is not None:
        settings.update(MORE_SETTINGS[variant](kind))
    if start == "ref_other":
        settings.update(policy_lora=POLICY_LORA, reference_lora=REF_OTHER_LORA)
    metrics = {k: v for k, v in logs.items() if k not in ("loss", "epoch", "step")}
    entry = {"settings": settings, "loss": loss, "logged_loss": logs.get("loss"), "metrics": metrics,
             "pairs_f64": pairs}
    return name, entry, {f"{name}.{k}": v for k, v in after.items()}, diffs


@step("cases")
def cases():
    import peft, trl, transformers
    expected, tensors = {}, {}
    worst = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0}
    for method, start, opt in CASES:
        name, entry, after, diffs = run_case(method, start, opt)
        worst = {k: max(worst[k], diffs[k]) for k in worst}
        expected[name] = entry
        tensors.update(after)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1,
        "f64_check_max_abs_diff": worst,
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected.safetensors"))
    print("f64 check, worst over all cases:", worst)
    assert worst["loss"] < 1e-5 and worst["metrics"] < 1e-5 and worst["adapter"] < 1e-5, worst


# ---------------------------------------------------------------------------
# --more: NF4 and conversational cases, in expected_more.json and
# expected_more.safetensors (same layout as expected.json/.safetensors).

NF4_SETTINGS = {
    "base": "tests/fixtures/qlora/llama (hidden 128, intermediate 128, vocab 128, 2 layers), loaded in NF4 by "
            "transformers + bitsandbytes",
    "quantization": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "float32",
                     "bnb_4bit_use_double_quant": False, "blocksize": 64,
                     "quantized": "the 14 layer projections (q,k,v,o,gate,up,down of both layers); "
                                  "embeddings, norms and lm_head stay f32",
                     "blocks": "over the row-major flattened weight; every in_features is 128, so each row "
                               "holds two whole blocks (hlo-train's NF4 layout)"},
    "data": "data.jsonl (TRL's tokenization) and data_ids.jsonl (verbatim): the same",
    "lora_dtype": "float32",
}


def _nf4_settings(kind):
    out = dict(NF4_SETTINGS)
    if kind == "dpo":
        out["lora_note"] = ("TRL 1.16's DPOTrainer casts the trainable LoRA tensors to bf16 on a quantized base "
                            "(FORMULAS.md section 9); here that cast is undone: the adapter's f32 values are put "
                            "back after the trainer is built, before train() builds the optimizer (f32 LoRA, "
                            "f32 gradients and step); everything else as TRL runs it")
    else:
        out["lora_note"] = ("ORPOTrainer casts nothing (its cast needs bf16=True); with peft_config it would "
                            "also call prepare_model_for_kbit_training, not with a PeftModel")
    return out


MORE_SETTINGS = {
    "nf4": _nf4_settings,
    "chat": lambda kind: {"data": "data_chat.jsonl (TRL's chat template path) and data_chat_ids.jsonl "
                                  "(verbatim): the same",
                          "tokenizer": "chat_tokenizer"},
}
MORE_CASES = [
    ("dpo", "init", "sgd", "nf4"), ("dpo", "fresh", "sgd", "nf4"), ("dpo", "init", "adamw", "nf4"),
    ("orpo", "init", "sgd", "nf4"), ("ipo", "init", "sgd", "nf4"),
    ("dpo", "init", "sgd", "chat"), ("dpo", "fresh", "sgd", "chat"), ("orpo", "init", "sgd", "chat"),
]


@step("more_cases")
def more_cases():
    import bitsandbytes, peft, trl, transformers
    expected, tensors = {}, {}
    worst = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0, "grad_norm": 0.0}
    for method, start, opt, variant in MORE_CASES:
        name, entry, after, diffs = run_case(method, start, opt, variant)
        worst = {k: max(worst[k], diffs[k]) for k in worst}
        expected[name] = entry
        tensors.update(after)
    with open(os.path.join(NF4_MODEL_DIR, "config.json")) as f:
        nf4_config_json = json.load(f)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "bitsandbytes": bitsandbytes.__version__},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1,
        "chat_special_token_ids": {s: 96 + k for k, s in enumerate(CHAT_SPECIAL)},
        "nf4": {"cases": sorted(n for n in expected if n.endswith(".nf4")),
                "base": os.path.relpath(NF4_MODEL_DIR, ROOT),
                "base_config": {k: nf4_config_json[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                                                "num_hidden_layers", "num_attention_heads",
                                                                "num_key_value_heads", "head_dim")},
                "adapters": {"fresh": rel(adapter_dir("fresh", nf4=True)),
                             "init": rel(adapter_dir("init", nf4=True))},
                "lora_dtype": "float32 (DPOTrainer's bf16 cast on a quantized base undone)"},
        "chat_base": os.path.relpath(MODEL_DIR, ROOT),
        "f64_check_max_abs_diff": worst,
    }
    with open(os.path.join(OUT, "expected_more.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected_more.safetensors"))
    print("f64 check, worst over all cases:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst


# ---------------------------------------------------------------------------
# --two-adapters: the reference adapter with its own LoraConfig, in
# expected_two.json and expected_two.safetensors (same layout as expected.*).

TWO_CASES = [("dpo", "ref_other", "sgd"), ("dpo", "ref_other", "adamw"), ("ipo", "ref_other", "sgd")]


@step("two_cases")
def two_cases():
    import peft, trl, transformers
    expected, tensors = {}, {}
    worst = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0, "grad_norm": 0.0}
    for method, start, opt in TWO_CASES:
        name, entry, after, diffs = run_case(method, start, opt)
        worst = {k: max(worst[k], diffs[k]) for k in worst}
        expected[name] = entry
        tensors.update(after)
    checks = {name: {form: {k: v for k, v in c.items() if not k.endswith("_sums")} for form, c in forms.items()}
              for name, forms in REF_CHECKS.items()}
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "policy_lora": POLICY_LORA,
        "reference_lora": REF_OTHER_LORA,
        "reference_adapter": rel(adapter_dir("ref_other")),
        "reference_install": "after DPOTrainer is built: delete_adapter('ref'), then load_adapter("
                             "adapters/ref_other, adapter_name='ref', is_trainable=False); TRL's "
                             "use_adapter(model, 'ref') runs the reference forward",
        "reference_forward_max_abs_diff": checks,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1,
        "f64_check_max_abs_diff": worst,
    }
    with open(os.path.join(OUT, "expected_two.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(OUT, "expected_two.safetensors"))
    for name, forms in REF_CHECKS.items():
        c = forms["ids"]
        print(f"{name:26s} reference forward: max|d| vs ref_other alone {c['ref_vs_ref_other_alone']:.1e}, "
              f"vs base {c['ref_vs_base']:.3f}, vs policy {c['ref_vs_policy']:.3f}")
    print("f64 check, worst over all cases:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst


# ---------------------------------------------------------------------------
# --cpo: CPOTrainer loss_type "sigmoid", in cpo/expected.json and
# cpo/expected.safetensors (same layout as expected.*), cpo/FORMULAS.md.

@step("cpo_cases")
def cpo_cases():
    import peft, trl, transformers
    os.makedirs(CPO_OUT, exist_ok=True)
    with open(os.path.join(CPO_OUT, "FORMULAS.md"), "w") as f:
        f.write(CPO_FORMULAS)
    expected, tensors = {}, {}
    worst = {"loss": 0.0, "metrics": 0.0, "adapter": 0.0, "grad_norm": 0.0}
    for method, start, opt in CPO_CASES:
        name, entry, after, diffs = run_case(method, start, opt)
        worst = {k: max(worst[k], diffs[k]) for k in worst}
        values = [entry["loss"], entry["logged_loss"], *entry["metrics"].values()]
        values += [x for v in entry["pairs_f64"].values() for x in v]
        assert all(torch.isfinite(torch.tensor(v, dtype=torch.float64)) for v in values), name
        assert all(torch.isfinite(t).all() for t in after.values()), name
        expected[name] = entry
        tensors.update(after)
    expected["_meta"] = {
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "dropout": 0.0},
        "data": "data.jsonl (TRL's tokenization) and data_ids.jsonl (verbatim): the same",
        "adapters": {"fresh": rel(adapter_dir("fresh")), "init": rel(adapter_dir("init"))},
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 1,
        "f64_check_max_abs_diff": worst,
    }
    with open(os.path.join(CPO_OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(contiguous(tensors), os.path.join(CPO_OUT, "expected.safetensors"))
    print("f64 check, worst over all cases:", worst)
    assert all(v < 1e-5 for v in worst.values()), worst


if __name__ == "__main__":
    import accelerate, datasets, peft, safetensors, tokenizers, transformers, trl
    print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "peft",
          peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__, "tokenizers",
          tokenizers.__version__, "safetensors", safetensors.__version__)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--more"]:
        import bitsandbytes
        print("bitsandbytes", bitsandbytes.__version__)
        write_chat_inputs()
        write_chat_ids()
        write_nf4_inputs()
        more_cases()
    elif sys.argv[1:] == ["--two-adapters"]:
        write_two_inputs()
        two_cases()
    elif sys.argv[1:] == ["--cpo"]:
        cpo_cases()
    elif sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [--more | --two-adapters | --cpo]")
    else:
        write_inputs()
        write_ids()
        cases()
    finish()
