"""Grader for exercise 06: python exercises/grade.py 06"""
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)


def degree(addresses, width):
    """The grader's own count: cycles per phase = max over banks of distinct 4-byte words."""
    n = 128 // width
    phases = [addresses[i:i + n] for i in range(0, len(addresses), n)]
    result = 1
    for phase in phases:
        words = {a // 4 + w for a in phase for w in range(width // 4)}          # distinct words: broadcast
        result = max(result, max(Counter(word % 32 for word in words).values()))
    return result


def test_bank():
    for a, expected in [(0, 0), (3, 0), (4, 1), (124, 31), (128, 0), (132, 1), (4096 + 40, 10)]:
        assert ans.bank(a) == expected, f"bank({a}): expected {expected}, got {ans.bank(a)}"


@pytest.mark.parametrize("name,addresses,width,expected", [
    ("32 consecutive floats", [4 * t for t in range(32)], 4, 1),
    ("every thread the same float (broadcast)", [64] * 32, 4, 1),
    ("float stride 2", [8 * t for t in range(32)], 4, 2),
    ("float stride 32 (a column of a 32-wide fp32 tile)", [128 * t for t in range(32)], 4, 32),
    ("float stride 33 (the same, padded)", [132 * t for t in range(32)], 4, 1),
    ("consecutive float2", [8 * t for t in range(32)], 8, 1),
    ("consecutive float4", [16 * t for t in range(32)], 16, 1),
    ("float4, 8 threads on one address", [0] * 8 + [16 * t for t in range(8, 32)], 16, 1),
])
def test_conflict_degree_known_cases(name, addresses, width, expected):
    got = ans.conflict_degree(addresses, width)
    assert got == expected, f"conflict_degree, {name}, width {width}: expected {expected}, got {got}"


def test_conflict_degree_random_patterns():
    rng = random.Random(0)
    for trial in range(300):
        width = rng.choice([4, 8, 16])
        n = rng.choice([8, 16, 32])
        addresses = [width * rng.randrange(0, 96) for _ in range(n)]          # small range: many collisions
        expected, got = degree(addresses, width), ans.conflict_degree(addresses, width)
        assert got == expected, f"conflict_degree({addresses}, width={width}): expected {expected}, got {got}"


def test_ldmatrix_addresses_and_padding():
    got = ans.ldmatrix_row_addresses(64)
    assert got == [128 * r for r in range(8)], f"ldmatrix_row_addresses(64): expected {[128 * r for r in range(8)]}, got {got}"
    got = ans.ldmatrix_row_addresses(72, col_halfs=8)
    expected = [2 * (72 * r + 8) for r in range(8)]
    assert got == expected, f"ldmatrix_row_addresses(72, col_halfs=8): expected {expected}, got {got}"
    for stride, expected in [(64, 8), (72, 1), (128, 8), (136, 1), (96, 4), (80, 2)]:
        got = ans.conflict_degree(ans.ldmatrix_row_addresses(stride), 16)
        assert got == expected, f"ldmatrix on an fp16 tile with row stride {stride} halfs: expected {expected}-way, got {got}"


@pytest.mark.parametrize("stride,expected", [(64, 8), (128, 8), (72, 0), (96, 8), (80, 8), (40, 0)])
def test_smallest_padding(stride, expected):
    got = ans.smallest_padding(stride)
    assert got == expected, f"smallest_padding({stride}): expected {expected} halfs, got {got}"


@pytest.mark.parametrize("d", [16, 32, 64, 96, 128])
def test_fp32_kernel_padding_claim(d):
    """flash.cu pads fp32 rows to ld = d + 4 and says thread_tile_XYt's float4 reads are then conflict-free."""
    for ld, what in [(d, "unpadded"), (d + 4, "padded, ld = d + 4")]:
        addresses = [4 * (tx * ld) for tx in range(16)]
        got_addresses = ans.float4_column_addresses(ld)
        assert got_addresses == addresses, f"float4_column_addresses({ld}): expected {addresses}, got {got_addresses}"
        expected, got = degree(addresses, 16), ans.conflict_degree(addresses, 16)
        assert got == expected, f"d = {d}, {what}: expected {expected}-way, got {got}"
    assert degree([4 * tx * (d + 4) for tx in range(16)], 16) == 1
