"""Grader for exercise 02: python exercises/grade.py 02"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

import reference  # noqa: E402

ans = load_answer(__file__)

# (B, H, N, d, B_r, B_c, causal): ragged N on purpose, N = 1, B_r != B_c both ways, causal on and off.
CASES = [
    (1, 1, 1, 8, 4, 4, False),
    (2, 2, 37, 16, 8, 8, False),
    (2, 2, 37, 16, 8, 8, True),
    (1, 3, 50, 8, 16, 4, True),     # B_r > B_c: some rows of a query block see none of a key block
    (1, 2, 45, 8, 4, 16, True),     # B_r < B_c
    (2, 1, 64, 32, 16, 16, True),   # N a multiple of both
    (1, 1, 33, 8, 32, 1, True),     # B_c = 1: one key per block
]


def describe(case):
    B, H, N, d, B_r, B_c, causal = case
    return f"B={B} H={H} N={N} d={d} B_r={B_r} B_c={B_c} causal={causal}"


@pytest.mark.parametrize("case", CASES, ids=describe)
def test_matches_dense_attention_float64(case):
    B, H, N, d, B_r, B_c, causal = case
    g = torch.Generator().manual_seed(N * 7 + d)
    Q, K, V = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(3))
    O, L = ans.flash_forward(Q, K, V, causal=causal, B_r=B_r, B_c=B_c)
    O_ref = reference.attention(Q, K, V, causal=causal)
    S = Q @ K.transpose(-1, -2) / math.sqrt(d)
    if causal:
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    L_ref = torch.logsumexp(S, dim=-1)
    for name, got, exp in [("O", O, O_ref), ("L", L, L_ref)]:
        assert not torch.isnan(got).any(), f"{describe(case)}: {name} contains NaN"
        err = (got - exp).abs()
        assert err.max().item() < 1e-10, (
            f"{describe(case)}: {name} differs from dense attention by {err.max().item():.3e} (float64, expected "
            f"< 1e-10); worst at index {tuple(int(k) for k in (err == err.max()).nonzero()[0])} of shape "
            f"{tuple(got.shape)}: expected {exp[err == err.max()][0].item():.10g}, got {got[err == err.max()][0].item():.10g}")


def test_softmax_scale_is_used():
    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(1, 1, 20, 8, generator=g, dtype=torch.float64) for _ in range(3))
    O, _ = ans.flash_forward(Q, K, V, softmax_scale=0.7, B_r=8, B_c=8)
    err = (O - reference.attention(Q, K, V, softmax_scale=0.7)).abs().max().item()
    assert err < 1e-10, f"softmax_scale=0.7, N=20: O differs from dense attention by {err:.3e}"


def test_large_scores_do_not_overflow():
    g = torch.Generator().manual_seed(6)
    Q, K, V = (torch.randn(1, 1, 24, 8, generator=g, dtype=torch.float32) for _ in range(3))
    O, _ = ans.flash_forward(Q, K, V, softmax_scale=60.0, B_r=8, B_c=8)   # scores in the hundreds: exp overflows
    O_ref = reference.attention(Q.double(), K.double(), V.double(), softmax_scale=60.0)
    assert torch.isfinite(O).all(), "float32, scores up to a few hundred: O has inf/NaN (subtract the row max)"
    err = (O.double() - O_ref).abs().max().item()
    assert err < 1e-4, f"float32, softmax_scale=60: O differs from dense float64 attention by {err:.3e}"

