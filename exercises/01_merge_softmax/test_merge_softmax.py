"""Grader for exercise 01: python exercises/grade.py 01

References are dense and in float64: the parts' O and lse2 from a softmax over each part's keys, the
expected result from a softmax over all keys. Likely causes come from small hand-made probes whose
right answers are written out below, so the grader holds no combine of its own.
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
LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
F64 = torch.float64


@pytest.fixture(autouse=True)
def no_reference_calls(monkeypatch):
    """The exercise is to write the combine: reference.py's attention, forward and merge are off limits."""
    refuse_calls(monkeypatch, ans, reference, ("attention", "flash_forward", "merge"), "exercise 01",
                 "write the combine yourself")


def t(rows):
    return torch.tensor(rows, dtype=F64)


def probe_causes():
    """Run the answer's combine on tiny parts with known answers; return what the results point at."""
    causes = []

    def run(O_parts, lse2_parts):
        try:
            return ans.combine(t(O_parts), t(lse2_parts))
        except Exception:  # noqa: BLE001 (the main check reports the error itself)
            return None

    # Two parts, lse2 = 0 and 1: weights 1 and 2 (base 2), so O = (1/3, 2/3) and lse2 = log2(3).
    got = run([[[1.0, 0.0]], [[0.0, 1.0]]], [[0.0], [1.0]])
    if got is not None:
        O, _ = got
        e = math.e
        if matches(O, t([[1 / (1 + e), e / (1 + e)]]), 1e-9):
            causes.append("the lse2 are base 2: part k weighs 2^(lse2_k - M), not e^(lse2_k - M)")
        elif matches(O, t([[0.5, 1.0]]), 1e-9):
            causes.append("O is the weighted sum of the O_k without dividing by the sum of the weights "
                          "(each O_k is already normalised over its own part)")
    # The same weights at lse2 = 3000 and 3001, where 2^lse2 overflows float64 (above 1024).
    got = run([[[1.0, 0.0]], [[0.0, 1.0]]], [[3000.0], [3001.0]])
    if got is not None and not torch.isfinite(got[0]).all():
        causes.append("2^lse2 overflows for lse2 above 1024: subtract the row's largest lse2 before "
                      "exponentiating")
    # An empty part (lse2 = -inf) whose O is NaN, as a kernel that never wrote it leaves it.
    got = run([[[1.0, 0.0]], [[math.nan, math.nan]]], [[0.0], [-math.inf]])
    if got is not None and torch.isnan(got[0]).any():
        causes.append("an empty part has weight 0, but its O holds NaN and 0 * NaN = NaN: select the "
                      "non-empty parts (torch.where) instead of multiplying by the weight")
    # Every part empty: the row's largest lse2 is -inf, and lse2_k - M = -inf - (-inf) = NaN.
    got = run([[[math.nan, math.nan]], [[0.0, 0.0]]], [[-math.inf], [-math.inf]])
    if got is not None and (torch.isnan(got[0]).any() or torch.isnan(got[1]).any()):
        causes.append("a row where every part is empty has M = -inf, and lse2_k - M is NaN: use a finite "
                      "stand-in for M there (the weights are then 0, O = 0 and lse2 = -inf)")
    return causes


def parts_of(s, V, edges):
    """Per part [a, b) of the keys: O_k (softmax over the part's keys, NaN where the row sees none of
    them) and lse2_k, base 2; s (..., N_q, n_keys) are natural-log scores, V (..., n_keys, d)."""
    O_parts, lse2_parts = [], []
    for a, b in zip(edges, edges[1:]):
        lse = torch.logsumexp(s[..., a:b], dim=-1)                            # -inf for an empty part
        O_k = torch.exp(s[..., a:b] - lse[..., None]) @ V[..., a:b, :]
        O_k[torch.isinf(lse)] = math.nan                                      # garbage, as a kernel may leave it
        O_parts.append(O_k)
        lse2_parts.append(lse * LOG2E)
    return torch.stack(O_parts), torch.stack(lse2_parts)


@pytest.mark.parametrize("edges", [[0, 40], [0, 17, 40], [0, 3, 3, 30, 40], [0, 1, 2, 20, 39, 40],
                                   [0, 10, 20, 30, 40]], ids=lambda e: f"parts{e}")
def test_combine_equals_dense(edges):
    g = torch.Generator().manual_seed(len(edges) * 31 + edges[1])
    s = 3 * torch.randn(2, 3, 5, 40, generator=g, dtype=F64)                 # (B, H, N_q, n_keys)
    V = torch.randn(2, 3, 40, 7, generator=g, dtype=F64)                     # (B, H, n_keys, d)
    O_parts, lse2_parts = parts_of(s, V, edges)
    O, lse2 = ans.combine(O_parts, lse2_parts)
    empty = " (one part empty, its O all NaN)" if any(a == b for a, b in zip(edges, edges[1:])) else ""
    check_all(f"combine of {len(edges) - 1} parts, keys cut at {edges}{empty}",
              [("O", O, torch.softmax(s, dim=-1) @ V, 1e-10),
               ("lse2", lse2, torch.logsumexp(s, dim=-1) * LOG2E, 1e-10)], probe_causes())


def test_combine_does_not_overflow():
    g = torch.Generator().manual_seed(5)
    s = 2000 + 4 * torch.randn(3, 6, 30, generator=g, dtype=F64)             # lse2 near 2900: 2^lse2 = inf
    V = torch.randn(3, 30, 4, generator=g, dtype=F64)
    O, lse2 = ans.combine(*parts_of(s, V, [0, 11, 12, 30]))
    check_all("combine of 3 parts with lse2 near 2900 (2^lse2 overflows float64)",
              [("O", O, torch.softmax(s, dim=-1) @ V, 1e-10),
               ("lse2", lse2, torch.logsumexp(s, dim=-1) * LOG2E, 1e-9)], probe_causes())


def test_combine_rows_with_every_part_empty():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(4, 12, generator=g, dtype=F64)
    s[1] = -math.inf                                                         # row 1 sees no key in any part
    V = torch.randn(12, 3, generator=g, dtype=F64)
    O, lse2 = ans.combine(*parts_of(s, V, [0, 5, 12]))
    O_ref = torch.softmax(s, dim=-1) @ V
    O_ref[1] = 0.0
    check_all("combine of 2 parts where row 1 sees no key at all (expected: O = 0, lse2 = -inf there)",
              [("O", O, O_ref, 1e-10), ("lse2", lse2, torch.logsumexp(s, dim=-1) * LOG2E, 1e-10)],
              probe_causes())


def dense(Q, K, V, causal, scale, mask=None):
    S = Q @ K.transpose(-1, -2) * scale
    N = Q.shape[-2]
    if mask is None and causal:
        mask = torch.ones(N, N, dtype=torch.bool).triu(1)
    if mask is not None:
        S = S.masked_fill(mask, -math.inf)
    return torch.softmax(S, dim=-1) @ V, torch.logsumexp(S, dim=-1)


@pytest.mark.parametrize("N,n_splits,causal,scale", [(37, 1, False, None), (37, 3, False, None), (37, 3, True, None),
                                                     (50, 4, True, 0.3), (64, 5, True, None), (3, 5, True, None),
                                                     (1, 2, False, None)])
def test_split_kv_attention(N, n_splits, causal, scale, monkeypatch):
    g = torch.Generator().manual_seed(N * 10 + n_splits)
    d = 8
    Q, K, V = (torch.randn(2, 2, N, d, generator=g, dtype=F64) for _ in range(3))
    parts_combined, combine = [], ans.combine

    def counted_combine(O_parts, lse2_parts):   # a dense softmax gives the same O and L: see that the parts are used
        parts_combined.append(len(O_parts))
        return combine(O_parts, lse2_parts)
    monkeypatch.setattr(ans, "combine", counted_combine)
    O, L = ans.split_kv_attention(Q, K, V, n_splits, causal=causal, softmax_scale=scale)
    monkeypatch.setattr(ans, "combine", combine)                # (the probes below call it too)
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    O_ref, L_ref = dense(Q, K, V, causal, sc)
    causes = probe_causes()
    if isinstance(L, torch.Tensor) and matches(L, L_ref * LOG2E, 1e-9) and N > 1:
        causes.append("L is still base 2: the natural-log L is lse2 * ln(2)")
    if causal and isinstance(O, torch.Tensor) and matches(O, dense(Q, K, V, False, sc)[0], 1e-9):
        causes.append("the causal mask is missing")
    if causal:                                # a mask that compares the key's index inside its part with r
        starts = torch.tensor([s * N // n_splits for s in range(n_splits) for _ in range(s * N // n_splits,
                                                                                         (s + 1) * N // n_splits)])
        local = (torch.arange(N)[None, :] - starts[None, :]) > torch.arange(N)[:, None]
        if isinstance(O, torch.Tensor) and matches(O, dense(Q, K, V, True, sc, mask=local)[0], 1e-9):
            causes.append("the causal mask compares the key's index inside its part with the row: it must "
                          "use the absolute key index c0 + column")
    if scale is not None and isinstance(O, torch.Tensor) and matches(O, dense(Q, K, V, causal, d ** -0.5)[0], 1e-9):
        causes.append("softmax_scale is ignored (the default 1/sqrt(d) was used)")
    check_all(f"split_kv_attention, N={N}, d={d}, n_splits={n_splits}, causal={causal}, softmax_scale={scale}",
              [("O", O, O_ref, 1e-10), ("L", L, L_ref, 1e-10)], causes)
    non_empty = sum((s + 1) * N // n_splits > s * N // n_splits for s in range(n_splits))
    expected = f"its {n_splits} part{'s' * (n_splits > 1)}" + (f" (or the {non_empty} that hold keys)"
                                                                if non_empty < n_splits else "")
    assert any(k in (n_splits, non_empty) for k in parts_combined), (
        f"split_kv_attention, N={N}, n_splits={n_splits}: O and L are right, but combine was "
        + (f"given {parts_combined} parts" if parts_combined else "never called")
        + f"; expected it to combine {expected}: compute each part's O_s and lse2_s on its own, then combine them")
