"""Grader for exercise 14: python exercises/grade.py 14

The references are the model's rules as the grader writes them; the last check puts the answer's period next to
the cycles per key block of the hopper forward at d = 256 before K_j and V_j were freed apart, from the time Nsight
Compute measured (notebook 08, section 5).
"""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import close, load_answer  # noqa: E402

ans = load_answer(__file__)

WHY_ONE_PAIR = ("with one pair of mbarriers the stage of block n frees only when P_n V_n, issued at issue n, is done, "
                "and issue n + stages - 1 already needs K_n+stages (it starts S with the P V of the block before): "
                "two stages are in use while an issue's products run")
WHY_SPLIT = ("with K_j and V_j apart, K_n's half frees once S_n is done, but one thread copies in order, so K_n+stages "
             "waits for V_n+stages-1, which starts when P_n-1 V_n-1 (issue n - 1) is done; issue n + stages - 1 needs "
             "it: stages issues later. V_n+stages starts after P_n V_n (issue n) and issue n + stages needs it")


@pytest.mark.parametrize("split", [False, True])
def test_periods(split):
    for stages in (2, 3, 4, 6):
        expected, got = stages if split else stages - 1, ans.periods(stages, split)
        if got == expected:
            continue
        hints = [WHY_SPLIT if split else WHY_ONE_PAIR]
        if not split and got == stages:
            hints.insert(0, "one too many: the stage is not free while P V still reads V_j")
        if split and got == stages - 1:
            hints.insert(0, "the split's period is missing: K_j's half is freed one issue earlier than the whole stage")
        if split and got == stages + 1:
            hints.insert(0, "one too many: K_n+stages cannot start before the copy issued before it, V_n+stages-1")
        raise AssertionError(f"periods({stages}, split={split}): expected {expected}, got {got!r}. " + " ".join(hints))


@pytest.mark.parametrize("split", [False, True])
def test_period(split):
    for T, latency, stages in [(4.0, 3.0, 2), (4.0, 3.0, 3), (1.0, 5.0, 2), (1.0, 5.0, 4), (2.0, 0.5, 2),
                               (3.0, 9.0, 3)]:
        k = stages if split else stages - 1
        expected, got = max(T, (T + latency) / k), ans.period(T, latency, stages, split)
        if close(got, expected):
            continue
        hints = []
        if close(got, max(T, latency / k)):
            hints.append("a copy can start only once the products that read the memory are done, T after their issue: "
                         "T + latency must fit in `periods` issues")
        if close(got, (T + latency) / k) and T > (T + latency) / k:
            hints.append("no faster than T: the tensor cores need T for an issue's products")
        if close(got, T + latency):
            hints.append("every issue waits for a whole copy only when the copy has no issue to land in (periods = 1)")
        raise AssertionError(f"period(T={T}, latency={latency}, stages={stages}, split={split}): "
                             f"expected {expected:g}, got {got!r}. " + " ".join(hints))


@pytest.mark.parametrize("split", [False, True])
def test_fewest_stages(split):
    for T, latency in [(4.0, 3.0), (1.0, 5.0), (2.0, 2.0), (3.0, 0.0), (1.0, 0.5), (2048.0, 1600.0)]:
        expected = max(2, math.ceil((T + latency) / T) + (0 if split else 1))
        got = ans.fewest_stages(T, latency, split)
        if got == expected:
            continue
        hints = []
        if got == expected + 1 or got == expected - 1:
            hints.append("off by one: the least stages with (T + latency) / periods(stages, split) <= T")
        if got == 1 or got == 0:
            hints.append("at least 2: the loop runs S_i,j+1 and P_ij V_j on two blocks at once")
        raise AssertionError(f"fewest_stages(T={T}, latency={latency}, split={split}): expected {expected}, "
                             f"got {got!r}. " + " ".join(hints))


def test_stages_that_fit():
    cases = [(64, 128, 192), (96, 128, 128), (128, 128, 128), (160, 64, 128), (192, 64, 128), (256, 64, 128),
             (256, 128, 128), (64, 64, 64), (32, 64, 448)]
    for d, B_c, B_r in cases:
        panels = math.ceil(d / 64)
        need = lambda s: (B_r + 2 * s * B_c) * 128 * panels + 8 * (1 + 4 * s) + 1024
        expected = max([0] + [s for s in range(1, 64) if need(s) <= ans.SMEM_LIMIT])
        got = ans.stages_that_fit(d, B_c, B_r)
        if got == expected:
            continue
        hints = []
        if got == max([0] + [s for s in range(1, 64) if (B_r + 2 * s * B_c) * 2 * d + 8 * (1 + 4 * s) + 1024
                             <= ans.SMEM_LIMIT]):
            hints.append(f"d = {d} takes {panels} whole panels of 64 columns: a row is 128 * {panels} bytes, "
                         f"not 2 * {d}")
        if got == max([0] + [s for s in range(1, 64) if (B_r + 2 * s * B_c) * 128 * panels <= ans.SMEM_LIMIT]):
            hints.append("the mbarriers and the 1024 bytes of alignment count too")
        if got == max([0] + [s for s in range(1, 64) if (B_r + s * B_c) * 128 * panels + 8 * (1 + 4 * s) + 1024
                             <= ans.SMEM_LIMIT]):
            hints.append("a stage holds K_j and V_j: two tiles of B_c rows")
        raise AssertionError(f"stages_that_fit(d={d}, B_c={B_c}, B_r={B_r}): expected {expected}, got {got!r}. "
                             + " ".join(hints))


def test_the_kernel_at_d_256():
    """H200, bf16, B = 4, H = 8, N = 4096, non-causal: both consumers' products of a key block are
    2 * 2 * 64 * 64 * 256 multiply-adds, at 2048 a clock; before the split, with two stages, Nsight Compute measured
    1.42 ms at 1.33 GHz (notebook 08, section 5, "Two stages at d = 256"): over the 512 key blocks each SM ran (1024
    tiles of B_r = 128 rows in 8 rounds on 132 SMs, 64 key blocks of B_c = 64 a tile), about 3689 cycles a block, the
    tiles' fixed costs included. The copy's latency that the model then implies, and what it predicts with the split."""
    T = 2 * 2 * 64 * 64 * 256 / 2048
    assert ans.stages_that_fit(256, 64) == 2, "two stages fit at d = 256 (B_c = 64, B_r = 128): test_stages_that_fit"
    tiles = 4 * 8 * 4096 // 128                                # B H N / B_r
    blocks_per_sm = math.ceil(tiles / 132) * (4096 // 64)      # rounds of tiles on 132 SMs, T_c key blocks a tile
    measured = 1.42e-3 * 1.33e9 / blocks_per_sm                # cycles a key block before the split: about 3689
    latency = measured - T  # one pair, two stages: period = T + latency
    assert close(ans.period(T, latency, 2, False), measured, 1e-6), \
        f"period(T={T:g}, latency={latency:g}, 2, split=False) should be the measured {measured:.0f}: {WHY_ONE_PAIR}"
    assert close(ans.period(T, latency, 2, True), T, 1e-6), \
        f"with the split, T + latency = {T + latency:g} fits in two issues of T = {T:g}: the period is T"
    assert ans.fewest_stages(T, latency, False) == 3 and ans.fewest_stages(T, latency, True) == 2, \
        "one pair needs a third stage, which does not fit at d = 256; the split needs two"
