#!/usr/bin/env python3
"""Write tests/fixtures/sharding_strings.json: how JAX spells shardings.

For each (mesh, PartitionSpec, shape) in the table below, JAX lowers
`lambda x: x * 2` with that input sharding and we record the Shardy
attribute (`#sdy.sharding<@mesh, [...]>`) from the StableHLO text and the
GSPMD string (`{devices=[...]...}`) from the HLO text of the argument.
hlo-train's printers are tested against these strings.

Needs jax (any recent version; 0.10.2 was used, on Python 3.11):
    pip install --target /tmp/pyref jax==0.10.2 jaxlib==0.10.2
    PYTHONPATH=/tmp/pyref python3 scripts/make_sharding_fixture.py
"""

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

MESHES = [(1, 8, 1), (2, 4, 1), (1, 4, 2), (8, 1, 1), (2, 2, 2)]
AXES = ("dp", "fsdp", "mp")
SPECS = {
    1: [(None,), ("fsdp",), (("dp", "fsdp", "mp"),), ("mp",)],
    2: [
        (None, None), ("fsdp", None), (None, "mp"), ("fsdp", "mp"), ("mp", "fsdp"),
        (("dp", "fsdp"), None), (("dp", "fsdp"), "mp"), ("dp", ("fsdp", "mp")),
        (("fsdp", "dp"), None), (None, ("mp", "dp")),
    ],
    3: [("dp", None, "mp"), (None, ("fsdp", "mp"), None), (("mp", "dp"), "fsdp", None)],
}
SHAPES = {1: (16,), 2: (16, 8), 3: (8, 16, 8)}


def spec_json(spec):
    out = []
    for s in spec:
        if s is None:
            out.append([])
        elif isinstance(s, str):
            out.append([s])
        else:
            out.append(list(s))
    return out


def main():
    cases = []
    devices = np.array(jax.devices()[:8])
    for sizes in MESHES:
        mesh = Mesh(devices.reshape(sizes), AXES)
        for rank, specs in SPECS.items():
            for spec in specs:
                shape = SHAPES[rank]
                sharding = NamedSharding(mesh, P(*spec))
                lowered = jax.jit(lambda x: x * 2, in_shardings=(sharding,)).lower(
                    jax.ShapeDtypeStruct(shape, jnp.float32)
                )
                mlir = lowered.as_text()
                hlo = lowered.as_text(dialect="hlo")
                sdy = re.search(r"%arg0: tensor<[^>]*> \{sdy\.sharding = (#sdy\.sharding<[^>]*>)\}", mlir)
                mesh_decl = re.search(r"(sdy\.mesh @mesh = <\[[^\]]*\]>)", mlir)
                gspmd = re.search(r"parameter\(0\), sharding=(\{[^}]*\})", hlo)
                cases.append({
                    "mesh": ",".join(f"{a}={s}" for a, s in zip(AXES, sizes)),
                    "spec": spec_json(spec),
                    "shape": list(shape),
                    "sdy_mesh": mesh_decl.group(1) if mesh_decl else None,
                    "sdy": sdy.group(1) if sdy else None,
                    "gspmd": gspmd.group(1) if gspmd else None,
                })
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "tests", "fixtures", "sharding_strings.json")
    with open(path, "w") as f:
        json.dump({"generator": f"jax {jax.__version__}", "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
