"""Grader for exercise 03: python exercises/grade.py 03"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)

SHAPES = [(1, 4, 4), (8, 4, 4), (10, 4, 4), (37, 8, 8), (37, 16, 4), (45, 4, 16), (64, 16, 16), (100, 64, 32),
          (130, 64, 128), (128, 128, 64), (5, 64, 64)]


def truth(N, B_r, B_c):
    """The kind of every block pair, from the mask itself (brute force)."""
    masked = torch.ones(N, N, dtype=torch.bool).triu(1)                 # masked[r][c] = c > r
    kinds = {}
    for i in range(math.ceil(N / B_r)):
        for j in range(math.ceil(N / B_c)):
            block = masked[i * B_r:(i + 1) * B_r, j * B_c:(j + 1) * B_c]
            kinds[(i, j)] = "skip" if block.all() else "full" if not block.any() else "partial"
    return kinds


@pytest.mark.parametrize("N,B_r,B_c", SHAPES)
def test_block_kind(N, B_r, B_c):
    for (i, j), expected in truth(N, B_r, B_c).items():
        got = ans.block_kind(i, j, N, B_r, B_c)
        assert got == expected, (f"block_kind(i={i}, j={j}, N={N}, B_r={B_r}, B_c={B_c}): expected {expected!r}, "
                                 f"got {got!r} (rows {i * B_r}..{min((i + 1) * B_r, N) - 1}, "
                                 f"keys {j * B_c}..{min((j + 1) * B_c, N) - 1})")


@pytest.mark.parametrize("N,B_r,B_c", SHAPES)
def test_loop_bounds(N, B_r, B_c):
    kinds = truth(N, B_r, B_c)
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    for i in range(T_r):
        expected = max(j for j in range(T_c) if kinds[(i, j)] != "skip")
        got = ans.last_key_block(i, N, B_r, B_c)
        assert got == expected, f"last_key_block(i={i}, N={N}, B_r={B_r}, B_c={B_c}): expected {expected}, got {got}"
    for j in range(T_c):
        expected = min(i for i in range(T_r) if kinds[(i, j)] != "skip")
        got = ans.first_query_block(j, N, B_r, B_c)
        assert got == expected, f"first_query_block(j={j}, N={N}, B_r={B_r}, B_c={B_c}): expected {expected}, got {got}"


def test_skipped_fraction_tends_to_one_half():
    got = ans.skipped_fraction(4096, 64, 64)
    expected = (64 * 63 / 2) / 64 ** 2                                  # 63*64/2 of 64*64 blocks lie above the diagonal
    assert abs(got - expected) < 1e-12, f"skipped_fraction(4096, 64, 64): expected {expected}, got {got}"
