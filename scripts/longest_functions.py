#!/usr/bin/env python3
"""Print the longest Rust functions of the given crates, longest first.

Usage: scripts/longest_functions.py [--limit N] [--top K] DIR...

A function's length is the count of lines from its `fn` line to the line of
its closing brace, as the brace matching below finds it (strings, chars and
comments skipped). Test modules (`#[cfg(test)]`) and `tests/` folders
within the folders given are skipped: the rule is for the code users run
and the crates' own code (the end-to-end crate's `tests/src` helpers are
given as a folder, so they count). `--distribution` prints how many
functions fall in 60–80, 80–90, 90–100 and over 100 lines, to see whether
code is shaped to the cap. Exits 1 when one is over the limit (default 100).
"""
import argparse
import pathlib
import re
import sys

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"[^\"]*\"\s+)?fn\s+(\w+)")


def strip(line, state):
    """The line without strings, chars and comments; state carries a block
    comment or string across lines."""
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if state["block"]:
            if line.startswith("*/", i):
                state["block"] = False
                i += 2
            else:
                i += 1
            continue
        if state["string"]:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                state["string"] = False
            i += 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] = True
            i += 2
            continue
        if c == '"':
            state["string"] = True
            i += 1
            continue
        m = re.match(r"'(\\.|[^\\'])'", line[i:])
        if m:
            i += len(m.group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    lines = path.read_text().splitlines()
    state = {"block": False, "string": False}
    stripped = [strip(l, state) for l in lines]
    found, skip_depth, depth = [], None, 0
    pending_test = False
    opened = []  # (name, start line, depth at open)
    waiting = None  # fn seen, body brace not yet
    for n, s in enumerate(stripped):
        if skip_depth is None and re.search(r"#\[cfg\(test\)\]", lines[n]):
            pending_test = True
        m = FN.match(s)
        if m and skip_depth is None:
            waiting = (m.group(7), n)
        for c in s:
            if c == "{":
                if pending_test and skip_depth is None:
                    skip_depth = depth
                    pending_test = False
                elif waiting and skip_depth is None:
                    opened.append((waiting[0], waiting[1], depth))
                    waiting = None
                depth += 1
            elif c == "}":
                depth -= 1
                if skip_depth is not None and depth == skip_depth:
                    skip_depth = None
                if opened and opened[-1][2] == depth:
                    name, start, _ = opened.pop()
                    found.append((n - start + 1, name, start + 1))
            elif c == ";" and waiting and not opened or (c == ";" and waiting and waiting[1] == n and "{" not in s):
                waiting = None
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--distribution", action="store_true")
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    rows = []
    for d in args.dirs:
        for path in sorted(pathlib.Path(d).rglob("*.rs")):
            inner = path.relative_to(d).parts
            if "tests" in inner or "target" in inner:
                continue
            rows += [(n, f"{path}:{line}", name) for n, name, line in functions(path)]
    rows.sort(reverse=True)
    for n, where, name in rows[: args.top]:
        print(f"{n:5}  {name:32} {where}")
    if args.distribution:
        for lo, hi in [(60, 80), (80, 90), (90, 100)]:
            count = sum(1 for r in rows if lo < r[0] <= hi)
            print(f"{lo + 1}-{hi} lines: {count}")
    over = [r for r in rows if r[0] > args.limit]
    print(f"{len(over)} function(s) over {args.limit} lines in {len(rows)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
