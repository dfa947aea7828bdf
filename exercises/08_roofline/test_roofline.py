"""Grader for exercise 08: python exercises/grade.py 08"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)

H200 = dict(fp16=989.4, fp32=66.9, bandwidth=4.8e12)      # bench.py's peak table and the H200 datasheet
A100 = dict(fp16=312.0, fp32=19.5, bandwidth=2.039e12)    # A100 SXM 80 GB
SHAPES = [(4, 16, 4096, 128), (16, 12, 1024, 64), (1, 16, 16384, 128), (8, 8, 512, 64)]


def near(got, expected, what, rel=1e-9):
    assert abs(got - expected) <= rel * abs(expected), f"{what}: expected {expected:.6g}, got {got!r}"


def roof(flops, nbytes, peak, bw):
    t = max(flops / (peak * 1e12), nbytes / bw)
    return t, "compute" if flops / (peak * 1e12) >= nbytes / bw else "memory"


@pytest.mark.parametrize("B,H,N,d", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_is_the_standard_count(B, H, N, d, causal):
    import bench
    near(ans.attention_flops(B, H, N, d, causal), bench.attention_flops(B, H, N, d, causal, "fwd"),
         f"attention_flops(B={B}, H={H}, N={N}, d={d}, causal={causal}) against bench.attention_flops")


def test_bound_time():
    for flops, nbytes, peak, bw, expected in [(1e12, 1e9, 1000.0, 1e12, (1e-3, "compute")),
                                               (1e12, 4e9, 1000.0, 1e12, (4e-3, "memory")),
                                               (2e12, 2e9, 1000.0, 1e12, (2e-3, "compute"))]:
        t, kind = ans.bound_time(flops, nbytes, peak, bw)
        near(t, expected[0], f"bound_time({flops:g} FLOP, {nbytes:g} B, {peak} TFLOP/s, {bw:g} B/s) seconds")
        assert kind == expected[1], f"bound_time({flops:g}, {nbytes:g}, {peak}, {bw:g}): expected {expected[1]!r}, got {kind!r}"


def test_worked_example_h200_fp16():
    """B=4, H=16, N=4096, d=128, fp16 on an H200: the softmax pass alone takes longer than the whole fused forward."""
    f, m, t, kind = ans.softmax_pass(4, 16, 4096, 2, H200["fp16"], H200["bandwidth"])
    near(m, 4 * 16 * 2 * 4096 ** 2 * 2, "softmax_pass bytes")
    near(t, 4 * 16 * 2 * 4096 ** 2 * 2 / 4.8e12, "softmax_pass seconds (0.895 ms)")
    assert kind == "memory", f"softmax_pass: expected 'memory', got {kind!r}"
    f, m, t, kind = ans.fused_forward(4, 16, 4096, 128, 2, H200["fp16"], H200["bandwidth"])
    near(t, 4 * 4 * 16 * 4096 ** 2 * 128 / 989.4e12, "fused_forward seconds (0.556 ms)")
    assert kind == "compute", f"fused_forward: expected 'compute', got {kind!r}"


@pytest.mark.parametrize("B,H,N,d", SHAPES)
@pytest.mark.parametrize("gpu,dtype,b", [("H200", "fp16", 2), ("H200", "fp32", 4), ("A100", "fp16", 2)])
def test_all_shapes(B, H, N, d, gpu, dtype, b):
    hw = {"H200": H200, "A100": A100}[gpu]
    peak, bw = hw[dtype], hw["bandwidth"]
    what = f"{gpu} {dtype}, B={B} H={H} N={N} d={d}"
    rows = B * H
    # softmax pass
    exp = (5.0 * rows * N * N, 2.0 * rows * N * N * b)
    got = ans.softmax_pass(B, H, N, b, peak, bw)
    near(got[0], exp[0], f"{what}: softmax_pass FLOPs")
    near(got[1], exp[1], f"{what}: softmax_pass bytes")
    t, kind = roof(*exp, peak, bw)
    near(got[2], t, f"{what}: softmax_pass seconds")
    assert got[3] == kind, f"{what}: softmax_pass bound: expected {kind!r}, got {got[3]!r}"
    # fused forward, causal and not (the bytes do not change with causal)
    for causal in (False, True):
        exp = (4.0 * rows * N * N * d / (2 if causal else 1), rows * (4.0 * N * d * b + 4.0 * N))
        got = ans.fused_forward(B, H, N, d, b, peak, bw, causal=causal)
        near(got[0], exp[0], f"{what}, causal={causal}: fused_forward FLOPs")
        near(got[1], exp[1], f"{what}, causal={causal}: fused_forward bytes")
        t, kind = roof(*exp, peak, bw)
        near(got[2], t, f"{what}, causal={causal}: fused_forward seconds")
        assert got[3] == kind, f"{what}, causal={causal}: fused_forward bound: expected {kind!r}, got {got[3]!r}"
    # manual attention, kernel by kernel
    NN, Nd = rows * N * N, rows * N * d
    kernels = [(2.0 * NN * d, (2 * Nd + NN) * b), (NN, 2.0 * NN * b), (5.0 * NN, 2.0 * NN * b), (2.0 * NN * d, (NN + 2 * Nd) * b)]
    expected = sum(roof(f, m, peak, bw)[0] for f, m in kernels)
    near(ans.manual_forward(B, H, N, d, b, peak, bw), expected, f"{what}: manual_forward seconds")
