"""Proves that the kernels claimed for Volta (sm_70) compile and assemble for it.

CUDA 13 cannot target sm_70, so this uses CUDA 12 from PyPI: NVRTC (nvidia-cuda-nvrtc-cu12) compiles the
kernels of flash.cu (its torch-facing host part is skipped under __CUDACC_RTC__) to PTX for compute_70,
with cuda_fp16.h from nvidia-cuda-runtime-cu12, and ptxas (nvidia-cuda-nvcc-cu12) assembles that PTX for
sm_70. Prints registers and spills per kernel; exits 1 on any error or warning.

usage: python .ci/check_sm70.py PREFIX     (PREFIX: where pip --target installed those three packages)
"""
import ctypes
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA = pathlib.Path(sys.argv[1]) / "nvidia"

# Every instantiation a launcher can pick on a V100 (96 KB of shared memory per block): the Volta kernel at each
# of its tile widths, and the fp32 kernels at each of theirs with every B_r their launchers may fall back to (at
# d = 256 those tiles exceed 96 KB, and the launch stops with an error, but they compile all the same).
FP32_DIMS = (16, 32, 64, 96, 128, 160, 192, 256)
KERNELS = [f"flash_fwd_volta<{d}, 4>" for d in (32, 64, 128)]
KERNELS += [f"flash_fwd_fp32<{d}, {B_r}, {64 if d <= 64 else 32}>" for d in FP32_DIMS
            for B_r in ((64, 32) if d <= 128 else (32,))]
KERNELS += [f"flash_bwd_fp32<{d}, {B_r}, {64 if d <= 64 else 32}>" for d in FP32_DIMS
            for B_r in ((64, 32, 16) if d <= 64 else (32, 16) if d <= 128 else (16,))]
KERNELS += [f"flash_bwd_preprocess<float, {d}>" for d in FP32_DIMS]
OPTIONS = ["--gpu-architecture=compute_70", "-std=c++17", f"-I{CUDA / 'cuda_runtime' / 'include'}",
           # nvcc compiles a lambda inside a kernel for the device; NVRTC takes a generic lambda's call operator
           # (the fp32 kernels' each_entry) for a host function unless told this. (Functions missing __device__
           # would still fail the nvcc builds above, of the same source for sm_75 and up.)
           "-default-device",
           "-DINFINITY=__int_as_float(0x7f800000)",  # math.h's INFINITY, which NVRTC does not provide
           # the defines of PyTorch's extension build (no implicit half <-> float conversions)
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
           "-D__CUDA_NO_HALF2_OPERATORS__"]


def nvrtc_ptx():
    lib = ctypes.CDLL(str(CUDA / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"))
    prog = ctypes.c_void_p()

    def check(status, what):
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            sys.exit(f"NVRTC: {what} failed (status {status})\n{log.value.decode()}")

    source = (ROOT / "flash.cu").read_bytes()
    # NVRTC has no C++ standard library: the one header flash.cu's kernels include is given in memory
    headers = (ctypes.c_char_p * 1)(b"typedef unsigned int uint32_t;\ntypedef long long int64_t;\ntypedef unsigned long long uint64_t;\n")
    names = (ctypes.c_char_p * 1)(b"cstdint")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"flash.cu", 1, headers, names), "create")
    for name in KERNELS:
        check(lib.nvrtcAddNameExpression(prog, name.encode()), f"name {name}")
    options = (ctypes.c_char_p * len(OPTIONS))(*[o.encode() for o in OPTIONS])
    check(lib.nvrtcCompileProgram(prog, len(OPTIONS), options), "compile")
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    # CUDA 12 warns that sm_70 is deprecated: that warning is the premise of this check, any other fails it
    warnings = [w for w in log.value.decode().splitlines() if w.strip() and "are deprecated" not in w]
    if warnings:
        sys.exit("NVRTC warned:\n" + "\n".join(warnings))
    lowered = {}
    for name in KERNELS:
        out = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), f"lowered name of {name}")
        lowered[out.value.decode()] = name
    check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
    ptx = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetPTX(prog, ptx), "PTX")
    return ptx.value, lowered


def main():
    ptx, lowered = nvrtc_ptx()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "flash_sm70.ptx"
        path.write_bytes(ptx)
        result = subprocess.run([str(CUDA / "cuda_nvcc" / "bin" / "ptxas"), "-arch=sm_70", "-v", str(path),
                                 "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
    if result.returncode != 0 or "warning" in result.stderr:
        sys.exit(f"ptxas (CUDA 12) for sm_70 failed:\n{result.stderr}")
    fn, assembled = None, 0
    for line in result.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)' for 'sm_70'", line):
            fn = lowered.get(m.group(1), m.group(1))
        elif fn and "bytes stack frame" in line:
            spill = line.split(":", 1)[-1].strip()
        elif fn and (m := re.search(r"Used (\d+) registers", line)):
            print(f"sm_70   {fn:34} {m.group(1):>4} registers | {spill}")
            fn, assembled = None, assembled + 1
    if assembled != len(KERNELS):
        sys.exit(f"expected {len(KERNELS)} kernels for sm_70, ptxas assembled {assembled}")
    print(f"{assembled} kernels compile (NVRTC, compute_70) and assemble (ptxas, sm_70) with CUDA 12.")


if __name__ == "__main__":
    main()
