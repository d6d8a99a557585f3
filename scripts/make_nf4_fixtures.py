#!/usr/bin/env python3
"""Build the NF4 (bitsandbytes 4-bit) quantization fixtures the Rust tests compare with.

Run by hand (not by CI) where PyTorch, bitsandbytes and safetensors are
installed; it needs no GPU and no network:

    python3 scripts/make_nf4_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures. It writes nf4/quantize.safetensors with,
for each seeded input X in a, b, c, d, e (see INPUTS below):
  X.input                the input tensor, in its own dtype
  X.codes                quantize_4bit(X, blocksize=64, compress_statistics=False,
                         quant_type="nf4") packed uint8 codes, flattened (1-D)
  X.absmax               its per-block absmax (f32, 1-D)
  X.dequantized          dequantize_4bit(codes, state) as f32, shape of X
  X.dq.codes             the same with compress_statistics=True (uint8, 1-D)
  X.dq.absmax            the 8-bit quantized absmax (uint8, 1-D)
  X.dq.offset            the mean subtracted before quantizing absmax (f32 [1])
  X.dq.absmax2           state2.absmax (f32, one per 256 absmax values)
  X.dq.code2             state2.code, the signed dynamic 8-bit map (f32 [256])
  X.dq.blocksize2        state2.blocksize (int64 [1])
  X.dq.dequantized       dequantize_4bit of the double-quantized state, as f32
and nf4.code, the 16 NF4 levels (f32). The torch and bitsandbytes versions
are in the file's metadata. Everything is seeded; on CPU bitsandbytes
quantizes 4-bit with torch ops and the 8-bit absmax with its C++ kernel.
Names put in LEAN (the largest dequantized copies) are left out to keep it small.
"""

import copy
import os
import sys

import bitsandbytes
import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")
BLOCKSIZE = 64
# Full-size dequantized copies to leave out, to keep the file small: they are
# code[nibble] * absmax exactly, so a test can rebuild them from codes and absmax.
LEAN = {"a.dequantized", "a.dq.dequantized", "e.dequantized", "e.dq.dequantized"}


def seeded(seed, shape, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def edge_input():
    """f32 [16, 64], one row (= one 64-value block) per case."""
    x = seeded(3, (16, 64))
    x[3] = 0.0  # an all-zero block
    # exact extremes: +/- the block max in blocks 0, 1, 2
    for r, cols in ((0, (5, 9)), (1, (0, 63)), (2, (10, 11, 12))):
        m = x[r].abs().max().item()
        for i, c in enumerate(cols):
            x[r, c] = m if i % 2 == 0 else -m
    # block 4: the max is negative and unique
    x[4, 17] = -(x[4].abs().max().item() * 1.5)
    # blocks 5 and 6: absmax exactly 1.0 and 0.25 (x / absmax is then exact),
    # holding the 16 levels and all 15 midpoints between them (ties), both signs
    code = F.get_4bit_type("nf4", device="cpu")
    mids = (code[:-1] + code[1:]) / 2
    row = torch.cat([torch.tensor([1.0]), code, mids, -mids, torch.full((64 - 1 - 16 - 30,), 0.01)])
    x[5] = row
    x[6] = row * 0.25
    # block 7: values just either side of midpoints (one ulp)
    up = torch.nextafter(mids, torch.tensor(2.0))
    dn = torch.nextafter(mids, torch.tensor(-2.0))
    x[7] = torch.cat([torch.tensor([1.0]), up, dn, -up[:3], torch.zeros(64 - 1 - 30 - 3)])
    # block 8: a tiny block (subnormal-free but small absmax)
    x[8] = x[8] * 1e-30
    return x


INPUTS = {
    "a": lambda: seeded(0, (64, 96), 0.02),
    "b": lambda: seeded(1, (33, 7)),  # 231 values: last block partial, odd count
    "c": lambda: seeded(2, (128, 64), 0.05, torch.bfloat16),
    "d": edge_input,
    "e": lambda: seeded(4, (300, 64)),  # 300 blocks: two 256-groups for absmax
}


def dequantize(q, state, code):
    """dequantize_4bit(q, state) as f32, checked against code[nibble] * absmax.

    bitsandbytes 0.50.2's AVX-512 CPU kernel indexes absmax per row and so
    gets rows whose length is not a multiple of the blocksize wrong (a: 96
    columns); it is asked for the flat shape instead, which gives the same
    blocks (flat, 64 values each) and its correct values.
    """
    shape = state.shape
    flat = copy.copy(state)
    flat.shape = torch.Size([shape.numel()])
    got = F.dequantize_4bit(q, flat).reshape(shape)
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    nib = torch.stack([q.reshape(-1) >> 4, q.reshape(-1) & 15], 1).reshape(-1)[: shape.numel()].long()
    want = code[nib] * absmax.float().repeat_interleave(BLOCKSIZE)[: shape.numel()]
    assert torch.equal(got, want.to(state.dtype).reshape(shape)), "dequantize_4bit != code[nibble] * absmax"
    return got.float().contiguous()


def main():
    out = {"nf4.code": F.get_4bit_type("nf4", device="cpu").float().contiguous()}
    for name, make in INPUTS.items():
        x = make().contiguous()
        q, s = F.quantize_4bit(x, blocksize=BLOCKSIZE, compress_statistics=False, quant_type="nf4")
        out[f"{name}.input"] = x
        out[f"{name}.codes"] = q.reshape(-1).contiguous()
        out[f"{name}.absmax"] = s.absmax.float().reshape(-1).contiguous()
        if f"{name}.dequantized" not in LEAN:
            out[f"{name}.dequantized"] = dequantize(q, s, out["nf4.code"])
        q2, s2 = F.quantize_4bit(x, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")
        out[f"{name}.dq.codes"] = q2.reshape(-1).contiguous()
        out[f"{name}.dq.absmax"] = s2.absmax.reshape(-1).contiguous()
        out[f"{name}.dq.offset"] = s2.offset.float().reshape(1).contiguous()
        out[f"{name}.dq.absmax2"] = s2.state2.absmax.float().reshape(-1).contiguous()
        out[f"{name}.dq.code2"] = s2.state2.code.float().contiguous()
        out[f"{name}.dq.blocksize2"] = torch.tensor([s2.state2.blocksize], dtype=torch.int64)
        if f"{name}.dq.dequantized" not in LEAN:
            out[f"{name}.dq.dequantized"] = dequantize(q2, s2, out["nf4.code"])
    os.makedirs(os.path.join(OUT, "nf4"), exist_ok=True)
    path = os.path.join(OUT, "nf4", "quantize.safetensors")
    meta = {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__, "blocksize": str(BLOCKSIZE), "quant_type": "nf4"}
    save_file(out, path, metadata=meta)
    print(f"wrote {path}: {os.path.getsize(path)} bytes, {len(out)} tensors")


if __name__ == "__main__":
    main()
