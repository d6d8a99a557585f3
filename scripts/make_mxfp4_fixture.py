#!/usr/bin/env python3
"""Build the MXFP4 gpt-oss fixture: a tiny gpt-oss model (the config of
make_moe_fixtures.py's, widened to hidden 64 and intermediate 32 so each
expert's input features are whole blocks of 32) with its experts stored as
the released gpt-oss checkpoints store them (4-bit MXFP4 blocks and 8-bit
exponents), and what transformers computes from it.

Run by hand (not by CI) after make_moe_fixtures.py, where HF transformers,
safetensors and PyTorch are installed (no GPU, no network):

    python3 scripts/make_mxfp4_fixture.py [FIXTURES_DIR]

It writes families/gpt_oss/mxfp4/:
  config.json          that config with quantization_config
                       {"quant_method": "mxfp4", ...} as the Hub's has it
  model.safetensors    every tensor of the model (random, N(0, 0.2); norms
                       uniform(0.5, 1.5)), but each layer's
                       mlp.experts.gate_up_proj and down_proj replaced by `<name>_blocks` (u8 [E, out,
                       in/32, 16], two FP4 e2m1 codes a byte, low nibble
                       first) and `<name>_scales` (u8 [E, out, in/32], the
                       power of two of each block of 32, biased by 127)
  expected.safetensors input_ids (families/gpt_oss's), `logits` of that model
                       in f32 with the experts dequantized by transformers'
                       own `convert_moe_packed_tensors` (what
                       from_pretrained does on a machine without the MXFP4
                       kernels), and `layers.0.gate_up_proj` /
                       `layers.0.down_proj`, layer 0's dequantized experts
                       as the model holds them ([E, in, out])
Seeded: a rerun writes identical files.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures")
SRC = os.path.join(OUT, "families", "gpt_oss")
DST = os.path.join(SRC, "mxfp4")


def main():
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    print("torch", torch.__version__, "transformers", transformers.__version__)
    torch.manual_seed(0)
    config = json.load(open(os.path.join(SRC, "config.json")))
    config.update(hidden_size=64, intermediate_size=32)
    plain = {k: v for k, v in config.items() if k != "architectures"}
    cfg = transformers.GptOssConfig(**plain)
    cfg._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(cfg).eval()
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.rand(t.shape) + 0.5
        else:
            state[name] = torch.randn(t.shape) * 0.2
    out, dequantized = {}, {}
    for name, t in state.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[name] = t
            continue
        e, din, dout = t.shape  # the model holds [E, in, out]
        assert din % 32 == 0, (name, din)
        blocks = torch.randint(0, 256, (e, dout, din // 32, 16), dtype=torch.uint8)
        # Exponents around 2^-4 keep the values of the order of the other
        # weights (the codes reach +-6); a few far ones exercise the range.
        scales = torch.randint(119, 126, (e, dout, din // 32), dtype=torch.uint8)
        scales[0, 0, 0] = 100
        scales[-1, -1, -1] = 131
        out[name + "_blocks"] = blocks
        out[name + "_scales"] = scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dequantized[name].shape == t.shape, (name, dequantized[name].shape, t.shape)
    os.makedirs(DST, exist_ok=True)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    with open(os.path.join(DST, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(dict(sorted(out.items())), os.path.join(DST, "model.safetensors"), metadata={"format": "pt"})

    # The model with the dequantized experts, in f32, eager.
    weights = dict(state)
    weights.update(dequantized)
    model.load_state_dict(weights, strict=True)
    ids = load_file(os.path.join(SRC, "expected.safetensors"))["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    expected = {
        "input_ids": ids,
        "logits": logits.contiguous(),
        "layers.0.gate_up_proj": dequantized["model.layers.0.mlp.experts.gate_up_proj"].contiguous(),
        "layers.0.down_proj": dequantized["model.layers.0.mlp.experts.down_proj"].contiguous(),
    }
    save_file(expected, os.path.join(DST, "expected.safetensors"))
    # What from_pretrained makes of the folder on this machine, when it can.
    try:
        loaded = transformers.GptOssForCausalLM.from_pretrained(DST, dtype=torch.float32)
        loaded.config._attn_implementation = "eager"
        with torch.no_grad():
            theirs = loaded(input_ids=ids).logits.float()
        print("from_pretrained(mxfp4/): max abs diff against the dequantized model",
              (theirs - logits).abs().max().item())
    except Exception as err:  # noqa: BLE001 (a report, not a check)
        print("from_pretrained(mxfp4/) did not load here:", type(err).__name__, err)
    print("wrote", DST)


if __name__ == "__main__":
    main()
