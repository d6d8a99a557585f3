"""Peer benchmark: one LoRA finetuning train step of a Llama model in JAX.

Measures the same step hlo-train times: forward of HF's LlamaForCausalLM with
PEFT-style LoRA on q/k/v/o/gate/up/down, masked mean next-token cross-entropy,
backward w.r.t. the LoRA parameters only, global-norm clipping to 1.0 and a
hand-written AdamW update (PyTorch semantics). The whole step is one `jax.jit`
function (LoRA params and optimizer state donated). Reported: compile time of
`lower(...).compile()`, median wall time of the timed steps (after untimed
warm-up steps) and tokens/s = batch*seq/median.

Runs on the CPU backend (JAX_PLATFORMS defaults to "cpu"):
    python3 bench/jax_lora_step.py --model tiny --batch 16 --seq 16
    python3 bench/jax_lora_step.py --config bench/configs/small.json \
        --batch 4 --seq 256 --steps 5 --dtype f32 --json
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

F32 = jnp.float32
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Config:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    tied: bool = False

    @staticmethod
    def from_hf(path):
        with open(path) as f:
            c = json.load(f)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            print(f"warning: rope scaling {rope} ignored (default rope used)", file=sys.stderr)
        return Config(
            vocab=c["vocab_size"], hidden=c["hidden_size"], inter=c["intermediate_size"],
            layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            eps=c["rms_norm_eps"], rope_theta=c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            tied=c.get("tie_word_embeddings", False))


TINY = Config(vocab=264, hidden=64, inter=128, layers=2, heads=4, kv_heads=2,
              head_dim=16, eps=1e-5, rope_theta=10000.0)


def linear_shapes(cfg):
    """(out, in) of every LoRA-targeted projection, as stored by HF ([out, in])."""
    h, d = cfg.hidden, cfg.head_dim
    return {"q": (cfg.heads * d, h), "k": (cfg.kv_heads * d, h), "v": (cfg.kv_heads * d, h),
            "o": (h, cfg.heads * d), "gate": (cfg.inter, h), "up": (cfg.inter, h),
            "down": (h, cfg.inter)}


def init_base(cfg, key, dtype):
    """Random base weights: normal * 0.02, norm weights ones."""
    keys = iter(jax.random.split(key, 2 + cfg.layers * len(LORA_TARGETS)))
    normal = lambda shape: (0.02 * jax.random.normal(next(keys), shape, F32)).astype(dtype)
    params = {"embed": normal((cfg.vocab, cfg.hidden)), "layers": [],
              "norm": jnp.ones((cfg.hidden,), dtype)}
    for _ in range(cfg.layers):
        layer = {name: normal(shape) for name, shape in linear_shapes(cfg).items()}
        layer["input_norm"] = jnp.ones((cfg.hidden,), dtype)
        layer["post_norm"] = jnp.ones((cfg.hidden,), dtype)
        params["layers"].append(layer)
    if not cfg.tied:
        params["lm_head"] = normal((cfg.vocab, cfg.hidden))
    return params


def init_lora(cfg, key, rank):
    """PEFT init: A ~ U(-1/sqrt(in), 1/sqrt(in)) [r, in], B = 0 [out, r]; all f32."""
    keys = iter(jax.random.split(key, cfg.layers * len(LORA_TARGETS)))
    lora = []
    for _ in range(cfg.layers):
        layer = {}
        for name, (n_out, n_in) in linear_shapes(cfg).items():
            bound = 1.0 / math.sqrt(n_in)
            a = jax.random.uniform(next(keys), (rank, n_in), F32, -bound, bound)
            layer[name] = {"A": a, "B": jnp.zeros((n_out, rank), F32)}
        lora.append(layer)
    return lora


def matmul_t(x, w):
    """x @ w.T with f32 accumulation."""
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=F32)


def linear(x, w, lora, scale):
    y = matmul_t(x, w)
    if lora is not None:
        y = y + scale * matmul_t(matmul_t(x.astype(F32), lora["A"]), lora["B"])
    return y.astype(x.dtype)


def rms_norm(x, w, eps):
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope(cfg, seq, dtype):
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=F32) / cfg.head_dim))
    freqs = jnp.arange(seq, dtype=F32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [S, D], HF rotate-half layout
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):  # x [B, S, H, D]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(cfg, x, p, lora, scale, cos, sin):
    b, s, _ = x.shape
    rep, d = cfg.heads // cfg.kv_heads, cfg.head_dim
    proj = lambda h, n: linear(h, p[n], lora and lora[n], scale)
    q = proj(x, "q").reshape(b, s, cfg.heads, d)
    k = proj(x, "k").reshape(b, s, cfg.kv_heads, d)
    v = proj(x, "v").reshape(b, s, cfg.kv_heads, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Grouped-query attention: query head g*rep + r uses kv head g (HF repeat_kv).
    q = q.reshape(b, s, cfg.kv_heads, rep, d)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k, preferred_element_type=F32) * d ** -0.5
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v, preferred_element_type=F32)
    out = out.astype(x.dtype).reshape(b, s, cfg.heads * d)
    return proj(out, "o")


def mlp(x, p, lora, scale):
    proj = lambda h, n: linear(h, p[n], lora and lora[n], scale)
    return proj(jax.nn.silu(proj(x, "gate")) * proj(x, "up"), "down")


def forward(cfg, base, lora, input_ids, scale):
    """Logits [B, S, V] in f32. `lora=None` gives the base model."""
    x = base["embed"][input_ids]
    cos, sin = rope(cfg, input_ids.shape[1], x.dtype)
    for i, p in enumerate(base["layers"]):
        lp = lora and lora[i]
        x = x + attention(cfg, rms_norm(x, p["input_norm"], cfg.eps), p, lp, scale, cos, sin)
        x = x + mlp(rms_norm(x, p["post_norm"], cfg.eps), p, lp, scale)
    x = rms_norm(x, base["norm"], cfg.eps)
    return matmul_t(x, base["embed"] if cfg.tied else base["lm_head"])


def loss_fn(cfg, base, lora, input_ids, loss_mask, scale):
    """Masked mean cross-entropy of logits[:, :-1] against input_ids[:, 1:]."""
    logits = forward(cfg, base, lora, input_ids, scale)[:, :-1]
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    mask = loss_mask[:, 1:].astype(F32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(cfg, scale, lr=2e-4, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, max_norm=1.0):
    """(base, lora, opt_state, step, ids, mask) -> (lora, opt_state, loss, grad_norm).

    `step` is the number of updates already applied (0 for the first step).
    """
    def train_step(base, lora, opt_state, step, input_ids, loss_mask):
        loss, grads = jax.value_and_grad(
            lambda l: loss_fn(cfg, base, l, input_ids, loss_mask, scale))(lora)
        leaves = jax.tree_util.tree_leaves(grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))
        clip = jnp.minimum(1.0, max_norm / (grad_norm + 1e-6))  # torch clip_grad_norm_
        t = (step + 1).astype(F32)
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t

        def adamw(p, g, m, v):
            g = g * clip
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            p = p * (1.0 - lr * wd)
            p = p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps)
            return p, m, v

        out = jax.tree_util.tree_map(adamw, lora, grads, opt_state["m"], opt_state["v"])
        is_triple = lambda x: isinstance(x, tuple)
        pick = lambda i: jax.tree_util.tree_map(lambda x: x[i], out, is_leaf=is_triple)
        return pick(0), {"m": pick(1), "v": pick(2)}, loss, grad_norm

    return jax.jit(train_step, donate_argnums=(1, 2))


def count(tree):
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="HF config.json of a Llama model")
    src.add_argument("--model", choices=["tiny"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--emit-stablehlo", metavar="FILE",
                    help="also write the step's StableHLO, as JAX lowers it, to FILE")
    args = ap.parse_args()

    cfg = Config.from_hf(args.config) if args.config else TINY
    dtype = {"f32": F32, "bf16": jnp.bfloat16}[args.dtype]
    scale = args.lora_alpha / args.lora_rank
    k_base, k_lora, k_ids = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    base = init_base(cfg, k_base, dtype)
    lora = init_lora(cfg, k_lora, args.lora_rank)
    opt_state = {"m": jax.tree_util.tree_map(jnp.zeros_like, lora),
                 "v": jax.tree_util.tree_map(jnp.zeros_like, lora)}
    input_ids = jax.random.randint(k_ids, (args.batch, args.seq), 0, cfg.vocab, jnp.int32)
    loss_mask = jnp.ones((args.batch, args.seq), F32)
    jax.block_until_ready((base, lora, opt_state, input_ids))

    step_fn = make_train_step(cfg, scale)
    t0 = time.perf_counter()
    lowered = step_fn.lower(base, lora, opt_state, jnp.int32(0), input_ids, loss_mask)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    if args.emit_stablehlo:
        with open(args.emit_stablehlo, "w") as f:
            f.write(lowered.as_text())

    times, losses = [], []
    for i in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        lora, opt_state, loss, grad_norm = compiled(
            base, lora, opt_state, jnp.int32(i), input_ids, loss_mask)
        loss.block_until_ready()
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= args.warmup_steps:
            times.append(dt)
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"non-finite loss: {losses}")
    if abs(losses[0] - math.log(cfg.vocab)) > 1.0:
        print(f"warning: first loss {losses[0]:.4f} far from ln(vocab)={math.log(cfg.vocab):.4f}",
              file=sys.stderr)

    step_s = statistics.median(times)
    res = {"tokens_per_s": args.batch * args.seq / step_s, "step_time_s": step_s,
           "compile_s": compile_s, "loss": losses[-1], "first_loss": losses[0],
           "grad_norm": float(grad_norm), "batch": args.batch, "seq": args.seq,
           "steps": args.steps, "dtype": args.dtype, "params": count(base),
           "lora_params": count(lora), "jax_version": jax.__version__,
           "backend": jax.default_backend()}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"jax {res['jax_version']} {res['backend']} {args.dtype} params={res['params']:,} "
              f"lora={res['lora_params']:,} batch={args.batch} seq={args.seq}: "
              f"{res['tokens_per_s']:.1f} tokens/s, step {step_s * 1e3:.2f} ms (median of "
              f"{args.steps}), compile {compile_s:.2f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
