"""Grader for exercise 07: python exercises/grade.py 07

Two checks: the kernel file compiles with nvcc for sm_80 (CPU only, a few seconds; skipped if nvcc is
missing), and on a GPU it is built with torch.utils.cpp_extension.load (with binding.cpp) and compared
with reference.attention in float64 (skipped, visibly, without a CUDA GPU).
"""
import hashlib
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import ROOT, answer_path, grading_solutions  # noqa: E402

import reference  # noqa: E402

HERE = Path(__file__).resolve().parent
KERNEL = answer_path(__file__, "starter.cu")


def find_nvcc():
    from torch.utils.cpp_extension import CUDA_HOME
    candidates = [shutil.which("nvcc")] + ([os.path.join(CUDA_HOME, "bin", "nvcc")] if CUDA_HOME else [])
    return next((c for c in candidates if c and os.path.exists(c)), None)


def test_compiles_with_nvcc(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (not on PATH, no CUDA_HOME): the compile check did not run")
    import torch.utils.cpp_extension as ext
    includes = ["-I" + p for p in ext.include_paths() + [sysconfig.get_paths()["include"]]]
    cmd = [nvcc, "-std=c++17", "-O3", "-c", str(KERNEL), "-o", str(tmp_path / "kernel.o"), *includes,
           "-gencode=arch=compute_80,code=sm_80", "-Xptxas", "-v"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc could not compile {KERNEL}:\n{result.stderr[-4000:]}"
    print(f"{KERNEL.name} compiles for sm_80; ptxas:\n" + "\n".join(
        line for line in result.stderr.splitlines() if "registers" in line or "spill" in line))


@pytest.fixture(scope="module")
def extension():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the kernel was not run (only the compile check ran)")
    from torch.utils.cpp_extension import load
    digest = hashlib.sha1(KERNEL.read_bytes() + (HERE / "binding.cpp").read_bytes()).hexdigest()[:10]
    name = f"exercise07_{'solution' if grading_solutions() else 'starter'}_{digest}"
    build = ROOT / "build" / name
    build.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(HERE / "binding.cpp"), str(KERNEL)], build_directory=str(build),
                extra_cuda_cflags=["-O3"])


CASES = [(1, 1, 1, 16, False), (1, 1, 1, 16, True), (2, 3, 100, 32, False), (2, 3, 100, 32, True),
         (1, 2, 257, 64, False), (1, 2, 257, 64, True), (2, 2, 64, 64, True), (1, 1, 31, 16, True)]


@pytest.mark.parametrize("B,H,N,d,causal", CASES)
def test_matches_reference_float64(extension, B, H, N, d, causal):
    what = f"B={B} H={H} N={N} d={d} causal={causal}"
    g = torch.Generator().manual_seed(N * 10 + d)
    Q, K, V = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    O, L = extension.forward(Q.float().cuda(), K.float().cuda(), V.float().cuda(), causal, scale,
                             torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    O_ref = reference.attention(Q, K, V, causal=causal)
    S = Q @ K.transpose(-1, -2) * scale
    if causal:
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    L_ref = torch.logsumexp(S, dim=-1)
    for name, got, ref in [("O", O.double().cpu(), O_ref), ("L", L.double().cpu(), L_ref)]:
        assert torch.isfinite(got).all(), f"{what}: {name} has inf/NaN, e.g. {got.flatten()[:4].tolist()}"
        err = (got - ref).abs()
        worst = err.flatten().argmax().item()
        assert err.max().item() < 1e-4, (f"{what}: {name} differs from float64 by {err.max().item():.2e} at flat index "
                                         f"{worst}: expected {ref.flatten()[worst].item():.6f}, got {got.flatten()[worst].item():.6f}")
