#!/usr/bin/env python3
"""Data fixtures: the same rows as JSONL and as the Parquet shards HF
`datasets` exports, and alpaca / sharegpt rows with their equivalents in
hlo-train's own shapes (prompt/completion, messages), written here from
Stanford Alpaca's prompt and sharegpt's role names, not from hlo-train's
code.

Needs `datasets` (and pyarrow), e.g. `pip install --target DIR datasets`
then `PYTHONPATH=DIR python3 scripts/make_data_fixtures.py`. Writes
tests/fixtures/data/.
"""

import json
import os
import shutil

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "data")

# Stanford Alpaca's PROMPT_DICT (train.py), the prompt its model learned.
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:"
)
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def write_jsonl(name, rows):
    with open(os.path.join(OUT, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def to_parquet(jsonl, parquet):
    """`jsonl` read by `datasets` and exported as `datasets` exports."""
    ds = datasets.load_dataset("json", data_files=os.path.join(OUT, jsonl), split="train")
    ds.to_parquet(os.path.join(OUT, parquet))
    return ds


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    # Mixed shapes in one file: `datasets` gives the columns a row lacks
    # as nulls.
    words = ["cat", "hello", "rust", "xla", "mesh", "lora", "scan", "shard", "jit", "tile",
             "fuse", "grad"]
    rows = []
    for i, w in enumerate(words * 2):
        if i % 3 == 0:
            rows.append({"text": f"{w} is {w.upper()}; " * (1 + i % 4)})
        else:
            rows.append({"prompt": f"{w}{i}=", "completion": (w * (1 + i % 3)).upper()})
    write_jsonl("rows.jsonl", rows)
    ds = to_parquet("rows.jsonl", "rows.parquet")
    os.makedirs(os.path.join(OUT, "shards"))
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(
            os.path.join(OUT, "shards", f"train-{k:05d}-of-00002.parquet"))

    # Token ids with HF labels (a list<int64> column).
    ids = [{"input_ids": [5 + i, 6 + i, 7 + i, 8 + i], "labels": [-100, -100, 7 + i, 8 + i]}
           for i in range(6)]
    write_jsonl("ids.jsonl", ids)
    to_parquet("ids.jsonl", "ids.parquet")

    alpaca = [
        {"instruction": "Write the word in capitals.", "input": "cat", "output": "CAT"},
        {"instruction": "Say hello.", "input": "", "output": "Hello!"},
        {"instruction": "Reverse the word.", "input": "lora", "output": "arol"},
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    ]
    write_jsonl("alpaca.jsonl", alpaca)
    to_parquet("alpaca.jsonl", "alpaca.parquet")
    write_jsonl("alpaca_as_prompt_completion.jsonl", [
        {"prompt": (ALPACA_INPUT if r["input"] else ALPACA_NO_INPUT).format(**r),
         "completion": r["output"]}
        for r in alpaca
    ])

    sharegpt = [
        {"conversations": [
            {"from": "system", "value": "Answer in capitals."},
            {"from": "human", "value": "cat"},
            {"from": "gpt", "value": "CAT"},
            {"from": "human", "value": "dog"},
            {"from": "gpt", "value": "DOG"},
        ]},
        {"conversations": [
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello."},
        ]},
    ]
    write_jsonl("sharegpt.jsonl", sharegpt)
    to_parquet("sharegpt.jsonl", "sharegpt.parquet")
    write_jsonl("sharegpt_as_messages.jsonl", [
        {"messages": [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                      for t in r["conversations"]]}
        for r in sharegpt
    ])

    # A bad third row (no output: its alpaca shape is incomplete), written
    # with pyarrow directly, zstd-compressed.
    bad = pa.table({
        "instruction": ["a", "b", "c", "d"],
        "output": ["A", "B", None, "D"],
    })
    pq.write_table(bad, os.path.join(OUT, "bad_row.parquet"), compression="zstd")
    for name in sorted(os.listdir(OUT)):
        print(name)


if __name__ == "__main__":
    main()
