"""Grader for exercise 02: python exercises/grade.py 02

The reference is dense attention in float64 (and the mask itself for the visited blocks). Likely causes
come from probes run on the answer: inputs built so that the running maximum never moves after the
first block visited, or moves in the last one, and dense attention under the mistaken masks.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import check_all, load_answer, matches, refuse_calls  # noqa: E402

import reference  # noqa: E402

ans = load_answer(__file__)
F64 = torch.float64


@pytest.fixture(autouse=True)
def no_reference_calls(monkeypatch):
    """The exercise is to write the loop over key blocks: reference.py's attention, forward, merge and mask are off
    limits."""
    refuse_calls(monkeypatch, ans, reference, ("attention", "flash_forward", "merge", "_hidden"), "exercise 02",
                 "write the loop over key blocks yourself")

# (B, H, N, d, B_r, B_c, causal): ragged N on purpose, N = 1, B_r != B_c both ways, causal on and off.
CASES = [
    (1, 1, 1, 8, 4, 4, False),
    (2, 2, 37, 16, 8, 8, False),
    (2, 2, 37, 16, 8, 8, True),
    (1, 3, 50, 8, 16, 4, True),     # B_r > B_c: the first block visited hides every key from some rows
    (1, 2, 45, 8, 4, 16, True),     # B_r < B_c
    (2, 1, 64, 32, 16, 16, True),   # N a multiple of both
    (1, 1, 33, 8, 32, 1, True),     # B_c = 1: one key per block
]


def describe(case):
    B, H, N, d, B_r, B_c, causal = case
    return f"B={B} H={H} N={N} d={d} B_r={B_r} B_c={B_c} causal={causal}"


def dense(Q, K, V, scale, mask=None):
    """O and L of attention with `mask` (True = hidden) over the scaled scores, float64."""
    S = Q @ K.transpose(-1, -2) * scale
    if mask is not None:
        S = S.masked_fill(mask, -math.inf)
    return torch.softmax(S, dim=-1) @ V, torch.logsumexp(S, dim=-1)


def causal_mask(N):
    return torch.ones(N, N, dtype=torch.bool).triu(1)


def block_local_mask(N, B_r, B_c):
    """The mask a kernel applies if it compares a key's column inside its block with the row inside its
    block (c - c0 > r - r0), on the blocks a causal forward visits (later key blocks are skipped)."""
    r, c = torch.arange(N)[:, None], torch.arange(N)[None, :]
    last_j = (torch.clamp((r // B_r + 1) * B_r, max=N) - 1) // B_c
    return (c % B_c > r % B_r) | (c // B_c > last_j)


def rescale_probe():
    """Run the answer non-causally on two inputs with B_r = B_c = 4, N = 16. 'fixed': every row's maximum
    is in the last key block, visited first, so alpha is 1 after it. 'moving': the maximum is in key
    block 0, visited last, so alpha < 1 there. Returns the causes the outcomes point at."""
    g = torch.Generator().manual_seed(9)
    Q = torch.rand(1, 1, 16, 8, generator=g, dtype=F64) + 0.5                 # positive along every axis
    results = {}
    for name, hot in [("fixed", slice(12, 16)), ("moving", slice(0, 4))]:
        K = torch.randn(1, 1, 16, 8, generator=g, dtype=F64) * 0.3
        K[..., hot, :] += 3.0                                                 # these keys win every row
        V = torch.randn(1, 1, 16, 8, generator=g, dtype=F64)
        try:
            O, L = ans.flash_forward(Q, K, V, B_r=4, B_c=4)
        except Exception:  # noqa: BLE001 (the main check reports the error itself)
            return []
        O_ref, L_ref = dense(Q, K, V, 8 ** -0.5)
        results[name] = (matches(O, O_ref, 1e-9), matches(L, L_ref, 1e-9))
    if results["fixed"] == (True, True) and results["moving"] != (True, True):
        if results["moving"][1]:
            return ["O_i is not rescaled by alpha = exp(m_i^(j-1) - m_i^(j)) when a row's maximum grows "
                    "(l_i is: L is right; probe: the maximum in the block visited last)"]
        return ["l_i is not rescaled by alpha = exp(m_i^(j-1) - m_i^(j)) when a row's maximum grows "
                "(L is wrong only when the maximum moves; check O_i's rescaling too)"]
    return []


def causes_for(O, L, Q, K, V, case, scale):
    B, H, N, d, B_r, B_c, causal = case
    causes = []
    if not (isinstance(O, torch.Tensor) and isinstance(L, torch.Tensor)):
        return causes
    if causal and (torch.isnan(O).any() or torch.isnan(L).any()):
        causes.append("NaN: a row that sees no key of the first block visited keeps m_i = -inf, and then "
                      "exp(m_i^(j-1) - m_i^(j)) = exp(-inf - (-inf)) = NaN. Until a row has seen a key, give "
                      "it a finite stand-in for m_i^(j) in the exponentials (both are then exp(-inf) = 0)")
    if causal and matches(O, dense(Q, K, V, scale)[0], 1e-9):
        causes.append("the causal mask is missing")
    if causal and N > min(B_r, B_c) and matches(O, dense(Q, K, V, scale, block_local_mask(N, B_r, B_c))[0], 1e-9):
        causes.append("the causal mask compares indices inside the block (column > row); it must compare the "
                      "absolute row r0 + row with the absolute key c0 + column")
    if scale != d ** -0.5 and matches(O, dense(Q, K, V, d ** -0.5, causal_mask(N) if causal else None)[0], 1e-9):
        causes.append("softmax_scale is ignored (the default 1/sqrt(d) was used)")
    return causes + rescale_probe()


def run_case(case, scale=None, dtype=F64, factor=1.0):
    B, H, N, d, B_r, B_c, causal = case
    g = torch.Generator().manual_seed(N * 7 + d)
    Q, K, V = (torch.randn(B, H, N, d, generator=g, dtype=F64) for _ in range(3))
    Q = Q * factor
    sc = d ** -0.5 if scale is None else scale
    O, L = ans.flash_forward(Q.to(dtype), K.to(dtype), V.to(dtype), causal=causal, softmax_scale=scale,
                             B_r=B_r, B_c=B_c)
    O_ref, L_ref = dense(Q, K, V, sc, causal_mask(N) if causal else None)
    tol = 1e-10 if dtype == F64 else 1e-4
    what = describe(case) + (f", softmax_scale={scale}" if scale is not None else "") + \
        (f", {dtype}, scores in the hundreds" if dtype != F64 else "")
    check_all(what, [("O", O, O_ref, tol), ("L", L, L_ref, tol * (1 if dtype == F64 else 100))],
              causes_for(O, L, Q, K, V, case, sc) if dtype == F64 else
              ["exp of a score in the hundreds overflows float32: subtract the running maximum"])


@pytest.mark.parametrize("case", CASES, ids=describe)
def test_matches_dense_attention_float64(case):
    run_case(case)


def test_softmax_scale_is_used():
    run_case((1, 1, 20, 8, 8, 8, True), scale=0.7)


def test_large_scores_do_not_overflow():
    run_case((1, 1, 24, 8, 8, 8, False), scale=60.0, dtype=torch.float32)


@pytest.mark.parametrize("N,B_r,B_c,causal", [(37, 8, 8, False), (50, 16, 4, True), (45, 4, 16, True),
                                              (64, 16, 16, True), (5, 64, 64, True)])
def test_visits_key_blocks_last_to_first(N, B_r, B_c, causal):
    visited = []
    Q = torch.randn(1, 1, N, 8, dtype=F64)
    ans.flash_forward(Q, Q, Q, causal=causal, B_r=B_r, B_c=B_c, visited=visited)
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    what = f"visited block pairs, N={N} B_r={B_r} B_c={B_c} causal={causal}"
    for i in range(T_r):
        r_last = min((i + 1) * B_r, N) - 1
        expected = [j for j in reversed(range(T_c)) if not causal or j * B_c <= r_last]
        got = [j for (ii, j) in visited if ii == i]
        assert got == expected, (
            f"{what}: for query block i={i} (rows {i * B_r}..{r_last}) expected key blocks {expected} in that "
            f"order, got {got}" + (" (blocks after the diagonal are entirely masked: skip them)"
                                   if causal and set(got) > set(expected) else "")
            + (" (visit them from the last to the first)" if sorted(got) == sorted(expected) else ""))
