#!/usr/bin/env python3
"""`hlo-train train --tensorboard` read by the real `tensorboard` package.

Trains the tiny model for 30 steps on the demo data with evaluations, then
loads the event files with TensorBoard's own EventAccumulator and checks
them against the metrics file: every tag is there, each train and eval
value at each step is the metrics file's value as a 32-bit float, and the
step sets are equal. It also parses `loss.svg` as XML and finds the train
curve in it. A second run into the same `--tensorboard` folder must be a
second run for TensorBoard's EventMultiplexer, not more values of the
first. Installs `tensorboard` (without its server's dependencies)
into .plugins/python when it is missing.

    python3 scripts/tensorboard_check.py target/debug/hlo-train
    python3 scripts/tensorboard_check.py --check METRICS.jsonl TB_DIR LOSS.svg
"""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from site_packages import import_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What reading event files needs: the package without its web server's
# dependencies (grpcio, werkzeug, markdown, pillow, the data server).
# Pinned together because --no-deps skips tensorboard's own constraints.
PACKAGES = ["tensorboard==2.21.0", "protobuf>=6.31.1,<8", "numpy", "absl-py"]

# TensorBoard tag <- metrics field.
TRAIN_TAGS = [
    ("train/loss", "loss"),
    ("train/lr", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("train/tokens_per_s", "tokens_per_s"),
    ("train/mfu", "mfu"),
]
EVAL_TAGS = [("eval/loss", "eval_loss"), ("eval/perplexity", "eval_perplexity")]
# Null when the device's peak is unknown: may be absent, or absent at steps.
OPTIONAL = {"train/mfu"}
SVG = "{http://www.w3.org/2000/svg}"


def import_event_accumulator():
    return import_installed(
        "tensorboard.backend.event_processing.event_accumulator",
        PACKAGES,
        deps=False,
        purge=("google", "numpy", "absl"),
    )


class CheckError(Exception):
    pass


def f32(x):
    """`x` rounded to a 32-bit float, as `simple_value` holds it."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def read_metrics(path):
    """(train, eval): metrics field -> {step: value}, later lines winning
    (a resumed run appends to the file)."""
    train = {field: {} for _, field in TRAIN_TAGS}
    evals = {field: {} for _, field in EVAL_TAGS}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj, dict) or "step" not in obj:
                continue
            for kind, fields in (("loss", train), ("eval_loss", evals)):
                if kind in obj:
                    for field in fields:
                        if field in obj:
                            fields[field][obj["step"]] = obj[field]
    return train, evals


def same(got, want):
    """Whether a TensorBoard value is the metrics value as a float32; JSON
    writes a non-finite number as null."""
    if want is None:
        return not math.isfinite(got)
    want = f32(float(want))
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return got == want or abs(got - want) <= 1e-6 * abs(want)


def check(metrics_path, tb_dir, svg_path):
    """Checks the event files in `tb_dir` and the chart `svg_path` against
    `metrics_path`; returns a one-line summary or raises CheckError."""
    ea = import_event_accumulator()
    acc = ea.EventAccumulator(tb_dir, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    train, evals = read_metrics(metrics_path)
    if not train["loss"]:
        raise CheckError("%s has no train loss lines" % metrics_path)
    problems = []
    checked = 0
    for tag, field in TRAIN_TAGS + EVAL_TAGS:
        want = (train if tag.startswith("train/") else evals)[field]
        if tag in OPTIONAL:
            want = {s: v for s, v in want.items() if v is not None}
            if not want:
                continue
        if tag not in tags:
            problems.append("tag %s is missing (tags: %s)" % (tag, ", ".join(sorted(tags))))
            continue
        got = {}
        for e in acc.Scalars(tag):
            got[e.step] = e.value
        if tag in OPTIONAL:
            lost = sorted(set(want) - set(got))
            if lost:
                problems.append("%s: no value at steps %s" % (tag, lost[:10]))
        elif set(got) != set(want):
            problems.append(
                "%s: steps differ: only in tensorboard %s, only in metrics %s"
                % (tag, sorted(set(got) - set(want))[:10], sorted(set(want) - set(got))[:10])
            )
        for step in sorted(set(got) & set(want)):
            checked += 1
            if not same(got[step], want[step]):
                problems.append("%s step %d: tensorboard %r, metrics %s %r (float32 %r)"
                                % (tag, step, got[step], field, want[step],
                                   None if want[step] is None else f32(float(want[step]))))
    if not evals["eval_loss"]:
        problems.append("%s has no eval_loss lines" % metrics_path)

    # The chart: well-formed XML with one train point per logged step.
    try:
        root = ET.parse(svg_path).getroot()
    except (OSError, ET.ParseError) as e:
        raise CheckError("%s: %s" % (svg_path, e))
    lines = {p.get("class"): p.get("points", "").split() for p in root.iter(SVG + "polyline")}
    finite = lambda d: sum(1 for v in d.values() if v is not None)  # noqa: E731
    for cls, want in (("train", finite(train["loss"])), ("eval", finite(evals["eval_loss"]))):
        if want and len(lines.get(cls, [])) != want:
            problems.append("%s: the %s polyline has %d points, the metrics %d"
                            % (svg_path, cls, len(lines.get(cls, [])), want))
    if problems:
        more = "" if len(problems) <= 20 else "\n  ... %d more" % (len(problems) - 20)
        raise CheckError("\n  ".join([""] + problems[:20]) + more)
    return ("tensorboard: %d tags, %d values at %d train and %d eval steps equal the metrics; "
            "loss.svg: %d train and %d eval points: ok"
            % (len(tags), checked, len(train["loss"]), len(evals["eval_loss"]),
               len(lines.get("train", [])), len(lines.get("eval", []))))


def two_runs(tb_dir):
    """The runs TensorBoard's EventMultiplexer finds under `tb_dir`: two,
    each with its own steps."""
    from tensorboard.backend.event_processing import event_multiplexer as em
    mux = em.EventMultiplexer()
    mux.AddRunsFromDirectory(tb_dir)
    mux.Reload()
    runs = sorted(mux.Runs())
    if runs != ["run", "second"]:
        raise CheckError("runs under %s: %r, expected ['run', 'second']" % (tb_dir, runs))
    steps = {r: [e.step for e in mux.Scalars(r, "train/loss")] for r in runs}
    if steps["run"] != list(range(1, 31)) or steps["second"] != list(range(1, 11)):
        raise CheckError("train/loss steps per run: %r" % steps)
    return "tensorboard: two runs in one folder are two runs (30 and 10 steps): ok"


def run_training(binary, tmp, name="run", steps="30"):
    cmd = [
        binary, "train", "--steps", steps, "--batch", "4", "--seq", "16", "--lr", "2e-3",
        "--log-every", "10", "--eval-every", "10",
        "--metrics", os.path.join(tmp, name + ".jsonl"),
        "--tensorboard", os.path.join(tmp, "tb"),
        "--out", os.path.join(tmp, name),
    ]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise CheckError("%s exited with %d:\n%s" % (" ".join(cmd), p.returncode, p.stdout[-4000:]))


def main():
    args = sys.argv[1:]
    try:
        if args[:1] == ["--check"]:
            if len(args) != 4:
                raise SystemExit("usage: tensorboard_check.py --check METRICS.jsonl TB_DIR LOSS.svg")
            print(check(*args[1:]))
            return
        binary = args[0] if args else os.path.join(ROOT, "target", "debug", "hlo-train")
        # Install before training so a failed install does not waste a run.
        import_event_accumulator()
        tmp = tempfile.mkdtemp(prefix="hlo-tb-check-")
        try:
            run_training(binary, tmp)
            # Each run writes into a folder of its own, named as its --out.
            print(check(os.path.join(tmp, "run.jsonl"), os.path.join(tmp, "tb", "run"),
                        os.path.join(tmp, "run", "loss.svg")))
            run_training(binary, tmp, name="second", steps="10")
            print(two_runs(os.path.join(tmp, "tb")))
        except CheckError:
            print("the run's files are kept in %s" % tmp, file=sys.stderr)
            raise
        shutil.rmtree(tmp)
    except CheckError as e:
        sys.exit("tensorboard check failed: %s" % e)


if __name__ == "__main__":
    main()
