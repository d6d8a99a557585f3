"""The longest sequence whose LoRA train step fits a device, by `plan`.

For each model and mesh, a binary search over --seq (multiples of 2,048,
up to the model's 131,072-token context) with `hlo-train plan --json`,
whose total per device is compared with 80 GB (H100) and 192 GB (MI300X).
LoRA rank 8 on all projections, bf16, AdamW, layers scanned, attention and
loss chunking on `auto`. One row per device (batch 1 on one device, batch 8
over fsdp=8). Prints a Markdown table; used for docs/planning.md's
planning section:

    python3 bench/longest_seq.py [path/to/hlo-train]
"""
import json
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/hlo-train"
STEP = 2048
MOST = 131072
CAPACITIES = {"80 GB": 80e9, "192 GB": 192e9}
RUNS = [
    ("llama3.1-8b", "dp=1,fsdp=1,mp=1", 1),
    ("llama3.1-8b", "dp=1,fsdp=8,mp=1", 8),
    ("llama3.1-70b", "dp=1,fsdp=1,mp=1", 1),
    ("llama3.1-70b", "dp=1,fsdp=8,mp=1", 8),
]

cache = {}


def total(model, mesh, batch, seq):
    key = (model, mesh, batch, seq)
    if key not in cache:
        # Exit 1: planned, and does not fit (the search for settings that
        # would is skipped).
        run = subprocess.run(
            [BIN, "plan", "--model", model, "--dtype", "bf16", "--batch", str(batch),
             "--seq", str(seq), "--mesh", mesh, "--json", "--no-suggestions"],
            capture_output=True, text=True)
        if run.returncode not in (0, 1):
            sys.exit(f"plan failed: {run.stderr}")
        out = run.stdout
        cache[key] = json.loads(out)["per_device"]["total_bytes"]
        print(f"  {model} {mesh} batch {batch} seq {seq}: {cache[key] / 1e9:.2f} GB",
              file=sys.stderr)
    return cache[key]


def longest(model, mesh, batch, capacity):
    """The largest multiple of STEP up to MOST that fits, or 0."""
    lo, hi = 0, MOST // STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(model, mesh, batch, mid * STEP) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


print("| model | mesh | " + " | ".join(f"longest seq in {c}" for c in CAPACITIES) + " |")
print("|---|---|" + "---|" * len(CAPACITIES))
for model, mesh, batch in RUNS:
    cells = []
    for capacity in CAPACITIES.values():
        s = longest(model, mesh, batch, capacity)
        if s == 0:
            cells.append("none (the weights alone do not fit)"
                         if total(model, mesh, batch, STEP) > capacity else "< 2,048")
        else:
            at = total(model, mesh, batch, s)
            more = " (the model's context)" if s == MOST else ""
            cells.append(f"{s:,}{more}: {at / 1e9:.1f} GB")
    print(f"| `{model}` | `{mesh}`, batch {batch} | " + " | ".join(cells) + " |")
