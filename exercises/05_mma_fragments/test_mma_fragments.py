"""Grader for exercise 05: python exercises/grade.py 05

The expected layout is written out below as explicit tables, one cell per matrix element, the way the
PTX ISA draws it ("Matrix Fragments for mma.m16n8k16 with floating point type"), so the grader does not
share a formula with the answer. LANE tables: which lane holds the element. REG tables: register and
half, "rh" (A and B) or the register (D), with flash.cu's register numbering (a0..a3, b0..b1, d0..d3).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)

A_LANE = """
     0  0  1  1  2  2  3  3  0  0  1  1  2  2  3  3
     4  4  5  5  6  6  7  7  4  4  5  5  6  6  7  7
     8  8  9  9 10 10 11 11  8  8  9  9 10 10 11 11
    12 12 13 13 14 14 15 15 12 12 13 13 14 14 15 15
    16 16 17 17 18 18 19 19 16 16 17 17 18 18 19 19
    20 20 21 21 22 22 23 23 20 20 21 21 22 22 23 23
    24 24 25 25 26 26 27 27 24 24 25 25 26 26 27 27
    28 28 29 29 30 30 31 31 28 28 29 29 30 30 31 31
     0  0  1  1  2  2  3  3  0  0  1  1  2  2  3  3
     4  4  5  5  6  6  7  7  4  4  5  5  6  6  7  7
     8  8  9  9 10 10 11 11  8  8  9  9 10 10 11 11
    12 12 13 13 14 14 15 15 12 12 13 13 14 14 15 15
    16 16 17 17 18 18 19 19 16 16 17 17 18 18 19 19
    20 20 21 21 22 22 23 23 20 20 21 21 22 22 23 23
    24 24 25 25 26 26 27 27 24 24 25 25 26 26 27 27
    28 28 29 29 30 30 31 31 28 28 29 29 30 30 31 31
"""
A_REG = """
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    00 01 00 01 00 01 00 01 20 21 20 21 20 21 20 21
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
    10 11 10 11 10 11 10 11 30 31 30 31 30 31 30 31
"""
B_LANE = """
     0  4  8 12 16 20 24 28
     0  4  8 12 16 20 24 28
     1  5  9 13 17 21 25 29
     1  5  9 13 17 21 25 29
     2  6 10 14 18 22 26 30
     2  6 10 14 18 22 26 30
     3  7 11 15 19 23 27 31
     3  7 11 15 19 23 27 31
     0  4  8 12 16 20 24 28
     0  4  8 12 16 20 24 28
     1  5  9 13 17 21 25 29
     1  5  9 13 17 21 25 29
     2  6 10 14 18 22 26 30
     2  6 10 14 18 22 26 30
     3  7 11 15 19 23 27 31
     3  7 11 15 19 23 27 31
"""
B_REG = """
    00 00 00 00 00 00 00 00
    01 01 01 01 01 01 01 01
    00 00 00 00 00 00 00 00
    01 01 01 01 01 01 01 01
    00 00 00 00 00 00 00 00
    01 01 01 01 01 01 01 01
    00 00 00 00 00 00 00 00
    01 01 01 01 01 01 01 01
    10 10 10 10 10 10 10 10
    11 11 11 11 11 11 11 11
    10 10 10 10 10 10 10 10
    11 11 11 11 11 11 11 11
    10 10 10 10 10 10 10 10
    11 11 11 11 11 11 11 11
    10 10 10 10 10 10 10 10
    11 11 11 11 11 11 11 11
"""
D_LANE = """
     0  0  1  1  2  2  3  3
     4  4  5  5  6  6  7  7
     8  8  9  9 10 10 11 11
    12 12 13 13 14 14 15 15
    16 16 17 17 18 18 19 19
    20 20 21 21 22 22 23 23
    24 24 25 25 26 26 27 27
    28 28 29 29 30 30 31 31
     0  0  1  1  2  2  3  3
     4  4  5  5  6  6  7  7
     8  8  9  9 10 10 11 11
    12 12 13 13 14 14 15 15
    16 16 17 17 18 18 19 19
    20 20 21 21 22 22 23 23
    24 24 25 25 26 26 27 27
    28 28 29 29 30 30 31 31
"""
D_REG = """
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    0 1 0 1 0 1 0 1
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
    2 3 2 3 2 3 2 3
"""


def table(text):
    return [line.split() for line in text.strip().splitlines()]


def expected_map(lanes, regs):
    """{(lane, reg, half) or (lane, reg): (row, col)} from a LANE and a REG table."""
    out = {}
    for row, (lane_row, reg_row) in enumerate(zip(table(lanes), table(regs))):
        for col, (lane, reg) in enumerate(zip(lane_row, reg_row)):
            key = (int(lane), int(reg[0]), int(reg[1])) if len(reg) == 2 else (int(lane), int(reg))
            assert key not in out, f"grader table: {key} appears twice"
            out[key] = (row, col)
    return out


# The grader's own tables hold every element once (expected_map refuses a key seen twice): checked here, on
# loading, so that a failure below is always the answer's.
assert len(expected_map(A_LANE, A_REG)) == 256 and len(expected_map(B_LANE, B_REG)) == 128 \
    and len(expected_map(D_LANE, D_REG)) == 128, "grader tables: an element is missing"


def check(name, fn, expected):
    wrong = []
    for key, where in sorted(expected.items()):
        got = fn(*key)
        if tuple(got) != where:
            wrong.append(f"{name}({', '.join(map(str, key))}) returned {tuple(got)}, expected {where}")
    assert not wrong, f"{len(wrong)} of {len(expected)} wrong, for example:\n  " + "\n  ".join(wrong[:6])


def test_A_fragment():
    check("a_frag", ans.a_frag, expected_map(A_LANE, A_REG))


def test_B_fragment():
    check("b_frag", ans.b_frag, expected_map(B_LANE, B_REG))


def test_D_fragment():
    check("d_frag", ans.d_frag, expected_map(D_LANE, D_REG))


def test_A_owner_is_the_inverse():
    expected = {where: key for key, where in expected_map(A_LANE, A_REG).items()}
    wrong = [f"a_owner({r}, {c}) returned {tuple(ans.a_owner(r, c))}, expected {key}"
             for (r, c), key in sorted(expected.items()) if tuple(ans.a_owner(r, c)) != key]
    assert not wrong, f"{len(wrong)} of 256 wrong, for example:\n  " + "\n  ".join(wrong[:6])


def test_D_of_two_tiles_is_A_of_one():
    """Why P_ij never leaves registers in flash_fwd_ampere: D registers (d0, d1) and (d2, d3) of the S tile
    for keys 8h .. 8h+7 are exactly A registers 2h and 2h+1 (as pairs of halves) of the 16 x 16 slice."""
    for lane in range(32):
        for h in range(2):
            for reg_a, (d_lo, d_hi) in [(2 * h, (0, 1)), (2 * h + 1, (2, 3))]:
                for half, d_reg in [(0, d_lo), (1, d_hi)]:
                    row, col = ans.d_frag(lane, d_reg)
                    got = tuple(ans.a_frag(lane, reg_a, half))
                    assert got == (row, col + 8 * h), (f"lane {lane}: d{d_reg} of tile h={h} is P[{row}][{col + 8 * h}], "
                                                      f"but a_frag(lane, {reg_a}, {half}) = {got}")

