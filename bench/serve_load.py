#!/usr/bin/env python3
"""Load generator for `hlo-train serve`, with the official `openai` client.

Subcommands:

  make-adapters  write N random PEFT adapters (rank, targets) for a config.json
  register       load N adapters of a folder into a running server
  run            streamed greedy completions at each concurrency level:
                 requests/s, output tokens/s, time to first token and
                 inter-token latency (p50/p99), checked against the server's
                 own /metrics
  soak           many requests at one concurrency: errors, and the server's
                 resident memory before, during and after
  arrivals       running streams while a burst of long prompts arrives: the
                 streams' inter-token latency (p50, p99, largest gap), with
                 and without the burst
  prefix         requests sharing a long prompt prefix (a system prompt):
                 time to first token, and the prompt tokens the server
                 computed and reused (/metrics)

Every request streams with `return_token_ids`, so each token is one chunk
and latencies are per token. `run --llama-server` targets llama.cpp's
`llama-server` instead (bench/llama_cpp.sh): it streams one chunk per token
without token ids, so each chunk counts one token (the final chunk's
`usage` gives the total); model `aN` becomes the request field
`"lora": [{"id": N, "scale": S}]` (adapter N of its `--lora` files, the
others 0), `base` every adapter at 0; the comparison with the server's
/metrics is skipped. `--models a,b,c` spreads requests uniformly
(round robin) over those models. Needs `openai` (pip install openai), e.g.
`PYTHONPATH=.plugins/python`, which scripts/serve_openai_check.py installs.

    python3 bench/serve_load.py run --url http://127.0.0.1:8000 \\
        --models base --concurrency 1,8,32,64 --requests 64
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import struct
import sys
import time
import urllib.request


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def metrics(url):
    with urllib.request.urlopen(url + "/metrics") as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# make-adapters ---------------------------------------------------------------

def projection_dims(config, short):
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[short]


def small_floats(n):
    """n random float32 of magnitude ~1e-3 with random signs, as bytes: the
    sign and mantissa bits random, the exponent fixed (fast, no numpy)."""
    raw = int.from_bytes(os.urandom(4 * n), "little")
    mask = int.from_bytes(struct.pack("<I", 0x807FFFFF) * n, "little")
    exp = int.from_bytes(struct.pack("<I", 0x3A800000) * n, "little")
    return ((raw & mask) | exp).to_bytes(4 * n, "little")


def make_adapters(args):
    config = json.load(open(args.config))
    targets = args.targets.split(",")
    for k in range(args.count):
        d = os.path.join(args.out, "a%04d" % k)
        os.makedirs(d, exist_ok=True)
        tensors, offset, blobs = {}, 0, []
        for layer in range(config["num_hidden_layers"]):
            for short in targets:
                group = "self_attn" if short in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                din, dout = projection_dims(config, short)
                prefix = "base_model.model.model.layers.%d.%s.%s" % (layer, group, short)
                for name, shape in [("lora_A", [args.rank, din]), ("lora_B", [dout, args.rank])]:
                    blob = small_floats(shape[0] * shape[1])
                    tensors["%s.%s.weight" % (prefix, name)] = {
                        "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
                    offset += len(blob)
                    blobs.append(blob)
        header = json.dumps(tensors).encode()
        header += b" " * (-len(header) % 8)
        with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for b in blobs:
                f.write(b)
        json.dump({"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank,
                   "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
                   "task_type": "CAUSAL_LM"}, open(os.path.join(d, "adapter_config.json"), "w"))
    print("wrote %d adapters to %s" % (args.count, args.out))


def register(args):
    names = sorted(os.listdir(args.dir))[: args.count]
    started = time.perf_counter()
    for n in names:
        req = urllib.request.Request(
            args.url + "/v1/load_lora_adapter",
            data=json.dumps({"lora_name": n, "lora_path": os.path.join(args.dir, n)}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req).read()
    took = time.perf_counter() - started
    print(json.dumps({"registered": len(names), "seconds": round(took, 2),
                      "ms_per_adapter": round(1000 * took / max(1, len(names)), 2)}))


# run / soak ------------------------------------------------------------------

def llama_lora(model, scale):
    """llama-server's per-request `lora` field for model `aN` (adapter N at
    scale, every other one 0) or `base` (all 0: adapter 0 named at scale 0,
    which sets every adapter the request leaves out to 0 as well)."""
    if model == "base":
        return [{"id": 0, "scale": 0.0}]
    digits = model.lstrip("a")
    if not model.startswith("a") or not digits.isdigit():
        raise SystemExit("--llama-server: model names are base or aN (adapter N), not %r" % model)
    return [{"id": int(digits), "scale": scale}]


async def one(client, model, prompt, max_tokens, rec, llama=None):
    """One streamed greedy completion. llama: None for hlo-train serve, else
    the lora scale for llama-server (see llama_lora)."""
    started = time.perf_counter()
    last, tokens = None, 0
    if llama is None:
        extra = {"ignore_eos": True, "return_token_ids": True}
    else:
        extra = {"ignore_eos": True, "lora": llama_lora(model, llama)}
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body=extra)
        usage = None
        async for chunk in stream:
            if llama is not None and getattr(chunk, "usage", None):
                usage = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            if llama is not None:
                # One chunk per generated token; the last one (finish_reason
                # set, empty text) carries only the usage.
                ids = [None] if c.finish_reason is None else None
            else:
                ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids")
            if not ids:
                continue
            now = time.perf_counter()
            if last is None:
                rec["ttft"].append(now - started)
            else:
                rec["itl"].append(now - last)
            last = now
            tokens += len(ids)
        if usage is not None and usage != tokens:
            rec["count_mismatches"] = rec.get("count_mismatches", 0) + 1
            tokens = usage
        rec["tokens"] += tokens
        rec["done"] += 1
    except Exception as e:  # counted, and the first few shown
        rec["errors"] += 1
        if rec["errors"] <= 3:
            print("error:", repr(e)[:200], file=sys.stderr)


async def level(args, client, models, concurrency, requests):
    rec = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(requests)]
    queue = list(range(requests))

    async def worker():
        while queue:
            k = queue.pop(0)
            await one(client, models[k % len(models)], prompts[k], args.max_tokens, rec,
                      getattr(args, "llama_lora_scale", None) if getattr(args, "llama_server", False) else None)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    out = {
        "concurrency": concurrency, "requests": requests, "models": len(models),
        "errors": rec["errors"], "wall_s": round(wall, 2),
        "requests_per_s": round(rec["done"] / wall, 3),
        "output_tokens_per_s": round(rec["tokens"] / wall, 1),
        "ttft_p50_ms": round(1000 * pct(rec["ttft"], 50), 1),
        "ttft_p99_ms": round(1000 * pct(rec["ttft"], 99), 1),
        "itl_p50_ms": round(1000 * pct(rec["itl"], 50), 1),
        "itl_p99_ms": round(1000 * pct(rec["itl"], 99), 1),
        "ttft_mean_ms": round(1000 * statistics.mean(rec["ttft"]), 1) if rec["ttft"] else None,
    }
    if "count_mismatches" in rec:  # llama-server: chunks counted against its usage
        out["chunk_count_mismatches"] = rec["count_mismatches"]
    return out


def client_for(args):
    import openai
    kw = {}
    if getattr(args, "llama_server", False):
        # llama-server closes the connection after each streamed response
        # without saying so (no `Connection: close`): a pooled connection
        # taken again fails now and then. A new connection per request.
        kw["default_headers"] = {"Connection": "close"}
    return openai.AsyncOpenAI(base_url=args.url + "/v1", api_key=args.api_key or "unused",
                              timeout=600, max_retries=0, **kw)


def run(args):
    models = args.models.split(",")
    client = client_for(args)

    async def main():
        # Warm-up: compiles every prefill bucket the run uses.
        await level(args, client, models, 1, 1)
        for c in [int(x) for x in args.concurrency.split(",")]:
            if args.llama_server:  # its /metrics (with --metrics) has other names
                r = await level(args, client, models, c, max(args.requests, 2 * c))
                r["server"] = "llama-server"
                print(json.dumps(r), flush=True)
                continue
            before = metrics(args.url)
            r = await level(args, client, models, c, max(args.requests, 2 * c))
            after = metrics(args.url)
            # The server's mean time to first token over the same requests.
            key = "hlo_train_time_to_first_token_seconds"
            n = after[key + "_count"] - before[key + "_count"]
            if n:
                r["server_ttft_mean_ms"] = round(
                    1000 * (after[key + "_sum"] - before[key + "_sum"]) / n, 1)
            hits = after["hlo_train_adapter_cache_hits_total"] - before["hlo_train_adapter_cache_hits_total"]
            misses = after["hlo_train_adapter_cache_misses_total"] - before["hlo_train_adapter_cache_misses_total"]
            if hits + misses:
                r["adapter_hit_rate"] = round(hits / (hits + misses), 3)
                r["adapter_loads"] = int(misses)
            print(json.dumps(r), flush=True)

    asyncio.run(main())


def soak(args):
    models = args.models.split(",")
    client = client_for(args)

    async def main():
        await level(args, client, models, 1, 1)
        rss = [rss_kb(args.pid)]
        done = 0
        total = {"errors": 0, "wall_s": 0.0}
        while done < args.requests:
            n = min(args.batch, args.requests - done)
            r = await level(args, client, models, args.concurrency, n)
            done += n
            total["errors"] += r["errors"]
            total["wall_s"] += r["wall_s"]
            rss.append(rss_kb(args.pid))
        print(json.dumps({"requests": done, "errors": total["errors"],
                          "wall_s": round(total["wall_s"], 1),
                          "rss_mb": [round(x / 1024, 1) for x in rss]}), flush=True)

    asyncio.run(main())


# arrivals / prefix ---------------------------------------------------------

async def stream_gaps(client, model, prompt, max_tokens, gaps, started):
    """A streamed greedy completion; appends (time, gap) per token after
    the first; sets started (an asyncio.Event) once it has its 8th."""
    last, n = None, 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        if not chunk.choices:
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append((now, now - last))
        last, n = now, n + 1
        if n == 8:
            started.set()


def arrivals(args):
    client = client_for(args)
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(3, args.vocab) for _ in range(n)]

    async def once(burst):
        gaps = []
        flags = [asyncio.Event() for _ in range(args.streams)]
        running = [asyncio.create_task(stream_gaps(client, args.model, ids(16), args.stream_tokens, gaps, f))
                   for f in flags]
        await asyncio.gather(*(f.wait() for f in flags))
        out = {}
        if burst:
            rec = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}
            t_burst = time.perf_counter()
            await asyncio.gather(*(one(client, args.model, ids(args.arrival_prompt), args.arrival_tokens, rec)
                                   for _ in range(args.arrivals)))
            t_done = time.perf_counter()
            out["burst_s"] = round(t_done - t_burst, 2)
            out["arrivals_ttft_p50_ms"] = round(1000 * pct(rec["ttft"], 50), 1)
            out["arrival_errors"] = rec["errors"]
        await asyncio.gather(*running)
        values = [g for _, g in gaps]
        out.update({"itl_p50_ms": round(1000 * pct(values, 50), 1),
                    "itl_p99_ms": round(1000 * pct(values, 99), 1),
                    "itl_max_ms": round(1000 * max(values), 1), "gaps": len(values)})
        if burst:
            during = [g for t, g in gaps if t_burst <= t <= t_done]
            out["itl_p50_during_burst_ms"] = round(1000 * pct(during, 50), 1)
            out["itl_max_during_burst_ms"] = round(1000 * max(during), 1) if during else None
        return out

    async def main():
        rec = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}
        await one(client, args.model, ids(args.arrival_prompt), 2, rec)  # compiles the buckets
        for _ in range(args.repeat):
            for burst in (False, True):
                before = metrics(args.url)
                r = await once(burst)
                after = metrics(args.url)
                r["burst"] = burst
                key = "hlo_train_prefill_chunks_total"  # absent before chunked prefill
                r["prefill_chunks"] = int(after.get(key, 0) - before.get(key, 0))
                print(json.dumps(r), flush=True)

    asyncio.run(main())


def prefix(args):
    client = client_for(args)
    rng = random.Random(1)
    shared = [rng.randrange(3, args.vocab) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(3, args.vocab) for _ in range(args.suffix_len)] for _ in range(args.suffixes)]

    async def main():
        # Warm-up with an unrelated prompt of the same length: compiles the
        # buckets, shares nothing.
        rec = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}
        warm = [rng.randrange(3, args.vocab) for _ in range(args.prefix_len + args.suffix_len)]
        await one(client, args.model, warm, 2, rec)
        before = metrics(args.url)
        rec = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": 0}
        queue = list(range(args.requests))

        async def worker():
            while queue:
                k = queue.pop(0)
                await one(client, args.model, shared + suffixes[k % len(suffixes)], args.max_tokens, rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        after = metrics(args.url)

        def delta(k):  # counters absent from older servers count 0
            return int(after.get(k, 0) - before.get(k, 0))

        print(json.dumps({
            "requests": args.requests, "concurrency": args.concurrency, "errors": rec["errors"],
            "wall_s": round(wall, 2),
            "ttft_p50_ms": round(1000 * pct(rec["ttft"], 50), 1),
            "ttft_p99_ms": round(1000 * pct(rec["ttft"], 99), 1),
            "prompt_tokens_computed": delta("hlo_train_prompt_tokens_computed_total"),
            "prompt_tokens_reused": delta("hlo_train_prompt_tokens_reused_total"),
        }), flush=True)

    asyncio.run(main())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-adapters")
    m.add_argument("--config", required=True)
    m.add_argument("--count", type=int, default=8)
    m.add_argument("--rank", type=int, default=8)
    m.add_argument("--targets", default="q_proj,v_proj")
    m.add_argument("--out", required=True)
    g = sub.add_parser("register")
    g.add_argument("--url", default="http://127.0.0.1:8000")
    g.add_argument("--dir", required=True)
    g.add_argument("--count", type=int, default=1000)
    for name in ("run", "soak"):
        r = sub.add_parser(name)
        r.add_argument("--url", default="http://127.0.0.1:8000")
        r.add_argument("--api-key")
        r.add_argument("--models", required=True, help="comma-separated; requests go round robin")
        r.add_argument("--prompt-len", type=int, default=32)
        r.add_argument("--max-tokens", type=int, default=32)
        r.add_argument("--vocab", type=int, default=32000)
        if name == "run":
            r.add_argument("--concurrency", default="1,8,32,64")
            r.add_argument("--requests", type=int, default=32)
            r.add_argument("--llama-server", "--llama-lora", action="store_true",
                           help="the target is llama.cpp's llama-server: model aN -> request field "
                                "lora=[{id: N, scale}], base -> every adapter 0; tokens counted one "
                                "per chunk; no /metrics comparison")
            r.add_argument("--llama-lora-scale", type=float, default=1.0,
                           help="with --llama-server: the scale of the request's adapter (1.0: the "
                                "adapter's own lora_alpha / r, as PEFT and hlo-train apply it)")
        else:
            r.add_argument("--concurrency", type=int, default=16)
            r.add_argument("--requests", type=int, default=2000)
            r.add_argument("--batch", type=int, default=250, help="requests between memory samples")
            r.add_argument("--pid", type=int, required=True, help="the server's process id")
    a = sub.add_parser("arrivals")
    a.add_argument("--url", default="http://127.0.0.1:8000")
    a.add_argument("--api-key")
    a.add_argument("--model", required=True)
    a.add_argument("--vocab", type=int, default=32000)
    a.add_argument("--streams", type=int, default=8)
    a.add_argument("--stream-tokens", type=int, default=256)
    a.add_argument("--arrivals", type=int, default=8)
    a.add_argument("--arrival-prompt", type=int, default=200)
    a.add_argument("--arrival-tokens", type=int, default=8)
    a.add_argument("--repeat", type=int, default=2, help="runs without and with the burst, interleaved")
    x = sub.add_parser("prefix")
    x.add_argument("--url", default="http://127.0.0.1:8000")
    x.add_argument("--api-key")
    x.add_argument("--model", required=True)
    x.add_argument("--vocab", type=int, default=32000)
    x.add_argument("--prefix-len", type=int, default=192)
    x.add_argument("--suffix-len", type=int, default=16)
    x.add_argument("--suffixes", type=int, default=8)
    x.add_argument("--requests", type=int, default=32)
    x.add_argument("--concurrency", type=int, default=8)
    x.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    {"make-adapters": make_adapters, "register": register, "run": run, "soak": soak,
     "arrivals": arrivals, "prefix": prefix}[args.cmd](args)


if __name__ == "__main__":
    main()
