#!/usr/bin/env python3
"""Tokenize throughput: `hlo-train data prepare` against Hugging Face
`datasets` `map` with the same tokenizer on every core, on one generated
corpus; and the ids of both compared.

The corpus is text rows of words drawn with Zipf frequencies from a
generated vocabulary, about --tokens tokens; the tokenizer a byte-level BPE
of 32k tokens trained on its first rows (the shape of Llama 3's and GPT-2's
tokenizers; the Hub is not reachable from the bench machine). Both sides
read the same JSONL: `datasets` converts it to Arrow first (timed apart),
then `map(batched=True, num_proc=cores)` tokenizes; `data prepare` reads,
tokenizes and writes its shards in one pass.

Usage (from the repository root, after `cargo build --release`):
    PYTHONPATH=/path/to/refenv python3 scripts/bench_tokenize.py --tokens 200e6 --work /tmp/tok-bench
Prints one JSON object: tokens, seconds and tokens/s of each side, and
how many rows were compared and matched.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

BIN = "target/release/hlo-train"


def corpus(path, tokens, seed=0):
    """Text rows of about 400 words until about `tokens` tokens (words are
    1.3 tokens each on average under the trained BPE, measured)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(50_000)]
    ranks = np.arange(1, len(vocab) + 1)
    p = 1.0 / ranks
    p /= p.sum()
    cdf = np.cumsum(p)
    words_needed = int(tokens / 1.3)
    written = 0
    with open(path, "w") as f:
        while written < words_needed:
            lengths = rng.integers(200, 600, size=1000)
            words = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(vocab) - 1)
            at = 0
            for n in lengths:
                row = " ".join(vocab[w] for w in words[at:at + n]) + "."
                f.write(json.dumps({"text": row}) + "\n")
                at += n
            written += int(lengths.sum())


def train_tokenizer(corpus_path, out, rows=20_000):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32_000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        with open(corpus_path) as f:
            for i, line in enumerate(f):
                if i >= rows:
                    return
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, default=200e6)
    ap.add_argument("--work", default="/tmp/hlo-tokenize-bench")
    ap.add_argument("--bin", default=BIN)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    data = f"{args.work}/corpus.jsonl"
    tok_path = f"{args.work}/tokenizer.json"
    if not os.path.exists(data):
        corpus(data, args.tokens)
    if not os.path.exists(tok_path):
        train_tokenizer(data, tok_path)
    config = f"{args.work}/config.json"
    with open(config, "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32_000,
                   "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1}, f)
    cores = os.cpu_count()

    # hlo-train: read, tokenize on every core, write the shards.
    shards = f"{args.work}/shards"
    subprocess.run(["rm", "-rf", shards], check=True)
    t0 = time.time()
    out = subprocess.run([args.bin, "data", "prepare", "--config", config, "--tokenizer", tok_path,
                          "--data", data, "--out", shards], check=True, capture_output=True, text=True)
    ours_s = time.time() - t0
    manifest = json.load(open(f"{shards}/manifest.json"))
    print(out.stdout.strip(), file=sys.stderr)

    # datasets: JSON to Arrow, then map on every core.
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_caching()
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_path)
    t0 = time.time()
    ds = datasets.load_dataset("json", data_files=data, split="train",
                               cache_dir=f"{args.work}/hf-cache")
    load_s = time.time() - t0
    t0 = time.time()
    mapped = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=cores, remove_columns=["text"])
    map_s = time.time() - t0
    theirs_tokens = sum(len(x) for x in mapped["input_ids"])

    # The ids: ours are the tokenizer's and the EOS appended to text.
    ids = np.memmap(f"{shards}/shard-00000.ids", dtype="<u4", mode="r")
    offsets = np.memmap(f"{shards}/shard-00000.offsets", dtype="<u8", mode="r")
    rows = min(len(offsets) - 1, len(mapped))
    checked = matched = 0
    for i in range(0, rows, max(1, rows // 500)):
        mine = ids[offsets[i]:offsets[i + 1]].tolist()
        checked += 1
        matched += int(mine[:-1] == mapped[i]["input_ids"] and mine[-1] == 1)
    result = {
        "cores": cores,
        "tokens": manifest["tokens"],
        "samples": manifest["samples"],
        "hlo_train": {"seconds": round(ours_s, 2), "tokens_per_s": round(manifest["tokens"] / ours_s)},
        "datasets": {"load_seconds": round(load_s, 2), "map_seconds": round(map_s, 2),
                     "tokens": theirs_tokens,
                     "map_tokens_per_s": round(theirs_tokens / map_s),
                     "load_and_map_tokens_per_s": round(theirs_tokens / (load_s + map_s))},
        "rows_compared": checked,
        "rows_equal": matched,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
