#!/usr/bin/env python3
"""Build stub ROCm libraries that let XLA's ROCm plugin load without ROCm installed.

For compiling without ROCm installed; never for running. xla_rocm_plugin.so
(from jax-rocm7-pjrt) names 12 ROCm libraries as DT_NEEDED, and none of them
is on the Python package index. A deviceless compile (a topology from a
target config, then PJRT_Compile, no client) calls none of their functions, so
libraries that merely define the same names are enough. Measured with --trace
(jax-rocm7-pjrt 0.12.0): loading the plugin calls __hipRegisterFatBinary (45),
__hipRegisterFunction (16,889) and __hipRegisterVar (2), its constructors
registering their HIP kernels, and rocprofiler_force_configure once (it gets
-1); a compile of bf16 attention for gfx942 then calls none.

This script reads the plugin's ELF dynamic section itself (no readelf): the
DT_NEEDED names, every undefined symbol it imports, and the version node of
each (.gnu.version_r says which library each node belongs to). Symbols with
no version are assigned to a library by name prefix. For each library it
compiles, with gcc, a shared object with the plugin's soname that defines each
imported function and the version nodes it asks for. Every stub function
fails: it returns -1 (a non-success status in each of these APIs, and the
POSIX-style error for the drm/numa calls); the few that return a pointer
return NULL, or a static message for the error-string calls. Nothing pretends
success. The kernel-registration calls made on load do nothing.

Writes into OUT_DIR: lib*.so.N, LOAD_ORDER (one file a line; the stubs do not
depend on one another, so any order works) and README.txt.

usage: make_rocm_stubs.py PLUGIN.so OUT_DIR [--trace]
  --trace: each stub prints its name to stderr when called (to check that a
  compile really calls none).
"""

import os
import re
import struct
import subprocess
import sys
import tempfile

# soname -> name prefixes of its functions (used for unversioned imports only;
# the longest matching prefix wins).
ROCM_LIBS = {
    "libamdhip64.so.7": ("hip", "__hip"),
    "libhsa-runtime64.so.1": ("hsa_",),
    "librocblas.so.5": ("rocblas_",),
    "libhipblaslt.so.1": ("hipblasLt", "_ZN13hipblaslt_ext", "_ZNK13hipblaslt_ext"),
    "libMIOpen.so.1": ("miopen",),
    "librccl.so.1": ("nccl", "rccl"),
    "libhipfft.so.0": ("hipfft",),
    "libamd_smi.so.26": ("amdsmi_",),
    "librocprofiler-sdk.so.1": ("rocprofiler_",),
    "librocm_sysdeps_numa.so.1": ("numa_", "mbind"),
    "librocm_sysdeps_drm.so.2": ("drm",),
    "librocm_sysdeps_drm_amdgpu.so.1": ("amdgpu_",),
}
# Functions that return a pointer rather than a status: what their stub returns.
MESSAGE = "ROCm stub library: ROCm is not installed here (compile-only)"
RETURNS_MESSAGE = {"hipGetErrorString", "hipGetErrorName", "ncclGetErrorString",
                   "ncclGetLastError", "rocprofiler_get_status_string",
                   "amdgpu_get_marketing_name"}
RETURNS_NULL = {"__hipRegisterFatBinary", "numa_bitmask_alloc", "numa_bitmask_setbit",
                "numa_allocate_cpumask", "numa_allocate_nodemask"}
DOES_NOTHING = {"__hipRegisterFunction", "__hipRegisterVar", "__hipUnregisterFatBinary"}

README = """These libraries are stubs, for compiling without ROCm installed; never for running.
They carry the sonames and symbols that xla_rocm_plugin.so imports, so that the
plugin loads and can compile for a ROCm target from a target config without a
GPU. Every function in them fails (or, for the plugin's kernel registration at
load time, does nothing). Built by scripts/make_rocm_stubs.py. Load each file
named in LOAD_ORDER (dlopen) before the plugin.
"""


def read_imports(path):
    """DT_NEEDED names and the undefined symbols of an ELF64 little-endian shared object:
    [(symbol, type, binding, (library, version node) or None)]."""
    with open(path, "rb") as f:
        def read(off, n):
            f.seek(off)
            return f.read(n)

        if read(0, 6) != b"\x7fELF\x02\x01":
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        shoff, = struct.unpack("<Q", read(0x28, 8))
        shentsize, shnum = struct.unpack("<HH", read(0x3A, 4))
        sections = {}  # sh_type -> (offset, size, link)
        for i in range(shnum):
            _, typ, _, _, off, size, link = struct.unpack("<IIQQQQI", read(shoff + i * shentsize, 44))
            sections.setdefault(typ, (off, size, link))
        dynsym_off, dynsym_size, strtab_index = sections[11]  # SHT_DYNSYM
        _, _, _, _, str_off, str_size, _ = struct.unpack("<IIQQQQI", read(shoff + strtab_index * shentsize, 44))
        strtab = read(str_off, str_size)

        def string(i):
            return strtab[i:strtab.index(b"\0", i)].decode()

        dyn_off, dyn_size, _ = sections[6]  # SHT_DYNAMIC
        dynamic = struct.iter_unpack("<qQ", read(dyn_off, dyn_size))
        needed = [string(val) for tag, val in dynamic if tag == 1]  # DT_NEEDED
        needs = {}  # version index -> (library, version node)
        vn_off, vn_size, _ = sections.get(0x6FFFFFFE, (0, 0, 0))  # SHT_GNU_verneed
        verneed, pos = read(vn_off, vn_size), 0
        while vn_size:
            _, cnt, file, aux, nxt = struct.unpack_from("<HHIII", verneed, pos)
            apos = pos + aux
            for _ in range(cnt):
                _, _, other, vname, anext = struct.unpack_from("<IHHII", verneed, apos)
                needs[other] = (string(file), string(vname))
                apos += anext
            if not nxt:
                break
            pos += nxt
        vs_off, vs_size, _ = sections[0x6FFFFFFF]  # SHT_GNU_versym
        versyms = struct.unpack(f"<{vs_size // 2}H", read(vs_off, vs_size))
        imports = []
        for i, (name, info, _, shndx, _, _) in enumerate(
                struct.iter_unpack("<IBBHQQ", read(dynsym_off, dynsym_size))):
            if shndx == 0 and name:  # SHN_UNDEF
                need = needs.get(versyms[i] & 0x7FFF)
                imports.append((string(name), info & 0xF, info >> 4, need))
        return needed, imports


def library_by_prefix(name):
    """The ROCm library whose longest matching prefix starts name (hipfft* is not libamdhip64's)."""
    matches = [(len(p), soname) for soname, prefixes in ROCM_LIBS.items()
               for p in prefixes if name.startswith(p)]
    return max(matches)[1] if matches else None


def by_library(imports):
    """{soname: {version node or None: [symbol]}} for the ROCm libraries' strong imports."""
    libs = {soname: {} for soname in ROCM_LIBS}
    for name, typ, bind, need in imports:
        if bind == 2:  # STB_WEAK: may stay undefined
            continue
        lib, version = need or (library_by_prefix(name), None)
        if lib not in libs:
            continue  # a system library's symbol (libc, libstdc++, ...)
        if typ != 2:  # STT_FUNC
            raise ValueError(f"{name} from {lib} is not a function; stubs define functions only")
        libs[lib].setdefault(version, []).append(name)
    return libs


def stub_source(symbols, trace):
    lines = ["/* Stub: for compiling without ROCm installed; never for running. */",
             "#include <stdio.h>",
             f'static const char message[] = "{MESSAGE}";',
             "#define CALLED(name) " + ('fprintf(stderr, "ROCm stub called: %s\\n", name)' if trace else "(void)0")]
    for name in sorted(symbols):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"symbol {name!r} is not a C identifier")
        if name in RETURNS_MESSAGE:
            kind, value = "const char *", "message"
        elif name in RETURNS_NULL:
            kind, value = "void *", "0"
        elif name in DOES_NOTHING:
            kind, value = "void ", ""
        else:
            kind, value = "long ", "-1"
        lines.append(f'{kind}{name}(void) {{ CALLED("{name}"); return {value}; }}')
    return "\n".join(lines) + "\n"


def version_script(versions):
    nodes = [f"{v} {{ global: {' '.join(s + ';' for s in sorted(syms))} }};"
             for v, syms in sorted(item for item in versions.items() if item[0])]
    return "\n".join(nodes) + "\n" if nodes else None


def build(plugin, out_dir, trace=False):
    """Build the stubs into out_dir; returns {soname: number of functions}."""
    needed, imports = read_imports(plugin)
    missing = sorted(set(ROCM_LIBS) - set(needed))
    extra = sorted(n for n in needed if n not in ROCM_LIBS and not n.startswith(
        ("libc.", "libm.", "libdl.", "librt.", "libpthread.", "libstdc++.", "libgcc_s.", "ld-linux")))
    if missing or extra:
        raise ValueError(f"the plugin's DT_NEEDED differ from what this script knows: "
                         f"not needed {missing}, unknown {extra}")
    counts = {}
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for soname, versions in by_library(imports).items():
            symbols = [s for syms in versions.values() for s in syms]
            src = os.path.join(tmp, soname + ".c")
            with open(src, "w") as f:
                f.write(stub_source(symbols, trace))
            cmd = ["gcc", "-shared", "-fPIC", "-O1", "-fno-builtin", "-w", "-o",
                   os.path.join(out_dir, soname), src, f"-Wl,-soname,{soname}"]
            script = version_script(versions)
            if script:
                with open(src + ".map", "w") as f:
                    f.write(script)
                cmd.append(f"-Wl,--version-script={src}.map")
            try:
                result = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError:
                raise RuntimeError("gcc not found: it builds the ROCm stub libraries")
            if result.returncode != 0:
                raise RuntimeError(f"gcc failed on {soname}: {result.stderr.strip()[:300]}")
            counts[soname] = len(symbols)
    with open(os.path.join(out_dir, "LOAD_ORDER"), "w") as f:
        f.write("".join(soname + "\n" for soname in ROCM_LIBS))
    with open(os.path.join(out_dir, "README.txt"), "w") as f:
        f.write(README)
    return counts


def main(argv):
    args = [a for a in argv if a != "--trace"]
    if len(args) != 2:
        print("usage: make_rocm_stubs.py PLUGIN.so OUT_DIR [--trace]", file=sys.stderr)
        return 2
    try:
        counts = build(args[0], args[1], trace="--trace" in argv)
    except (OSError, ValueError, RuntimeError, KeyError, struct.error) as e:
        print(f"error: building the ROCm stubs: {e}", file=sys.stderr)
        return 1
    for soname, n in counts.items():
        print(f"{soname}: {n} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
