"""Grader for exercise 13: python exercises/grade.py 13

The measured kernels are notebook 11's (section 7): Nsight Compute on an H100, bf16, B = 4, H = 16, N = 4096,
d = 128, non-causal, one launch each, clocks as they ran; 'tensor' and 'MUFU' are the share of cycles in which
the profiler found each unit busy.
"""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import close, load_answer  # noqa: E402

ans = load_answer(__file__)

H100 = dict(sms=132, fma_per_clock={"fp16": 2048, "fp8": 4096}, ex2_per_clock=16)
STEPS = 4 * 16 * (4096 // 128) * (4096 // 128)  # (query tile, key block) pairs of the launch
MEASURED = {  # kernel: (rate, time in us, clock in GHz, tensor busy, MUFU busy)
    "fp16 (hopper)": ("fp16", 790.94, 1.73, 0.773, 0.399),
    "fp8, V_j^T made in the kernel": ("fp8", 824.70, 1.79, 0.358, 0.392),
    "fp8, V^T from quantize": ("fp8", 723.26, 1.79, 0.409, 0.448),
}


def test_tensor_cycles():
    for B_r, B_c, d, rate in [(128, 128, 128, 2048), (128, 128, 128, 4096), (192, 128, 64, 2048), (64, 176, 128, 2048),
                              (16, 64, 256, 1024)]:
        expected, got = 2 * B_r * B_c * d / rate, ans.tensor_cycles(B_r, B_c, d, rate)
        if close(got, expected):
            continue
        hints = []
        if close(got, expected / 2):
            hints.append("half: a step has two products, S_ij = Q_i K_j^T and P_ij V_j, each B_r * B_c * d multiply-adds")
        if close(got, 2 * expected):
            hints.append("twice: FLOPs (two per multiply-add) divided by a rate of multiply-adds")
        raise AssertionError(f"tensor_cycles({B_r}, {B_c}, {d}, {rate}): expected {expected:g}, got {got!r}. "
                             + " ".join(hints))


def test_exp_cycles():
    for B_r, B_c, rate in [(128, 128, 16), (192, 128, 16), (64, 64, 16), (128, 176, 32)]:
        expected, got = B_r * B_c / rate, ans.exp_cycles(B_r, B_c, rate)
        if close(got, expected):
            continue
        hints = []
        if close(got, 2 * expected) or close(got, expected / 2):
            hints.append("one exponential per entry of P_ij, B_r * B_c of them, at ex2_per_clock each clock")
        raise AssertionError(f"exp_cycles({B_r}, {B_c}, {rate}): expected {expected:g}, got {got!r}. " + " ".join(hints))


def test_cycles_per_step():
    for time_us, ghz, steps, sms in [(790.94, 1.73, STEPS, 132), (100.0, 1.5, 13200, 132), (3.0, 2.0, 1000, 100)]:
        expected, got = time_us * ghz * 1e3 * sms / steps, ans.cycles_per_step(time_us, ghz, steps, sms)
        if close(got, expected):
            continue
        hints = []
        if close(got, expected / sms):
            hints.append("divided by all the steps: each SM ran only steps / sms of them, one after another")
        if close(got, expected * steps / sms):
            hints.append("the launch's cycles: divide by the steps one SM ran")
        for power in (-6, -3, 3, 6, 9):
            if close(got, expected * 10 ** power):
                hints.append(f"off by 10^{power}: microseconds times gigahertz is thousands of cycles")
        raise AssertionError(f"cycles_per_step({time_us}, {ghz}, {steps}, {sms}): expected {expected:g}, got {got!r}. "
                             + " ".join(hints))


def test_products_only_speedup():
    for share, faster in [(0.773, 2.0), (0.5, 2.0), (1.0, 2.0), (0.0, 2.0), (0.9, 4.0)]:
        expected, got = 1 / ((1 - share) + share / faster), ans.products_only_speedup(share, faster)
        if close(got, expected):
            continue
        hints = []
        if close(got, 1 + share * (faster - 1)) or close(got, share * faster + (1 - share)):
            hints.append("that adds speedups; add times instead: the new time is (1 - share) + share / faster")
        if close(got, (1 - share) + share / faster):
            hints.append("that is the new time (the old one being 1); the speedup is its inverse")
        raise AssertionError(f"products_only_speedup({share}, {faster}): expected {expected:g}, got {got!r}. "
                             + " ".join(hints))


@pytest.mark.parametrize("tree", [False, True])
def test_reduction_depth(tree):
    for n in [1, 2, 3, 16, 17, 32, 64, 100]:
        expected = math.ceil(math.log2(n)) if tree else n - 1
        got = ans.reduction_depth(n, tree)
        if got == expected and isinstance(got, int) and not isinstance(got, bool):
            continue
        hints = []
        if not tree and got == n:
            hints.append("a chain starting from x[0] takes n - 1 maxima (from -inf it would take n)")
        if tree and got == math.floor(math.log2(n)):
            hints.append("an odd value left over still needs one more level: round the logarithm up")
        if tree and got == n - 1:
            hints.append("that is the number of maxima, n - 1 in a tree too; the depth is the number of levels")
        if isinstance(got, float):
            hints.append("a float: count steps as an int")
        raise AssertionError(f"reduction_depth({n}, tree={tree}): expected {expected}, got {got!r}. " + " ".join(hints))


@pytest.mark.parametrize("kernel", MEASURED)
def test_the_profiler_agrees(kernel):
    """The tensor cores' least cycles over the cycles a step took is the share the profiler found them busy; the
    exponentials' share comes out a little below the profiler's MUFU share, which also counts the other instructions
    of the same pipe (the alpha of each row, reciprocals, some conversions)."""
    rate, time_us, ghz, tensor_busy, mufu_busy = MEASURED[kernel]
    step = ans.cycles_per_step(time_us, ghz, STEPS, H100["sms"])
    tensor = ans.tensor_cycles(128, 128, 128, H100["fma_per_clock"][rate]) / step
    exp = ans.exp_cycles(128, 128, H100["ex2_per_clock"]) / step
    assert abs(tensor - tensor_busy) < 0.05 and 0 < mufu_busy - exp < 0.06, (
        f"{kernel}: tensor share {tensor:.3f} (profiler {tensor_busy}), exponentials {exp:.3f} (profiler "
        f"{mufu_busy}): one of the functions above is off")
