"""Grader for exercise 12: python exercises/grade.py 12

References: dense attention in float64 for forward(); for block_update, the grader's own rule applied to the
answer's inputs, row by row (which rows should move, and what m_i, l_i, O_i then are), so that a mistake is told
by where it shows: in the rows that moved or in those that kept m_i.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import check_all, load_answer  # noqa: E402

ans = load_answer(__file__)
F64 = torch.float64


def growing_problem(N_q, N_k, d, seed, growth=4.0):
    """q, k, v (2, 3, N, d), float64; the keys' norms grow along the sequence (up to `growth` times), so that the
    row maxima keep rising and pass m_i + tau again and again."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, N_q, d, generator=g, dtype=F64)
    k = torch.randn(2, 3, N_k, d, generator=g, dtype=F64) * torch.linspace(0.3, growth, N_k, dtype=F64)[:, None]
    return q, k, torch.randn(2, 3, N_k, d, generator=g, dtype=F64)


def dense(q, k, v, causal):
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        N_q, N_k = q.shape[-2], k.shape[-2]
        S = S.masked_fill(torch.arange(N_k)[None, :] > torch.arange(N_q)[:, None] + N_k - N_q, -math.inf)
    return torch.softmax(S, dim=-1) @ v, torch.logsumexp(S, dim=-1)


def expected_step(S, V, m, l, O, tau):
    """The rule, as the grader writes it: (m, l, O, moved) after one block."""
    row_max = S.amax(dim=-1)
    moved = row_max > m + tau
    m_new = torch.where(moved, row_max, m)
    P = torch.exp2(S - m_new[..., None])
    assert float(P.max()) <= 2 ** tau * (1 + 1e-12), "grader's rule: the promise P_ij <= 2^tau does not hold"
    alpha = torch.exp2(m - m_new)
    return m_new, alpha * l + P.sum(-1), alpha[..., None] * O + P @ V, moved


@pytest.mark.parametrize("tau", [0.0, 1.0, 8.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N_q, N_k, B_c", [(37, 37, 8), (20, 53, 16), (1, 40, 7), (64, 64, 64)])
def test_forward_matches_dense_attention(N_q, N_k, B_c, causal, tau):
    q, k, v = growing_problem(N_q, N_k, 16, seed=N_q + N_k + B_c)
    O, L = ans.forward(q, k, v, causal=causal, B_c=B_c, tau=tau)
    O_ref, L_ref = dense(q, k, v, causal)
    check_all(f"forward, N_q={N_q} N_k={N_k} B_c={B_c} causal={causal} tau={tau}",
              [("O", O, O_ref, 1e-10), ("L", L, L_ref, 1e-10)],
              ["any m_i gives the same O and L if l_i and O_i are both rescaled by alpha = 2^(m_old - m_new) in the "
               "rows that moved, and P_ij = 2^(S_ij - m_i) uses the m_i the row has after the block"])


@pytest.mark.parametrize("tau", [0.0, 3.0, 8.0])
def test_block_update_row_by_row(tau):
    """The rule on a run of blocks: m_i moves exactly where rowmax > m_i + tau; what l_i and O_i then are."""
    q, k, v = growing_problem(24, 96, 16, seed=int(tau))
    S_all = q @ k.transpose(-1, -2) * (math.log2(math.e) / 4.0)
    m = torch.full(q.shape[:-1], torch.finfo(F64).min, dtype=F64)
    l, O = torch.zeros(q.shape[:-1], dtype=F64), torch.zeros_like(q)
    for j, c0 in enumerate(range(0, 96, 16)):
        S, V = S_all[..., c0:c0 + 16], v[..., c0:c0 + 16, :]
        got = ans.block_update(S, V, m.clone(), l.clone(), O.clone(), tau)
        want = expected_step(S, V, m, l, O, tau)
        if not (isinstance(got, tuple) and len(got) == 4):
            raise AssertionError(f"block_update must return (m_i, l_i, O_i, moved), got {type(got).__name__}")
        what = f"block {j} of 6 (keys {c0}..{c0 + 15}), tau={tau}"
        m_g, l_g, O_g, moved_g = got
        causes = []
        if isinstance(moved_g, torch.Tensor) and moved_g.shape == want[3].shape:
            moved_g = moved_g.bool()
            extra, missing = moved_g & ~want[3], want[3] & ~moved_g
            if extra.any() and tau > 0 and (moved_g == (S.amax(-1) > m)).all():
                causes.append("m_i moves wherever the maximum grows: tau is ignored (it may move only where the "
                              "block's maximum passes m_i + tau)")
            elif extra.any() or missing.any():
                causes.append(f"moved: {int(extra.sum())} rows moved that should not, {int(missing.sum())} did not "
                              f"that should (the rule: rowmax(S_ij) > m_i + tau)")
            kept = ~want[3]
            if isinstance(l_g, torch.Tensor) and l_g.shape == l.shape:
                bad_kept = ~torch.isclose(l_g, want[1], rtol=1e-10, atol=0) & kept & ~moved_g  # (both say kept)
                bad_moved = ~torch.isclose(l_g, want[1], rtol=1e-10, atol=0) & want[3]
                if bad_kept.any():
                    causes.append("l_i is wrong in rows that kept m_i: there alpha = 1 and P_ij = 2^(S_ij - m_i) with "
                                  "the kept m_i, not the block's own maximum")
                if bad_moved.any():
                    causes.append("l_i is wrong in rows that moved m_i: multiply the old l_i by alpha = "
                                  "2^(m_old - m_new) there")
            if isinstance(O_g, torch.Tensor) and O_g.shape == O.shape and isinstance(l_g, torch.Tensor) and \
                    l_g.shape == l.shape and torch.isclose(l_g, want[1], rtol=1e-10, atol=0).all():
                if (~torch.isclose(O_g, want[2], rtol=1e-10, atol=1e-300).all(-1) & want[3]).any():
                    causes.append("O_i is wrong in rows that moved m_i (l_i is right): rescale O_i by alpha too")
        check_all(what, [("m_i", m_g, want[0], 0.0), ("l_i", l_g, want[1], 1e-10 * float(want[1].abs().max())),
                         ("O_i", O_g, want[2], 1e-10 * float(want[2].abs().max())),
                         ("moved", moved_g.double() if isinstance(moved_g, torch.Tensor) else moved_g,
                          want[3].double(), 0.0)], causes)
        m, l, O = want[:3]


def test_tau_zero_is_the_running_maximum():
    q, k, v = growing_problem(16, 64, 8, seed=5)
    moves = []
    ans.forward(q, k, v, B_c=16, tau=0.0, moves=moves)
    S = q @ k.transpose(-1, -2)
    block_max = S.unflatten(-1, (4, 16)).amax(-1)
    running = block_max.cummax(dim=-1).values
    for j in range(1, 4):  # with tau = 0 a row moves exactly where its block maximum sets a new record
        expected = block_max[..., j] > running[..., j - 1]
        assert isinstance(moves[j], torch.Tensor) and torch.equal(moves[j].bool(), expected), \
            f"tau = 0, block {j}: moved {moves[j].int().sum() if isinstance(moves[j], torch.Tensor) else moves[j]} " \
            f"rows, expected {int(expected.sum())} (the rows whose maximum grew)"


def test_lazy_moves_far_less_often():
    """Random scores of unit variance: exact, most blocks move some row; tau = 8, none after the first."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g, dtype=F64) for n in (64, 2048, 2048))
    counts = {}
    for tau in (0.0, 8.0):
        moves = []
        ans.forward(q, k, v, B_c=128, tau=tau, moves=moves)
        counts[tau] = sum(int(ans.warps_that_rescale(m_j).sum()) for m_j in moves[1:])
    assert counts[0.0] > 20 and counts[8.0] == 0, \
        f"warp rescales after the first block: exact {counts[0.0]}, tau = 8 {counts[8.0]} (expected many, then none)"


def test_warps_that_rescale():
    g = torch.Generator().manual_seed(2)
    moved = torch.rand(2, 3, 64, generator=g) < 0.03
    for warp_rows in (16, 8):
        got = ans.warps_that_rescale(moved, warp_rows)
        want = torch.stack([moved[..., w:w + warp_rows].any(-1) for w in range(0, 64, warp_rows)], dim=-1)
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got.bool(), want), \
            f"warp_rows={warp_rows}: expected shape {tuple(want.shape)} with {int(want.sum())} warps rescaling, got " \
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else got}" \
            " (a warp rescales when ANY of its rows moved: its O_i *= alpha is one branch all lanes take)"


@pytest.mark.parametrize("dtype, tau", [(torch.float16, 15), (torch.bfloat16, 127), (torch.float8_e4m3fn, 8)])
def test_largest_safe_tau(dtype, tau):
    got = ans.largest_safe_tau(dtype)
    assert got == tau, f"{dtype}: expected {tau} (2^{tau} <= {torch.finfo(dtype).max:g} < 2^{tau + 1}), got {got}" + (
        " (the largest finite value of the dtype sets it: torch.finfo(dtype).max)" if isinstance(got, int) else "")
