"""Grader for exercise 07: python exercises/grade.py 07

Three checks of the kernel file:
  - it compiles with nvcc for sm_80 (a few seconds; skipped without nvcc). The starter compiles as given:
    this check catches what an edit breaks, and it does not pass alone (below);
  - on the CPU: the kernel, cut before its launcher, is built as C++ with the small CUDA stand-in in cpu/
    (one std::thread per CUDA thread, __syncthreads() a real barrier) and run on every case; this
    grades a machine without a GPU (skipped without a C++ compiler, or for a kernel that calls warp
    shuffles or atomics, which the stand-in does not have: such a kernel is graded on a GPU);
  - on a GPU: binding.cpp + the kernel built with torch.utils.cpp_extension.load and run on every case
    (skipped without a CUDA GPU).
O and L are compared with dense attention in float64. If neither the CPU nor the GPU run was possible,
the kernel was not checked, and the grader says NOT GRADED and fails rather than pass a compile check.
"""
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import ROOT, answer_path, check_all, grading_solutions, matches  # noqa: E402

HERE = Path(__file__).resolve().parent
KERNEL = answer_path(__file__, "starter.cu")
CXX = next((c for c in [os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++"), shutil.which("clang++")]
            if c), None)
HAS_GPU = torch.cuda.is_available()


def gpu_only_calls(source):
    """The warp shuffles and atomics the kernel calls (comments left out): the CPU stand-in has none of them."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)
    return sorted(set(re.findall(r"\b(__shfl\w*|atomic\w*)\s*\(", code)))


GPU_ONLY = gpu_only_calls(KERNEL.read_text())
WHY_NOT_ON_CPU = (f"your kernel calls {', '.join(GPU_ONLY)}, which the CPU stand-in does not have: it is graded "
                  f"on a GPU" if GPU_ONLY else "no C++ compiler: c++, g++ or clang++; or set CXX")
RUNS_ON_CPU = CXX is not None and not GPU_ONLY


def find_nvcc():
    from torch.utils.cpp_extension import CUDA_HOME
    candidates = [shutil.which("nvcc")] + ([os.path.join(CUDA_HOME, "bin", "nvcc")] if CUDA_HOME else [])
    return next((c for c in candidates if c and os.path.exists(c)), None)


def test_compiles_with_nvcc(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("the sm_80 compile check (nvcc not found: not on PATH, no CUDA_HOME)")
    import torch.utils.cpp_extension as ext
    includes = ["-I" + p for p in ext.include_paths() + [sysconfig.get_paths()["include"]]]
    cmd = [nvcc, "-std=c++17", "-O3", "-c", str(KERNEL), "-o", str(tmp_path / "kernel.o"), *includes,
           "-gencode=arch=compute_80,code=sm_80", "-Xptxas", "-v"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc could not compile {KERNEL.name}:\n{result.stderr[-4000:]}"
    print(f"{KERNEL.name} compiles for sm_80; ptxas:\n" + "\n".join(
        line for line in result.stderr.splitlines() if "registers" in line or "spill" in line))
    # a compile check alone grades nothing: it passes only where the kernel also runs, on the CPU or a GPU
    assert HAS_GPU or RUNS_ON_CPU, (f"NOT GRADED: your kernel compiles, but was not run: no CUDA GPU here, and "
                                    f"no CPU run ({WHY_NOT_ON_CPU})")


@pytest.fixture(scope="module")
def cpu_emulation():
    """Path of the CPU build of the kernel (cached in build/ by a hash of the sources)."""
    if not RUNS_ON_CPU:
        pytest.skip(f"the CPU run ({WHY_NOT_ON_CPU})")
    source = KERNEL.read_text()
    cut = source.find('\nextern "C"')
    assert cut > 0, f"{KERNEL.name}: the extern \"C\" launcher at the bottom is missing (it is given: restore it)"
    digest = hashlib.sha1((source + (HERE / "cpu" / "emulate.cpp").read_text() +
                           (HERE / "cpu" / "cuda_runtime.h").read_text()).encode()).hexdigest()[:10]
    build = ROOT / "build" / f"exercise07_cpu_{'solution' if grading_solutions() else 'starter'}_{digest}"
    exe = build / "emulate"
    if not exe.exists():
        build.mkdir(parents=True, exist_ok=True)
        (build / "kernel.inc").write_text(source[:cut])
        cmd = [CXX, "-std=c++17", "-O2", "-pthread", "-w", f"-I{HERE / 'cpu'}", f"-I{build}",
               str(HERE / "cpu" / "emulate.cpp"), "-o", str(exe) + ".tmp"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (
            f"{KERNEL.name} does not compile as C++ for the CPU run (the CPU stand-in for CUDA knows threadIdx, "
            f"blockIdx, __shared__, __syncthreads() and the float math functions; warp shuffles and atomics are "
            f"for a GPU). The compiler said:\n" + result.stderr.replace(str(build / "kernel.inc"), KERNEL.name)[-3000:])
        os.replace(str(exe) + ".tmp", exe)
    return exe


def run_on_cpu(exe, Q, K, V, causal, scale):
    B, H, N, d = Q.shape
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        torch.cat([x.float().contiguous().flatten() for x in (Q, K, V)]).numpy().tofile(inp)
        result = subprocess.run([str(exe), str(N), str(d), str(B * H), repr(scale * math.log2(math.e)),
                                 str(int(causal)), str(inp), str(out)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (f"the CPU run of your kernel stopped (exit {result.returncode}): "
                                        f"{result.stderr.strip()[-2000:] or 'a crash, e.g. a read or write out of bounds'}")
        flat = torch.from_numpy(__import__("numpy").fromfile(out, dtype="float32")).double()
    return flat[:B * H * N * d].view(B, H, N, d), flat[B * H * N * d:].view(B, H, N)


@pytest.fixture(scope="module")
def extension():
    if not HAS_GPU:
        pytest.skip("the GPU run (no CUDA GPU here)")
    from torch.utils.cpp_extension import load
    digest = hashlib.sha1(KERNEL.read_bytes() + (HERE / "binding.cpp").read_bytes()).hexdigest()[:10]
    name = f"exercise07_{'solution' if grading_solutions() else 'starter'}_{digest}"
    build = ROOT / "build" / name
    build.mkdir(parents=True, exist_ok=True)
    import main  # (its _cxx_runtime: the process's libstdc++, so that an error with a number raises, not crashes)
    return load(name=name, sources=[str(HERE / "binding.cpp"), str(KERNEL)], build_directory=str(build),
                extra_cuda_cflags=["-O3"], extra_ldflags=main._cxx_runtime())


def run_on_gpu(ext, Q, K, V, causal, scale):
    O, L = ext.forward(Q.float().cuda(), K.float().cuda(), V.float().cuda(), causal, scale,
                       torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return O.double().cpu(), L.double().cpu()


def dense(Q, K, V, scale, mask=None):
    S = Q @ K.transpose(-1, -2) * scale
    if mask is not None:
        S = S.masked_fill(mask, -math.inf)
    return torch.softmax(S, dim=-1) @ V, torch.logsumexp(S, dim=-1)


def causes_for(O, L, Q, K, V, N, causal, scale):
    """Mistakes recognised by what they produce, computed densely."""
    causes = []
    full = torch.ones(N, N, dtype=torch.bool)
    if (L == -math.inf).all():
        causes.append("l_i is 0 at the end in every row (L = log 0 = -inf, O = 0 / 0 = NaN): the online softmax "
                      "update (TODO 2) adds nothing to l_i")
    elif not (torch.isfinite(O).all() and torch.isfinite(L).all()):
        causes.append("inf/NaN: a key past N or a masked key must get -INFINITY in S_ij (then exp2f gives exactly "
                      "0), and every exponent needs the row's maximum subtracted first")
    if matches(L, dense(Q, K, V, scale, full.triu(1) if causal else None)[1] * math.log2(math.e), 2e-4):
        causes.append("L is in base 2: the given last line converts m_i + log2(l_i) to natural log; keep m_i "
                      "in base-2 units (scores times scale_log2) and l_i as the sum of exp2f")
    if matches(O, dense(Q, K, V, scale * math.log2(math.e), full.triu(1) if causal else None)[0], 2e-4):
        causes.append("expf where exp2f belongs: the scores are in base-2 units (times scale_log2), so "
                      "P_ij = exp2f(S_ij - m_new) and alpha = exp2f(m_i - m_new)")
    if causal and matches(O, dense(Q, K, V, scale)[0], 2e-4):
        causes.append("the causal mask is missing (key col0 + c > row r must get -INFINITY)")
    r, c = torch.arange(N)[:, None], torch.arange(N)[None, :]
    if causal and N > 32 and matches(O, dense(Q, K, V, scale, (c % 32) > (r % 64))[0], 2e-4):
        causes.append("the causal mask compares c with r_loc: use absolute indices, key col0 + c and row r")
    # Without alpha: each key block's terms stay scaled by the running maximum of their own iteration.
    S = Q @ K.transpose(-1, -2) * scale                                     # (B, H, N, N)
    if causal:
        S = S.masked_fill(full.triu(1), -math.inf)
    T_c = -(-N // 32)
    pad = torch.full((*S.shape[:-1], T_c * 32 - N), -math.inf, dtype=S.dtype)
    running = torch.cat([S, pad], -1).view(*S.shape[:-1], T_c, 32).amax(-1).cummax(-1).values   # m_i^(j)
    m_at = running.repeat_interleave(32, -1)[..., :N]                       # m_i^(j) of each key's block
    m_end = running[..., -1:]
    l_true = torch.exp(S - m_end).sum(-1)
    if matches(O, (torch.exp(S - m_at) @ V) / l_true[..., None], 2e-4) and not matches(O, dense(Q, K, V, scale, full.triu(1) if causal else None)[0], 2e-4):
        causes.append("O_i is not rescaled by alpha = exp2f(m_i - m_new) when the row's maximum grows")
    if matches(L, m_end[..., 0] + torch.log(torch.exp(S - m_at).sum(-1)), 2e-4) and not matches(L, dense(Q, K, V, scale, full.triu(1) if causal else None)[1], 2e-4):
        causes.append("l_i is not rescaled by alpha = exp2f(m_i - m_new) when the row's maximum grows")
    return causes


CASES = [(1, 1, 1, 16, False), (1, 1, 1, 16, True), (2, 3, 100, 32, False), (2, 3, 100, 32, True),
         (1, 2, 257, 64, False), (1, 2, 257, 64, True), (2, 2, 64, 64, True), (1, 1, 31, 16, True)]


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("B,H,N,d,causal", CASES)
def test_matches_reference_float64(request, device, B, H, N, d, causal):
    runner = request.getfixturevalue("cpu_emulation" if device == "cpu" else "extension")
    what = f"your kernel run on the {device.upper()}, B={B} H={H} N={N} d={d} causal={causal}"
    g = torch.Generator().manual_seed(N * 10 + d)
    Q, K, V = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(3))
    Q, K, V = (x.float().double() for x in (Q, K, V))           # what the float32 kernel sees, exactly
    scale = 1.0 / math.sqrt(d)
    O, L = (run_on_cpu if device == "cpu" else run_on_gpu)(runner, Q, K, V, causal, scale)
    O_ref, L_ref = dense(Q, K, V, scale, torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None)
    check_all(what, [("O", O, O_ref, 1e-4), ("L", L, L_ref, 1e-4)], causes_for(O, L, Q, K, V, N, causal, scale))
