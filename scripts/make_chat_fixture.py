"""Writes tests/fixtures/chat/: a tokenizer_config.json with a chat template
of our own, and expected.json with conversations rendered by jinja2 the way
HF transformers renders chat templates (sandboxed, trim_blocks,
lstrip_blocks, raise_exception), as the reference for hlo-train's minijinja
rendering.

    python3 scripts/make_chat_fixture.py
"""
import json
import pathlib

from jinja2.sandbox import ImmutableSandboxedEnvironment

LLAMA_STYLE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = 'You are a helpful assistant.' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('roles must be user or assistant, got ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'].strip() + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Block tags without dashes: the whitespace comes from trim/lstrip_blocks.
PLAIN = (
    "{% for m in messages %}\n"
    "    <{{ m.role }}>\n"
    "{{ m.content }}{% if loop.last %} (last){% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<assistant>\n"
    "{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "  Answer briefly. "},
     {"role": "user", "content": " hi "},
     {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "multi\nline"}, {"role": "assistant", "content": "ok"}],
]


def render(source, messages, add_generation_prompt):
    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def main():
    out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat"
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, source in [("llama_style", LLAMA_STYLE), ("plain", PLAIN)]:
        (out / name).mkdir(exist_ok=True)
        config = {"bos_token": "<|begin_of_text|>",
                  "eos_token": {"content": "<|eot_id|>", "special": True},
                  "chat_template": source}
        (out / name / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        for messages in CONVERSATIONS:
            for gen in (True, False):
                cases.append({"template": name, "messages": messages,
                              "add_generation_prompt": gen,
                              "text": render(source, messages, gen)})
    bad = [{"role": "tool", "content": "x"}]
    try:
        render(LLAMA_STYLE, bad, True)
    except ValueError as e:
        cases.append({"template": "llama_style", "messages": bad,
                      "add_generation_prompt": True, "error": str(e)})
    (out / "expected.json").write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
