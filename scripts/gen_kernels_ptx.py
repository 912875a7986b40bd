#!/usr/bin/env python3
"""Compiles kernels/kv_copy.cu with NVRTC (through ctypes) into kernels/kv_copy.ptx, the PTX kept
in the repository for hosts where kvtier finds no NVRTC library at run time.

The PTX's first line names the source's xxh3_64 (seed 0), which the Rust tests compare with the
.cu to catch a stale PTX. Run through scripts/gen_kernels_ptx.sh (it makes the venv with NVRTC
and xxhash).

Usage: gen_kernels_ptx.py            regenerate kernels/kv_copy.ptx
       gen_kernels_ptx.py --check    exit 0 if the PTX header matches the .cu, else 1 (no NVRTC)
       gen_kernels_ptx.py --print-lib  print the NVRTC library path found

The NVRTC library: $KVTIER_NVRTC_LIB if set, else the venv's nvidia/cu13/lib/libnvrtc.so.13
(pip package nvidia-cuda-nvrtc 13.x), else the system's libnvrtc.
"""

import ctypes
import ctypes.util
import glob
import os
import site
import sys
import sysconfig

import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_REL = "kernels/kv_copy.cu"
PTX_REL = "kernels/kv_copy.ptx"
SRC = os.path.join(ROOT, SRC_REL)
PTX = os.path.join(ROOT, PTX_REL)
HEADER_PREFIX = (
    f"// kvtier: generated from {SRC_REL} by scripts/gen_kernels_ptx.sh; source xxh3_64="
)
OPTIONS = [b"--gpu-architecture=compute_80"]


def source_hash(data: bytes) -> str:
    return "%016x" % xxhash.xxh3_64(data, seed=0).intdigest()


def header_line(data: bytes) -> str:
    return HEADER_PREFIX + source_hash(data)


def check() -> int:
    with open(SRC, "rb") as f:
        want = header_line(f.read())
    try:
        with open(PTX, encoding="utf-8") as f:
            got = f.readline().rstrip("\n")
    except FileNotFoundError:
        got = ""
    if got == want:
        return 0
    print(
        f"gen_kernels_ptx: {PTX_REL} is stale (header {got!r}, want {want!r}); "
        "run scripts/gen_kernels_ptx.sh",
        file=sys.stderr,
    )
    return 1


def find_nvrtc() -> str | None:
    env = os.environ.get("KVTIER_NVRTC_LIB")
    if env:
        return env
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenvs lack it
        pass
    for d in dirs:
        p = os.path.join(d, "nvidia", "cu13", "lib", "libnvrtc.so.13")
        if os.path.exists(p):
            return p
    return ctypes.util.find_library("nvrtc") or "libnvrtc.so.13"


def load_nvrtc(path: str) -> ctypes.CDLL:
    # NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> from the library path; load one that
    # lies next to it first (by full path, RTLD_GLOBAL) so no LD_LIBRARY_PATH is needed.
    if os.path.isabs(path):
        for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        if path == "libnvrtc.so.13":
            return ctypes.CDLL("libnvrtc.so", mode=ctypes.RTLD_GLOBAL)
        raise


def compile_ptx(lib: ctypes.CDLL, source: bytes) -> str:
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]

    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")

    major, minor = ctypes.c_int(), ctypes.c_int()
    ok(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    print(f"gen_kernels_ptx: NVRTC {major.value}.{minor.value}", file=sys.stderr)

    prog = ctypes.c_void_p()
    ok(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source, SRC_REL.encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
        rc = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
        size = ctypes.c_size_t()
        ok(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        ok(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            print(text, file=sys.stderr)
            ok(rc, "nvrtcCompileProgram")
        if text:  # warnings: the source should compile clean
            print(f"gen_kernels_ptx: NVRTC log:\n{text}", file=sys.stderr)
        ok(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        ok(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        return check()
    if argv == ["--print-lib"]:
        print(find_nvrtc())
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    path = find_nvrtc()
    try:
        lib = load_nvrtc(path)
    except OSError as e:
        print(f"gen_kernels_ptx: cannot load NVRTC ({path}): {e}", file=sys.stderr)
        return 1
    with open(SRC, "rb") as f:
        source = f.read()
    try:
        ptx = compile_ptx(lib, source)
    except RuntimeError as e:
        print(f"gen_kernels_ptx: {e}", file=sys.stderr)
        return 1
    with open(PTX, "w", encoding="utf-8") as f:
        f.write(header_line(source) + "\n" + ptx.rstrip("\n") + "\n")
    print(f"gen_kernels_ptx: wrote {PTX_REL} ({path})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
