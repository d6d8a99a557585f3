#!/usr/bin/env python3
"""Save, restore and export rates of a full-training state, and the host
memory a save adds (BENCHMARKS.md).

Runs `hlo-train train --full` for one step of MODEL with --out, sampling
the process's memory from /proc every 20 ms: RssAnon (its own memory; on
the CPU plugin the devices' buffers are host memory too) before the save
starts (`train_state.new/` appears) and at its peak during the save. The
save's own report (`saved step ...`) is checked against the window the
samples saw. Then resumes the run and stops it once it reports the
restore (`resumed step ...`), and exports the state to an HF folder.

    python3 scripts/bench_checkpoint.py --model mpt-scale-1b --dtype bf16
    python3 scripts/bench_checkpoint.py --batch 8 --train-args "--devices 8"
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time


def status(pid):
    """RssAnon and RssFile of process `pid`, in bytes (None once gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024
    return kb("RssAnon"), kb("RssFile")


def train_and_save(binary, args, out):
    """One step and a save; memory sampled around the save."""
    cmd = [binary, "train", "--full", "--steps", "1", "--out", out] + args
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fresh = os.path.join(out, "train_state.new")
    # `rise`: the most RssAnon grew during the save above its lowest point
    # before that moment (what the save itself allocated; the step's
    # memory the allocator hands back meanwhile is not counted against it).
    before, low, peak, rise, window = 0, float("inf"), 0, 0, []
    while p.poll() is None:
        s = status(p.pid)
        saving = os.path.isdir(fresh)
        if s is not None:
            if saving:
                low, peak = min(low, s[0]), max(peak, s[0])
                rise = max(rise, s[0] - low)
                window.append(time.monotonic())
            elif not window:
                before = s[0]
        time.sleep(0.02)
    text = p.stdout.read()
    if p.returncode != 0:
        sys.exit(f"train failed:\n{text}")
    saved = re.search(r"saved step \d+ to .*: train_state ([\d.]+) (MB|GB) in ([\d.]+) s \(([\d.]+) GB/s\), (.*) ([\d.]+) s", text)
    if not saved:
        sys.exit(f"no save line in:\n{text}")
    return text, saved, (before, low, peak, rise), window


def resume_until_restored(binary, out):
    """Resumes the run and stops it once the restore is reported."""
    started = time.monotonic()
    p = subprocess.Popen([binary, "train", "--resume", out, "--steps", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        m = re.search(r"resumed step \d+ from .*: train_state ([\d.]+) (MB|GB) read and placed in ([\d.]+) s \(([\d.]+) GB/s\)", line)
        if m:
            wall = time.monotonic() - started
            p.kill()
            p.wait()
            return m, wall
    p.wait()
    sys.exit("the resumed run never reported its restore")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="target/release/hlo-train")
    ap.add_argument("--model", default="mpt-scale-1b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seq", default="64")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--dir", default="/tmp/hlo-train-bench-checkpoint")
    ap.add_argument("--train-args", default="", help="more train flags, e.g. '--devices 8'")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    out = os.path.join(a.dir, "run")
    # Token ids below every preset's vocabulary: no tokenizer needed.
    data = os.path.join(a.dir, "ids.jsonl")
    with open(data, "w") as f:
        for r in range(16):
            f.write('{"input_ids": [%s]}\n' % ", ".join(str(3 + (r * 31 + t * 7) % 250) for t in range(int(a.seq))))
    args = ["--model", a.model, "--dtype", a.dtype, "--batch", a.batch, "--seq", a.seq, "--data", data] + a.train_args.split()
    text, saved, (before, low, peak, rise), window = train_and_save(a.binary, args, out)
    state = sum(os.path.getsize(os.path.join(out, "train_state", f))
                for f in os.listdir(os.path.join(out, "train_state")))
    print(saved.group(0))
    seen = window[-1] - window[0] if len(window) > 1 else 0.0
    print(f"  sampled: train_state.new/ seen for {seen:.2f} s (the save reports {saved.group(3)} s for the state, {saved.group(6)} s after it)")
    print(f"  train_state/ on disk: {state / 1e9:.2f} GB")
    print(f"  RssAnon before the save {before / 1e9:.2f} GB; during it between {low / 1e9:.2f} and {peak / 1e9:.2f} GB; most it rose above an earlier low during the save: {rise / 1e6:.0f} MB")
    restored, wall = resume_until_restored(a.binary, out)
    print(restored.group(0))
    print(f"  wall clock from start to that line: {wall:.2f} s")
    # The run's own HF weights make room on a small disk (export rewrites them).
    for f in os.listdir(out):
        if f.startswith("model") and f.endswith(".safetensors"):
            os.remove(os.path.join(out, f))
    hf = os.path.join(a.dir, "hf")
    t0 = time.monotonic()
    r = subprocess.run([a.binary, "export", out, "--out", hf], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    dt = time.monotonic() - t0
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf))
    print(r.stdout.strip())
    print(f"  export: {size / 1e9:.2f} GB in {dt:.2f} s wall ({size / 1e9 / dt:.2f} GB/s)")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
