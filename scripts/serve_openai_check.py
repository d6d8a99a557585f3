#!/usr/bin/env python3
"""`hlo-train serve` through the official `openai` Python client.

Starts two servers (the HF fixture model with a PEFT adapter; the tiny
model with a chat template), then checks what a user of the client sees:
the model list, greedy completions equal to HF+PEFT's tokens, streamed
chunks that make the whole text, chat completions, an adapter loaded at
run time, the client's exception classes for bad requests, and a clean exit
on SIGTERM. Installs `openai` into .plugins/python when it is missing.

    python3 scripts/serve_openai_check.py target/debug/hlo-train
"""

import json
import os
import signal
import struct
import subprocess
import sys
import urllib.request

from site_packages import import_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "llama", "gqa_llama3")


def import_openai():
    return import_installed("openai", ["openai>=1.40"])


def safetensors_ints(path, name):
    """An integer tensor of a safetensors file, as a flat list."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        t = header[name]
        start, end = t["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(end - start)
    fmt = {"I64": "q", "I32": "i"}[t["dtype"]]
    return list(struct.unpack("<%d%s" % (len(data) // struct.calcsize(fmt), fmt), data))


class Server:
    def __init__(self, binary, *args):
        self.proc = subprocess.Popen(
            [binary, "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if "http://" not in line:
            raise SystemExit("the server did not start: " + line + self.proc.stderr.read())
        self.url = line.split("http://")[1].strip()

    def post(self, path, body):
        req = urllib.request.Request(
            "http://" + self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        assert code == 0, "exit code %d: %s" % (code, self.proc.stderr.read())


def extra(obj, key):
    """A field the OpenAI schema does not name (vLLM's `token_ids`)."""
    value = getattr(obj, key, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(key)
    return value


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "hlo-train")
    openai = import_openai()
    expected = os.path.join(FIXTURE, "expected.safetensors")
    hf_base = safetensors_ints(expected, "greedy")
    hf_adapter = safetensors_ints(expected, "greedy_adapter")

    server = Server(
        binary,
        "--checkpoint", FIXTURE,
        "--served-model-name", "base",
        "--adapter", "peft=" + os.path.join(FIXTURE, "adapter"),
    )
    client = openai.OpenAI(base_url="http://%s/v1" % server.url, api_key="unused")
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == ["base", "peft"], ids
    for model, want in [("base", hf_base), ("peft", hf_adapter)]:
        r = client.completions.create(
            model=model,
            prompt=want[:5],
            max_tokens=32,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        got = extra(r.choices[0], "token_ids")
        assert got == want[5:], (model, got, want[5:])
        assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens == 5
    # An adapter loaded at run time answers as the one given at start.
    status, text = server.post(
        "/v1/load_lora_adapter",
        {"lora_name": "again", "lora_path": os.path.join(FIXTURE, "adapter")},
    )
    assert status == 200, text
    r = client.completions.create(
        model="again", prompt=hf_adapter[:5], max_tokens=32, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert extra(r.choices[0], "token_ids") == hf_adapter[5:]
    # The client's exception classes for the server's status codes.
    for kwargs, error in [
        ({"model": "nope", "prompt": [1, 2]}, openai.NotFoundError),
        ({"model": "base", "prompt": [1, 2], "max_tokens": 0}, openai.BadRequestError),
        ({"model": "base", "prompt": [1, 2], "temperature": -1}, openai.BadRequestError),
        ({"model": "base", "prompt": [1] * 70}, openai.BadRequestError),
    ]:
        try:
            client.completions.create(**kwargs)
            raise AssertionError("accepted: %r" % kwargs)
        except error as e:
            assert e.body and e.body.get("message"), e
    server.stop()

    server = Server(
        binary,
        "--model", "tiny",
        "--chat-template", os.path.join(ROOT, "tests", "fixtures", "chat", "llama_style"),
    )
    client = openai.OpenAI(base_url="http://%s/v1" % server.url, api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    common = dict(model="tiny", messages=messages, max_tokens=24, temperature=0.7, seed=5,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**common)
    chunks = list(client.chat.completions.create(stream=True, **common))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content, (streamed, whole)
    assert whole.usage.completion_tokens == 24
    text = client.completions.create(model="tiny", prompt="The capital of", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    pieces = client.completions.create(model="tiny", prompt="The capital of", max_tokens=16,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == text.choices[0].text
    server.stop()
    print("openai client: models, completions (HF+PEFT tokens), runtime adapter, errors, chat, streaming: ok")


if __name__ == "__main__":
    main()
