"""Peer benchmark: one LoRA finetuning step of PyTorch + PEFT, eager or
under `torch.compile`.

Llama 3.2 1B or Llama 3.1 8B shapes (or `tiny`, hlo-train's tiny preset,
for testing on the CPU), random bf16 base weights made from a config (no
download), SDPA attention, LoRA r=16 / alpha 32 on all seven projections
(q, k, v, o, gate, up, down) with f32 adapters, AdamW (PyTorch's
defaults, lr 2e-4), global-norm clipping at 1.0. Each mode runs WARMUP
untimed steps (the first of a compiled mode holds its compile), then
STEPS timed ones; it reports the median step, tokens/s, MFU and the peak
of `torch.cuda.max_memory_allocated` over its own steps (weights
included), as one JSON line on stdout (a readable line on stderr):

    python3 bench/peft_lora_step.py {tiny|1b|8b} BATCH SEQ [STEPS] [sft|dpo]
        [--compile | --modes eager,compile | --jobs MODE:BxS[:STEPS],...]
        [--steps N] [--objective sft|dpo] [--warmup N] [--device cpu]
        [--grad-ckpt auto|on|off] [--peak-tflops 989] [--tag ROW]

`--compile` times `torch.compile(peft_model)` (default mode) instead of
the eager model; `--modes eager,compile` times both in one process (one
model, one import), eager first; `--jobs` runs several shapes and modes
in one process, in the order given, one JSON line each (bench/gpu.sh's
way). Each compiled job starts from `torch._dynamo.reset()`, so it
compiles for its own static shapes as a fresh process would. `compile_s`
is the first warm-up step's time less the median step: dynamo's,
AOTAutograd's and Inductor's work. With `--deadline`, a job that would
not end by then (a guess: its steps at 25% MFU, plus `--compile-est` for
a compiled one) is skipped with a JSON line that says so.

`--grad-ckpt auto` (the default) runs a job without activation
checkpointing and, where a step runs out of memory, again with HF's
non-reentrant gradient checkpointing; later jobs of as many tokens or
more then checkpoint from the start. The JSON says which (`grad_ckpt`,
`oom_without_grad_ckpt`). The environment variable
PEFT_STEP_FAKE_OOM_TOKENS=N makes steps of N tokens or more "run out of
memory" without checkpointing, to test that path on the CPU.

FLOPs per step (for MFU) are hlo-train's own count
(`hlo_models::train::step_flops`, MaxText's convention), so the columns
of bench/gpu.sh compare like with like: per token, 2 per matmul weight
forward (the LM head included, the embedding lookup not), attention
`4 * seq * heads * head_dim` forward per layer (the whole `seq`, not
halved for causality); a LoRA step is twice the forward (the frozen
weights' gradients skipped) plus 6 per LoRA weight; DPO adds the
reference's forward.

With `dpo`, the step is DPO's as TRL computes it for a fresh adapter:
the BATCH rows are BATCH/2 pairs (chosen rows, then rejected), one policy
forward over all of them, one reference forward with the adapter disabled
and without gradients, summed log-probs of every token, the sigmoid loss
with beta 0.1.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

# The shapes of hlo-train's presets (models/src/decoder/presets.rs):
# vocab, hidden, intermediate, layers, heads, K/V heads, head_dim, tied
# embeddings, rope theta, llama3 rope factor (None: plain rope), context.
SHAPES = {
    "tiny": dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=False, rope_theta=10000.0, factor=None,
                 max_position_embeddings=512),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True, rope_theta=500000.0, factor=32.0,
               max_position_embeddings=131072),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False, rope_theta=500000.0, factor=8.0,
               max_position_embeddings=131072),
}
# hlo-train's preset names for the same shapes.
PRESETS = {"tiny": "tiny", "1b": "llama3.2-1b", "8b": "llama3.1-8b"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32


def size_of(model):
    """`1b`, `8b`, `tiny` for either spelling (this script's or hlo-train's)."""
    for k, v in PRESETS.items():
        if model in (k, v):
            return k
    raise SystemExit(f"unknown model {model!r}: one of {', '.join(PRESETS)}")


def step_flops(size, batch, seq, rank=RANK, objective="sft"):
    """FLOPs of one LoRA step as hlo-train counts them (see the docstring)."""
    c = SHAPES[size_of(size)]
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    # Matmul weights: the projections and the LM head (tied or not).
    matmul = layers * (2 * h * q + 2 * h * kv + 3 * h * i) + c["vocab_size"] * h
    attention = 4.0 * layers * seq * q
    forward = 2.0 * matmul + attention
    # LoRA: r * (in + out) per adapted projection.
    lora = layers * rank * ((h + q) * 2 + (h + kv) * 2 + 3 * (h + i))
    tokens = batch * seq
    train = (2.0 * forward + 6.0 * lora) * tokens
    return train + (forward * tokens if objective == "dpo" else 0.0)


def row_logps(logits, ids):
    """Each row's summed log-probability of its tokens after the first."""
    import torch
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.gather(logp, 2, ids[:, 1:, None]).squeeze(2).sum(1)


def dpo_loss(model, ids, beta=0.1, reference_model=None):
    """DPO's sigmoid loss over pairs (rows 0..P chosen, P..2P rejected)."""
    import torch
    pairs = ids.shape[0] // 2
    policy = row_logps(model(input_ids=ids).logits, ids)
    with torch.no_grad(), reference_model.disable_adapter():
        reference = row_logps(model(input_ids=ids).logits, ids)
    h = (policy[:pairs] - reference[:pairs]) - (policy[pairs:] - reference[pairs:])
    return -torch.nn.functional.logsigmoid(beta * h).mean()


def build(size, device):
    """The PEFT model (bf16 base, f32 adapters) and its trainable params."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[size])
    factor = shape.pop("factor")
    rope = None if factor is None else {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(rope_scaling=rope, attn_implementation="sdpa", **shape)
    if rope is not None:
        # transformers 5 reads the rope settings from rope_parameters.
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        if params.get("rope_type") != "llama3":
            cfg.rope_parameters = {**rope, "rope_theta": shape["rope_theta"]}
    # The weights made in bf16 on the device itself (no f32 copy first).
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            base = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(dtype)
    base.train()
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                            target_modules=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return model, params


def measure(model, peft_model, params, opt, ids, objective, warmup, steps, device):
    """Runs warmup + steps steps; returns their times and the last loss."""
    import torch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times, loss_value = [], float("nan")
    for _ in range(warmup + steps):
        sync()
        t = time.perf_counter()
        if objective == "dpo":
            loss = dpo_loss(model, ids, reference_model=peft_model)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
        loss_value = loss.item()
        del loss
    return times, loss_value


def is_oom(e):
    import torch
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free(device, params, opt):
    import torch
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def parse_jobs(spec, default_modes, batch, seq, steps):
    """`MODE:BxS[:STEPS],...` (or the positional shape under each default
    mode): (mode, batch, seq, timed steps) each."""
    if not spec:
        return [(m, batch, seq, steps) for m in default_modes]
    jobs = []
    for item in spec.split(","):
        mode, shape, *rest = item.strip().split(":")
        b, _, s = shape.partition("x")
        n = rest[0] if rest else str(steps)
        if mode not in ("eager", "compile") or not (b + s + n).isdigit() or len(rest) > 1:
            raise SystemExit(f"--jobs: MODE:BATCHxSEQ[:STEPS] with MODE eager or compile, "
                             f"not {item!r}")
        jobs.append((mode, int(b), int(s), int(n)))
    return jobs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", help="tiny, 1b or 8b (or llama3.2-1b, llama3.1-8b)")
    ap.add_argument("batch", type=int, nargs="?", help="rows (not needed with --jobs)")
    ap.add_argument("seq", type=int, nargs="?", help="tokens a row (not needed with --jobs)")
    ap.add_argument("steps_pos", metavar="steps", type=int, nargs="?", help="timed steps (default 10)")
    ap.add_argument("objective_pos", metavar="objective", nargs="?", choices=["sft", "dpo"])
    ap.add_argument("--compile", action="store_true", help="time torch.compile(peft_model)")
    ap.add_argument("--modes", help="comma-separated: eager, compile (default: eager, or compile)")
    ap.add_argument("--jobs", help="several shapes in one process, in order: "
                    "MODE:BATCHxSEQ[:STEPS],..., e.g. eager:4x1024,compile:4x1024,eager:1x16384:4")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (the positional STEPS)")
    ap.add_argument("--objective", choices=["sft", "dpo"], default=None,
                    help="sft (default) or dpo (the positional OBJECTIVE)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--grad-ckpt", default="auto", choices=["auto", "on", "off"],
                    help="auto: on for a job only once a job of as many tokens ran out of memory")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="peak for MFU (default 989: H100/H200 dense bf16)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="unix time: a job that would not end by then is skipped (a JSON line says so)")
    ap.add_argument("--compile-est", type=float, default=90.0,
                    help="seconds a compile is taken to need, for --deadline (default 90)")
    ap.add_argument("--tag", default=None, help="the JSON lines' `row` (default: MODEL BATCHxSEQ)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.steps = a.steps or a.steps_pos or 10
    a.objective = a.objective or a.objective_pos or "sft"
    size = size_of(a.size)
    modes = a.modes.split(",") if a.modes else ["compile" if a.compile else "eager"]
    if any(m not in ("eager", "compile") for m in modes):
        ap.error(f"--modes: eager and/or compile, not {a.modes}")
    if not a.jobs and (a.batch is None or a.seq is None):
        ap.error("BATCH and SEQ, or --jobs")
    jobs = parse_jobs(a.jobs, modes, a.batch, a.seq, a.steps)
    if a.objective == "dpo" and any(b % 2 for _, b, _, _ in jobs):
        ap.error("dpo: BATCH counts rows, chosen and rejected: it must be even")

    t0 = time.perf_counter()
    # transformers' deprecation notices (PEFT asks for is_gradient_checkpointing).
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import transformers
    import peft
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    torch.manual_seed(a.seed)
    peft_model, params = build(size, device)
    opt = torch.optim.AdamW(params, lr=2e-4)
    setup_s = time.perf_counter() - t0
    base = peft_model.get_base_model()
    # auto: the fewest tokens a step ran out of memory with, without
    # checkpointing (a job of as many tokens or more then checkpoints).
    oom_tokens = None
    ckpt_on = False

    for mode, b, s, steps in jobs:
        tokens = b * s
        flops = step_flops(size, b, s, RANK, a.objective)
        row = {
            "impl": "pytorch+peft", "mode": mode, "row": a.tag or f"{PRESETS[size]} {b}x{s}",
            "model": PRESETS[size], "batch": b, "seq": s, "objective": a.objective,
            "device": device, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "lora_rank": RANK, "lora_alpha": ALPHA,
            "warmup": a.warmup, "steps": steps, "setup_s": round(setup_s, 2),
            "flops_per_step": flops, "peak_tflops": a.peak_tflops,
        }
        if a.deadline is not None:
            # A guess: steps at 25% MFU on the GPU, plus a compile.
            guess = 5 + (a.warmup + steps) * flops / (0.25 * a.peak_tflops * 1e12)
            guess += a.compile_est if mode == "compile" else 0
            if time.time() + guess > a.deadline:
                row["skipped"] = f"budget: about {guess:.0f} s needed, " \
                    f"{max(0, a.deadline - time.time()):.0f} s left"
                print(json.dumps(row), flush=True)
                print(f"PyTorch+PEFT {mode} {b} x {s}: {row['skipped']}", file=sys.stderr, flush=True)
                continue
        ids = torch.randint(0, SHAPES[size]["vocab_size"], (b, s), device=device)
        ckpt = a.grad_ckpt == "on" or (a.grad_ckpt == "auto" and oom_tokens is not None
                                       and tokens >= oom_tokens)
        oom_without = False
        while True:
            if ckpt and not ckpt_on:
                base.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            elif ckpt_on and not ckpt:
                base.gradient_checkpointing_disable()
            ckpt_on = ckpt
            if mode == "compile":
                torch._dynamo.reset()
                model = torch.compile(peft_model)
            else:
                model = peft_model
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            error = None
            try:
                # A test hook: steps of this many tokens or more "run out of
                # memory" without checkpointing (bench/gpu.sh's DRY=1 run).
                fake = int(os.environ.get("PEFT_STEP_FAKE_OOM_TOKENS", "0"))
                if fake and tokens >= fake and not ckpt:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
                times, loss = measure(model, peft_model, params, opt, ids, a.objective,
                                      a.warmup, steps, device)
            except Exception as e:  # noqa: BLE001 (dynamo wraps errors: OOM is told by its text)
                if not is_oom(e):
                    raise
                error = "out of memory"
            if error is None:
                break
            # Outside the except block, so the traceback's frames (and the
            # activations they hold) are gone before the cache is emptied.
            model = None
            free(device, params, opt)
            if a.grad_ckpt == "auto" and not ckpt:
                oom_tokens = tokens if oom_tokens is None else min(oom_tokens, tokens)
                ckpt = oom_without = True
                continue
            break
        row["grad_ckpt"] = ckpt
        row["oom_without_grad_ckpt"] = oom_without
        if error is not None:
            row["error"] = error + (" (with gradient checkpointing too)" if ckpt else "")
            print(json.dumps(row), flush=True)
            print(f"PyTorch+PEFT {mode} {size} {a.objective} {b} x {s}: {row['error']}",
                  file=sys.stderr, flush=True)
            continue
        t = statistics.median(times[a.warmup:])
        row.update({
            "step_time_s": t,
            "step_times": [round(x, 6) for x in times[a.warmup:]],
            "warmup_times": [round(x, 3) for x in times[:a.warmup]],
            "tokens_per_s": tokens / t,
            "mfu": flops / t / (a.peak_tflops * 1e12),
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "compile_s": (times[0] - t) if mode == "compile" and a.warmup else None,
            "loss": loss,
        })
        print(json.dumps(row), flush=True)
        peak = f"{row['peak_bytes'] / 2**30:.1f} GiB" if cuda else "n/a on the CPU"
        comp = f", compile {row['compile_s']:.1f} s" if row["compile_s"] is not None else ""
        print(f"PyTorch+PEFT {mode} {size.upper()} LoRA {a.objective} batch {b} x seq {s}"
              f"{' (gradient checkpointing)' if ckpt else ''}: median step {t * 1e3:.1f} ms, "
              f"{row['tokens_per_s']:.0f} tokens/s, MFU {row['mfu'] * 100:.1f}%{comp}, "
              f"peak memory {peak}", file=sys.stderr, flush=True)
        model = ids = None
        free(device, params, opt)


if __name__ == "__main__":
    main()
