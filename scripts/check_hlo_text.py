#!/usr/bin/env python3
"""Check our HLO text printer against XLA itself (a development check).

For every NAME.hlo.txt / NAME.stablehlo.mlir pair in DIR (written by the e2e
tests with HLO_E2E_DUMP=DIR), parse the HLO text with XLA's HLO parser,
convert it to StableHLO with XLA's importer, compile both programs with
jaxlib's CPU client, run them on the same random inputs and compare the
outputs. The StableHLO form is the one the e2e tests check numerically
against the host reference, so agreement makes the HLO text right too.

Needs jaxlib with `hlo_module_from_text` (0.4.38 works on Python 3.11):
    pip install --target /tmp/pyref2 jaxlib==0.4.38 numpy ml_dtypes scipy
    HLO_E2E_DUMP=/tmp/hlo-dump cargo test -p hlo-e2e
    PYTHONPATH=/tmp/pyref2 python3 scripts/check_hlo_text.py /tmp/hlo-dump
"""

import glob
import os
import re
import sys

import numpy as np
import jax  # noqa: F401  (initialises the runtime state execute() needs)
from jaxlib import xla_client

DTYPES = {
    "f32": np.float32, "f64": np.float64, "f16": np.float16, "i1": np.bool_,
    "i8": np.int8, "i32": np.int32, "i64": np.int64, "ui8": np.uint8,
    "ui32": np.uint32, "ui64": np.uint64,
}


def arg_types(mlir):
    sig = mlir[mlir.index("@main(") + 6:]
    sig = sig[: sig.index(") -> (")]
    out = []
    for m in re.finditer(r"tensor<([^>]*)>", sig):
        parts = m.group(1).split("x")
        out.append(([int(d) for d in parts[:-1]], parts[-1]))
    return out


def random_input(rng, dims, dtype):
    if dtype == "bf16":
        import ml_dtypes
        return rng.uniform(0.1, 2.0, dims).astype(ml_dtypes.bfloat16)
    t = DTYPES[dtype]
    if t == np.bool_:
        return rng.integers(0, 2, dims).astype(np.bool_)
    if np.issubdtype(t, np.integer):
        return rng.integers(0, 5, dims).astype(t)
    return rng.uniform(0.1, 2.0, dims).astype(t)


def main(directory):
    client = xla_client.make_cpu_client()
    opts = xla_client.CompileOptions()
    ok, failed = 0, []
    for hlo_path in sorted(glob.glob(os.path.join(directory, "*.hlo.txt"))):
        stem = hlo_path[: -len(".hlo.txt")]
        name = os.path.basename(stem)
        try:
            hlo = open(hlo_path).read()
            ours = open(stem + ".stablehlo.mlir").read()
            module = xla_client._xla.hlo_module_from_text(hlo)
            proto = module.as_serialized_hlo_module_proto()
            computation = xla_client.XlaComputation(proto)
            converted = xla_client._xla.mlir.xla_computation_to_mlir_module(computation)
            if isinstance(converted, str):
                converted = converted.encode()
            exe_ours = client.compile(ours.encode(), opts)
            exe_hlo = client.compile(converted, opts)
            rng = np.random.default_rng(0)
            args = [random_input(rng, d, t) for d, t in arg_types(ours)]
            dev = client.local_devices()[0]
            bufs = [client.buffer_from_pyval(a, dev) for a in args]
            a = [np.asarray(x) for x in exe_ours.execute(bufs)]
            b = [np.asarray(x) for x in exe_hlo.execute(bufs)]
            assert len(a) == len(b), f"{len(a)} vs {len(b)} outputs"
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and x.shape == y.shape, f"{x.dtype}{x.shape} vs {y.dtype}{y.shape}"
                np.testing.assert_array_equal(x.astype(np.float64) if x.dtype.kind == 'V' or 'bfloat16' in str(x.dtype) else x, y.astype(np.float64) if 'bfloat16' in str(y.dtype) else y)
            ok += 1
        except Exception as e:  # report every failure, not just the first
            failed.append(f"{name}: {' '.join(str(e).split())[:400] or type(e).__name__}")
    print(f"{ok} programs: HLO text parsed by XLA and equal to the StableHLO form")
    for f in failed:
        print("FAILED", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
