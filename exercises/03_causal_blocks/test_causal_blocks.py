"""Grader for exercise 03: python exercises/grade.py 03

The truth is the mask itself, block by block (brute force). Likely causes: the answer is compared with
the truth for a window one key wider or narrower, for no window at all, and for blocks that run past N.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)

# (N, B_r, B_c, W): ragged, B_r < B_c, B_r > B_c, N smaller than a block, windows narrower and wider than a
# block, W = 1 (each query sees only its own key), W >= N (ordinary causal).
SHAPES = [(1, 4, 4, 1), (10, 4, 4, 3), (37, 8, 8, 8), (37, 16, 4, 5), (45, 4, 16, 20), (64, 16, 16, 64),
          (100, 64, 32, 48), (130, 64, 128, 100), (128, 128, 64, 1), (5, 64, 64, 3), (200, 16, 16, 40),
          (90, 32, 8, 1000)]


def truth(N, B_r, B_c, W, N_rows=None):
    """The kind of every block pair, from the mask (masked[r][c] unless r - W < c <= r). N_rows > N
    pretends the last blocks are full (the mistake of forgetting that rows and keys stop at N)."""
    n = N_rows or N
    r, c = torch.arange(n)[:, None], torch.arange(n)[None, :]
    masked = (c > r) | (c <= r - W)
    kinds = {}
    for i in range(math.ceil(N / B_r)):
        for j in range(math.ceil(N / B_c)):
            block = masked[i * B_r:(i + 1) * B_r, j * B_c:(j + 1) * B_c]
            kinds[(i, j)] = "skip" if block.all() else "full" if not block.any() else "partial"
    return kinds


def alternatives(N, B_r, B_c, W):
    """{cause: kinds} for the mistakes this grader recognises."""
    T = max(B_r, B_c) * (math.ceil(N / min(B_r, B_c)) + 1)
    return {"the window edge is off by one: key c is visible when r - W < c, so c = r - W is masked (W keys, "
            "r itself included)": truth(N, B_r, B_c, W + 1),
            "the window edge is off by one the other way: r - W + 1 is the oldest visible key": truth(N, B_r, B_c, W - 1)
            if W > 1 else None,
            "the window is ignored (that is ordinary causal attention)": truth(N, B_r, B_c, 10 ** 9),
            "the last block's rows or keys are taken to run past N: the last real one is min((i+1)*B, N) - 1":
            truth(N, B_r, B_c, W, N_rows=T)}


def describe(N, B_r, B_c, W):
    return f"N={N}, B_r={B_r}, B_c={B_c}, W={W}"


@pytest.mark.parametrize("N,B_r,B_c,W", SHAPES)
def test_block_kind(N, B_r, B_c, W):
    expected = truth(N, B_r, B_c, W)
    got = {p: ans.block_kind(*p, N, B_r, B_c, W) for p in expected}
    wrong = [p for p in expected if got[p] != expected[p]]
    if wrong:
        lines = [f"block_kind(i={i}, j={j}): expected {expected[(i, j)]!r}, got {got[(i, j)]!r} (rows "
                 f"{i * B_r}..{min((i + 1) * B_r, N) - 1}, keys {j * B_c}..{min((j + 1) * B_c, N) - 1})"
                 for i, j in wrong[:6]]
        causes = [c for c, kinds in alternatives(N, B_r, B_c, W).items() if kinds == got]
        raise AssertionError(f"{describe(N, B_r, B_c, W)}: {len(wrong)} of {len(expected)} block pairs wrong, "
                             f"for example\n  " + "\n  ".join(lines)
                             + ("\nlikely cause:\n  " + "\n  ".join(causes) if causes else ""))


def bounds(kinds, N, B_r, B_c):
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    fwd = {i: (min(j for j in range(T_c) if kinds[(i, j)] != "skip"), max(j for j in range(T_c) if kinds[(i, j)] != "skip"))
           for i in range(T_r)}
    bwd = {j: (min(i for i in range(T_r) if kinds[(i, j)] != "skip"), max(i for i in range(T_r) if kinds[(i, j)] != "skip"))
           for j in range(T_c)}
    return fwd, bwd


@pytest.mark.parametrize("N,B_r,B_c,W", SHAPES)
def test_loop_bounds(N, B_r, B_c, W):
    fwd, bwd = bounds(truth(N, B_r, B_c, W), N, B_r, B_c)
    got_fwd = {i: tuple(ans.key_block_range(i, N, B_r, B_c, W)) for i in fwd}
    got_bwd = {j: tuple(ans.query_block_range(j, N, B_r, B_c, W)) for j in bwd}
    lines = [f"key_block_range(i={i}): expected (first_j, last_j) = {fwd[i]}, got {got_fwd[i]}"
             for i in fwd if got_fwd[i] != fwd[i]]
    lines += [f"query_block_range(j={j}): expected (first_i, last_i) = {bwd[j]}, got {got_bwd[j]}"
              for j in bwd if got_bwd[j] != bwd[j]]
    if lines:
        causes = []
        for cause, kinds in alternatives(N, B_r, B_c, W).items():
            if kinds is None:
                continue
            try:
                alt_fwd, alt_bwd = bounds(kinds, N, B_r, B_c)
            except ValueError:                      # a row with no visible block under this mistake
                continue
            if (alt_fwd == got_fwd and alt_fwd != fwd) or (alt_bwd == got_bwd and alt_bwd != bwd):
                causes.append(cause)
        T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
        if any(b[1] > T_r - 1 for b in got_bwd.values()) or any(b[1] > T_c - 1 for b in got_fwd.values()):
            causes.append(f"a last block index past the last block (T_r - 1 = {T_r - 1}, T_c - 1 = {T_c - 1}): the "
                          f"window reaches past N, the blocks do not")
        raise AssertionError(f"{describe(N, B_r, B_c, W)}: {len(lines)} loop bounds wrong, for example\n  "
                             + "\n  ".join(lines[:6]) + ("\nlikely cause:\n  " + "\n  ".join(causes) if causes else ""))


def test_computed_fraction():
    """Ordinary causal attention computes about half the pairs; a window of W keys about W / N of them."""
    for N, W in [(2048, 2048), (2048, 256), (2048, 100)]:
        kinds = truth(N, 64, 64, W)
        expected = 1 - sum(v == "skip" for v in kinds.values()) / len(kinds)
        got = ans.computed_fraction(N, 64, 64, W)
        assert abs(got - expected) < 1e-12, f"computed_fraction(N={N}, 64, 64, W={W}): expected {expected:.6f}, got {got}"
