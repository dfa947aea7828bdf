"""Grader for exercise 01: python exercises/grade.py 01"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)


def partial(s, V):
    """(m, l, O~) of rows of scores s (..., N_q, n_keys) over values V (..., n_keys, d), dense, float64."""
    if s.shape[-1] == 0:
        m = torch.full(s.shape[:-1], -math.inf, dtype=s.dtype)
        return m, torch.zeros_like(m), torch.zeros(*s.shape[:-1], V.shape[-1], dtype=s.dtype)
    m = s.amax(dim=-1)
    P = torch.exp(s - m[..., None])
    return m, P.sum(dim=-1), P @ V


def check(name, got, expected, what):
    assert got.shape == expected.shape, f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    assert not torch.isnan(got).any(), f"{what}: {name} contains NaN: {got.flatten()[:6].tolist()}"
    ok = torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    if not ok:
        i = (got - expected).abs().flatten().argmax().item()
        raise AssertionError(f"{what}: {name} differs; at flat index {i} expected {expected.flatten()[i].item():.12g}, "
                             f"got {got.flatten()[i].item():.12g}")


@pytest.mark.parametrize("n_keys,split", [(10, 4), (33, 1), (33, 32), (64, 40)])
def test_merge_equals_dense(n_keys, split):
    g = torch.Generator().manual_seed(n_keys * 100 + split)
    s = 3 * torch.randn(2, 3, 5, n_keys, generator=g, dtype=torch.float64)      # (B, H, N_q, n_keys)
    V = torch.randn(2, 3, n_keys, 7, generator=g, dtype=torch.float64)          # (B, H, n_keys, d)
    what = f"merge of keys [0, {split}) and [{split}, {n_keys})"
    m, l, O = ans.merge(partial(s[..., :split], V[..., :split, :]), partial(s[..., split:], V[..., split:, :]))
    m_ref, l_ref, O_ref = partial(s, V)
    check("m", m, m_ref, what)
    check("l", l, l_ref, what)
    check("O~", O, O_ref, what)
    check("O~ / l", O / l[..., None], torch.softmax(s, dim=-1) @ V, what)


def test_merge_order_does_not_matter():
    g = torch.Generator().manual_seed(7)
    s = 5 * torch.randn(4, 50, generator=g, dtype=torch.float64)
    V = torch.randn(50, 3, generator=g, dtype=torch.float64)
    edges = [0, 3, 11, 12, 30, 50]
    c = [partial(s[:, a:b], V[a:b]) for a, b in zip(edges, edges[1:])]
    M = ans.merge
    m_ref, l_ref, O_ref = partial(s, V)
    for name, (m, l, O) in {"left to right": M(M(M(M(c[0], c[1]), c[2]), c[3]), c[4]),
                            "as a tree": M(M(c[0], c[1]), M(M(c[2], c[3]), c[4])),
                            "shuffled": M(M(c[3], c[0]), M(c[4], M(c[2], c[1])))}.items():
        check("O~ / l", O / l[..., None], O_ref / l_ref[..., None], f"five chunks merged {name}")


def test_merge_with_an_empty_part():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(4, 6, generator=g, dtype=torch.float64)
    V = torch.randn(6, 2, generator=g, dtype=torch.float64)
    full, empty = partial(s, V), partial(s[:, :0], V[:0])
    for what, (a, b) in {"merge(part, empty)": (full, empty), "merge(empty, part)": (empty, full)}.items():
        m, l, O = ans.merge(a, b)
        check("m", m, full[0], what)
        check("l", l, full[1], what)
        check("O~", O, full[2], what)


def test_merge_two_empty_parts_gives_empty_not_nan():
    empty = partial(torch.zeros(3, 0, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.float64))
    m, l, O = ans.merge(empty, empty)
    what = "merge(empty, empty), as happens to a row whose first key blocks are all masked"
    assert torch.isinf(m).all() and (m < 0).all(), f"{what}: expected m = -inf, got {m.tolist()}"
    check("l", l, torch.zeros(3, dtype=torch.float64), what)
    check("O~", O, torch.zeros(3, 2, dtype=torch.float64), what)


@pytest.mark.parametrize("offset", [0.0, 3000.0])
def test_merge_normalised(offset):
    g = torch.Generator().manual_seed(11)
    s = offset + 4 * torch.randn(2, 6, 40, generator=g, dtype=torch.float64)     # offset: exp(L) overflows
    V = torch.randn(2, 40, 5, generator=g, dtype=torch.float64)
    parts = []
    for a, b in [(0, 17), (17, 40)]:
        m, l, O = partial(s[..., a:b], V[..., a:b, :])
        parts.append((O / l[..., None], m + torch.log(l)))
    O, L = ans.merge_normalised(*parts)
    what = f"merge_normalised of keys [0, 17) and [17, 40), scores around {offset:g}"
    check("L", L, torch.logsumexp(s, dim=-1), what)
    check("O", O, torch.softmax(s, dim=-1) @ V, what)
