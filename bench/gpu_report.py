"""bench/gpu.sh's bookkeeping (no torch needed): results as JSON lines,
one summary line each, the longest-sequence probe and the final table.

    python3 bench/gpu_report.py devices RESULTS DEVICES_JSON   # append; a line, then bytes_limit
    python3 bench/gpu_report.py hlo RESULTS BENCH_JSON [NOTE]  # append; print a line
    python3 bench/gpu_report.py peer RESULTS PEER_OUT [JOBS MODEL WHY]  # append its lines; print
    python3 bench/gpu_report.py longest CAPACITY MARGIN ROUND MAX PLAN...  # SEQ, then why
                                        # (PLAN: a `plan --json` file or SEQ:BYTES)
    python3 bench/gpu_report.py estimate RESULTS MODEL BATCH SEQ  # seconds of one hlo-train step
    python3 bench/gpu_report.py within RESULTS MODEL SECONDS ROUND MAX  # longest seq a step of SECONDS
    python3 bench/gpu_report.py table RESULTS                  # Markdown
    python3 bench/gpu_report.py record RESULTS KEY=VALUE...    # append a record (bench/gpu.sh's
                                                               # `longest` and `failed` rows)

MFU everywhere is hlo-train's own FLOPs count (`step_flops` of
models/src/train.rs, replicated in peft_lora_step.py and checked against
hlo-train's reported MFU in each `hlo` line) over PEAK_TFLOPS (default
989, H100/H200 dense bf16), so the columns compare like with like.
"""
import json
import os
import sys

from peft_lora_step import step_flops

PEAK = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12
NAMES = {"llama3.2-1b": "Llama 3.2 1B", "llama3.1-8b": "Llama 3.1 8B", "tiny": "tiny"}


def gib(b):
    return "—" if b is None else f"{b / 2**30:.1f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def append(results, record):
    with open(results, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(results):
    try:
        with open(results) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def devices(results, path):
    d = json.load(open(path))
    append(results, {"kind": "devices", **d})
    dev = d["devices"][0]
    limit = (dev.get("memory") or {}).get("bytes_limit")
    print(f"devices: {d['platform']} (PJRT API {d['api_version']}), {len(d['devices'])} x "
          f"{dev['kind']}, allocator limit {gib(limit)}")
    print(limit or 0)


def hlo(results, path, note=""):
    v = json.load(open(path))
    objective = v.get("objective", "sft")
    ours = step_flops(v["model"], v["batch"], v["seq"], objective="dpo" if objective == "dpo"
                      else "sft")
    theirs = v["mfu"] * v["step_time_s"] * v["peak_tflops"] * 1e12
    rec = {**v, "impl": "hlo-train", "mode": "auto", "lora_or_full": v.get("mode"),
           "row": f"{v['model']} {v['batch']}x{v['seq']}", "flops_per_step": ours,
           "mfu_hlo_train": v["mfu"],
           "mfu": ours / v["step_time_s"] / PEAK, "note": note}
    append(results, rec)
    att = v.get("attention")
    att = att.get("kind", "") + (f" {att['block']}" if att.get("block") else "") \
        if isinstance(att, dict) else str(att)
    same = "same FLOPs" if abs(theirs / ours - 1) < 1e-3 else f"its FLOPs {theirs:.3e} != {ours:.3e}"
    obj = "" if objective == "sft" else f" {objective}"
    print(f"hlo-train {v['model']}{obj} {v['batch']} x {v['seq']}: {v['step_time_s'] * 1e3:.1f} ms, "
          f"{v['tokens_per_s']:.0f} tok/s, MFU {rec['mfu'] * 100:.1f}% (its own "
          f"{v['mfu'] * 100:.1f}% at {v['peak_tflops']:.4g} TFLOP/s, {same}), compile "
          f"{v['compile_s']:.1f} s, peak {gib(v['peak_bytes'])}, attention {att}, "
          f"loss chunk {v.get('loss_chunk')}, scan {v.get('scan_layers')}"
          f"{', ' + note if note else ''}")


def peer(results, path, jobs="", model="", why="not run"):
    """The JSON lines of a peft_lora_step.py run; each of its `jobs`
    (MODE:BxS[:STEPS],...) without a line gets one saying `why` (the
    process timed out, failed, or was skipped)."""
    lines = []
    try:
        lines = [json.loads(line) for line in open(path) if line.startswith("{")]
    except FileNotFoundError:
        pass
    done = {(r["mode"], f"{r['batch']}x{r['seq']}") for r in lines}
    for job in filter(None, jobs.split(",")):
        mode, shape = job.split(":")[:2]
        if (mode, shape) not in done:
            b, s = shape.split("x")
            lines.append({"impl": "pytorch+peft", "mode": mode, "row": f"{model} {shape}",
                          "model": model, "batch": int(b), "seq": int(s), "error": why})
    for r in lines:
        r["mfu"] = r["flops_per_step"] / r["step_time_s"] / PEAK if "step_time_s" in r else None
        append(results, r)
        obj = "" if r.get("objective", "sft") == "sft" else f" {r['objective']}"
        head = f"PyTorch+PEFT {r['mode']} {r['model']}{obj} {r['batch']} x {r['seq']}"
        if "skipped" in r:
            print(f"{head}: skipped ({r['skipped']})")
        elif "error" in r:
            print(f"{head}: {r['error']}")
        else:
            comp = f", compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else ""
            gc = " (gradient checkpointing: out of memory without)" if r["oom_without_grad_ckpt"] \
                else " (gradient checkpointing)" if r["grad_ckpt"] else ""
            print(f"{head}{gc}: {r['step_time_s'] * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                  f"MFU {r['mfu'] * 100:.1f}%{comp}, peak {gib(r['peak_bytes'])} "
                  f"(torch {r['torch']}, transformers {r['transformers']}, peft {r['peft']})")


def longest(capacity, margin, step, most, plans):
    """The largest multiple of `step` up to `most` whose planned total
    fits margin x capacity, on the line through two plans' totals
    (blockwise attention and a chunked loss make the step's memory linear
    in the sequence). `plans`: `plan --json` files, or SEQ:BYTES points."""
    pts = []
    for p in plans:
        if ":" in p and not p.endswith(".json"):
            seq, total = p.split(":")
            pts.append((int(seq), int(total)))
        else:
            v = json.load(open(p))
            pts.append((v["seq"], v["per_device"]["total_bytes"]))
    (s0, b0), (s1, b1) = pts[0], pts[-1]
    slope = (b1 - b0) / (s1 - s0)
    room = float(capacity) * float(margin)
    seq = int((room - (b0 - slope * s0)) / slope) // int(step) * int(step)
    seq = max(0, min(seq, int(most)))
    print(seq)
    print(f"longest sequence by `plan` (the line through {s0} tokens: {b0 / 1e9:.4g} GB and {s1}: "
          f"{b1 / 1e9:.4g} GB, {slope / 1e3:.1f} kB a token) within {margin} x the allocator's "
          f"{float(capacity) / 1e9:.4g} GB: {seq} tokens (planned "
          f"{(b0 + slope * (seq - s0)) / 1e9:.4g} GB)")


def estimate(results, model, batch, seq):
    """Seconds of one step at (batch, seq): the lowest MFU hlo-train showed
    for this model (the longest rows are the slowest per FLOP)."""
    mfus = [r["mfu"] for r in read(results)
            if r.get("impl") == "hlo-train" and r.get("model") == model and r.get("mfu")]
    mfu = min(mfus) if mfus else 0.05
    print(f"{step_flops(model, int(batch), int(seq)) / (mfu * PEAK):.1f}")


def within(results, model, seconds, step, most):
    """The longest batch-1 sequence (a multiple of `step` up to `most`)
    whose step `estimate` takes at most `seconds` (0 if none)."""
    mfus = [r["mfu"] for r in read(results)
            if r.get("impl") == "hlo-train" and r.get("model") == model and r.get("mfu")]
    mfu = min(mfus) if mfus else 0.05
    best, seq = 0, int(step)
    while seq <= int(most) and step_flops(model, 1, seq) / (mfu * PEAK) <= float(seconds):
        best, seq = seq, seq + int(step)
    print(best)


def cell(r, compile_s=False):
    if r is None:
        return "not run"
    if "skipped" in r:
        return "skipped (budget)"
    if "error" in r:
        return r["error"]
    parts = [f"{r['step_time_s'] * 1e3:,.1f} ms", f"{r['tokens_per_s']:,.0f} tok/s",
             f"MFU {r['mfu'] * 100:.1f}%", gib(r.get("peak_bytes"))]
    if compile_s and r.get("compile_s") is not None:
        parts.append(f"compile {r['compile_s']:.1f} s")
    if r.get("grad_ckpt"):
        parts.append("grad ckpt" + (" (OOM without)" if r.get("oom_without_grad_ckpt") else ""))
    return ", ".join(parts)


def ratio(a, b):
    if a is None or b is None or "step_time_s" not in a or "step_time_s" not in b:
        return "—"
    return f"{b['step_time_s'] / a['step_time_s']:.2f}x"


def table(results):
    recs = [r for r in read(results) if r.get("objective", "sft") == "sft"]
    rows, longest_rows, failed = [], {}, {}
    for r in recs:
        if r.get("kind") == "longest":
            longest_rows[r["row"]] = r["how"]
        elif r.get("kind") == "failed":
            failed[(r["row"], r["impl"])] = r["why"]
        if "row" in r and r["row"] not in rows:
            rows.append(r["row"])
    device = next((r["device"] for r in recs if r.get("impl") == "hlo-train" and "device" in r),
                  next((r["device_name"] for r in recs if "device_name" in r), "?"))
    print(f"LoRA r=16 alpha 32 on q,k,v,o,gate,up,down, bf16 base, AdamW, random weights; "
          f"{device}; ms = median step; MFU = hlo-train's FLOPs count / {PEAK / 1e12:.0f} TFLOP/s "
          f"for every column; peak = device peak (hlo-train: PJRT's peak_bytes_in_use; "
          f"PyTorch: max_memory_allocated); ratio = PyTorch's step time / hlo-train's "
          f"(> 1: hlo-train faster)")
    print()
    print("| row | hlo-train (auto) | PyTorch+PEFT eager | PyTorch+PEFT torch.compile "
          "| hlo/eager | hlo/compiled |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        def pick(impl, mode):
            found = [r for r in recs if r.get("row") == row and r.get("impl") == impl
                     and r.get("mode") == mode]
            return found[-1] if found else None
        h, e, c = pick("hlo-train", "auto"), pick("pytorch+peft", "eager"), \
            pick("pytorch+peft", "compile")
        model, shape = row.split(" ", 1)
        b, s = shape.split("x")
        label = f"{NAMES.get(model, model)}, {b} × {int(s):,}"
        if row in longest_rows:
            label += f" (longest: {longest_rows[row]})"
        hcell = cell(h, compile_s=True) if h else failed.get((row, "hlo-train"), "not run")
        print(f"| {label} | {hcell} | {cell(e)} | {cell(c, compile_s=True)} | {ratio(h, e)} "
              f"| {ratio(h, c)} |")


def record(results, *pairs):
    append(results, dict(p.split("=", 1) for p in pairs))


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    {"record": record, "within": within, "devices": devices, "hlo": hlo, "peer": peer, "table": table, "estimate": estimate,
     "longest": lambda *a: longest(*a[:4], list(a[4:]))}[cmd](*args)


if __name__ == "__main__":
    main()
