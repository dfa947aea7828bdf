"""Grader for exercise 04: python exercises/grade.py 04

References, float64: dense S, P, dP, dS of the whole problem (sliced to the block pair and transposed)
for backward_pair, PyTorch autograd through dense attention for flash_backward. Every quantity is
reported; likely causes come from comparing the answer with what each recognised mistake produces.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import check_all, load_answer, matches  # noqa: E402

import reference  # noqa: E402

ans = load_answer(__file__)
F64 = torch.float64
NAMES = ["S_T", "P_T", "dP_T", "dS_T", "dV_j", "dK_j", "dQ_i"]


def test_D_is_rowsum_of_dO_times_O():
    g = torch.Generator().manual_seed(1)
    O, dO = (torch.randn(2, 3, 11, 5, generator=g, dtype=F64) for _ in range(2))
    D = ans.compute_D(dO, O)
    causes = []
    if isinstance(D, torch.Tensor) and D.shape == (2, 3, 11, 5):
        causes.append("D is one number per row: sum dO * O over the last dimension")
    elif isinstance(D, torch.Tensor) and matches(D, (dO * O).sum(-2), 1e-10):
        causes.append("the sum runs over the rows; D_i sums over the d columns of row i")
    check_all("compute_D on (2, 3, 11, 5) inputs", [("D", D, torch.einsum("bhnd,bhnd->bhn", dO, O), 1e-10)], causes)


def problem(N, d, causal, seed):
    g = torch.Generator().manual_seed(seed)
    Q, K, V, dO = (torch.randn(2, 2, N, d, generator=g, dtype=F64) for _ in range(4))
    return Q, K, V, dO


def dense_blocks(Q, K, V, dO, scale, causal, r0, r1, c0, c1, mask=None):
    """The truth for one block pair, key-major, from the dense problem; `mask` replaces the causal one
    (to model a mistaken mask) in P only, as the answer would apply it."""
    N = Q.shape[-2]
    true_mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else torch.zeros(N, N, dtype=torch.bool)
    S = Q @ K.transpose(-1, -2) * scale
    L = torch.logsumexp(S.masked_fill(true_mask, -math.inf), dim=-1)                  # (..., N)
    P_full = torch.exp(S - L[..., None]).masked_fill(true_mask, 0.0)
    O = P_full @ V
    D = (dO * O).sum(-1)
    blk = (Ellipsis, slice(r0, r1), slice(c0, c1))
    P = torch.exp(S[blk] - L[..., r0:r1, None])
    P = P.masked_fill((mask if mask is not None else true_mask)[r0:r1, c0:c1], 0.0)
    dP = dO[..., r0:r1, :] @ V[..., c0:c1, :].transpose(-1, -2)
    dS = P * (dP - D[..., r0:r1, None])
    Q_i, K_j = Q[..., r0:r1, :], K[..., c0:c1, :]
    out = dict(S_T=S[blk].transpose(-1, -2), P_T=P.transpose(-1, -2), dP_T=dP.transpose(-1, -2),
               dS_T=dS.transpose(-1, -2), dV_j=P.transpose(-1, -2) @ dO[..., r0:r1, :],
               dK_j=scale * dS.transpose(-1, -2) @ Q_i, dQ_i=scale * dS @ K_j)
    return out, L, D


def pair_causes(got, exp, L_i, D_i, scale, alt_local):
    """Recognised mistakes, from comparing the answer's quantities with what each mistake gives."""
    causes = []
    for name in ["S_T", "P_T", "dP_T", "dS_T"]:
        x = got.get(name)
        if isinstance(x, torch.Tensor) and x.shape != exp[name].shape and x.shape == exp[name].transpose(-1, -2).shape:
            causes.append(f"{name} is query-major {tuple(x.shape)}: key-major blocks have the keys as rows, "
                          f"{tuple(exp[name].shape)}")
            break
    P_T, dP_T, dS_T = (got.get(k) for k in ("P_T", "dP_T", "dS_T"))
    if alt_local is not None and isinstance(P_T, torch.Tensor) and matches(P_T, alt_local["P_T"], 1e-10):
        causes.append("the causal mask compares indices inside the blocks; it must compare absolute keys "
                      "c0 + row with absolute queries r0 + column")
    if isinstance(P_T, torch.Tensor) and matches(P_T, torch.exp(exp["S_T"] - L_i[..., None, :]), 1e-10) \
            and not matches(P_T, exp["P_T"], 1e-10):
        causes.append("the causal mask is missing (P_T must be 0 where key c > query r)")
    if isinstance(P_T, torch.Tensor) and exp["S_T"].shape[-1] == exp["S_T"].shape[-2] and \
            matches(P_T.masked_fill(exp["P_T"] == 0, 0.0),
                    torch.exp(exp["S_T"] - L_i[..., :, None]).masked_fill(exp["P_T"] == 0, 0.0), 1e-10):
        causes.append("L_i is subtracted along the wrong axis: in key-major form the queries are the "
                      "columns, L_i[..., None, :]")
    if all(isinstance(x, torch.Tensor) for x in (P_T, dP_T, dS_T)) and matches(P_T, exp["P_T"], 1e-10) \
            and matches(dP_T, exp["dP_T"], 1e-10):
        if matches(dS_T, P_T * dP_T, 1e-10):
            causes.append("dS_T = P_T o dP_T: D_i is not subtracted (dS = P o (dP - D))")
        elif P_T.shape[-1] == P_T.shape[-2] and matches(dS_T, P_T * (dP_T - D_i[..., :, None]), 1e-10):
            causes.append("D_i is subtracted along the wrong axis: one D per query, and the queries are "
                          "the columns, D_i[..., None, :]")
    for name in ["dK_j", "dQ_i"]:
        x = got.get(name)
        if isinstance(x, torch.Tensor) and matches(x, exp[name] / scale, 1e-10):
            causes.append(f"{name} lacks the factor scale (S = scale * Q K^T, so the chain rule brings it back)")
    return causes


PAIRS = [  # (N, d, causal, (r0, r1), (c0, c1), what the pair is)
    (40, 8, False, (16, 32), (0, 12), "an interior pair, B_r = 16, B_c = 12"),
    (40, 8, True, (16, 32), (16, 28), "a diagonal pair, causal, B_r = 16, B_c = 12"),
    (40, 8, True, (12, 24), (16, 28), "a pair on the diagonal with r0 != c0, causal, B_r = B_c = 12"),
    (37, 16, True, (32, 37), (32, 37), "the ragged last pair, causal (5 x 5)"),
    (40, 8, True, (32, 40), (8, 24), "a pair below the diagonal, causal (nothing masked)"),
]


@pytest.mark.parametrize("N,d,causal,rows,cols,what", PAIRS, ids=[p[-1] for p in PAIRS])
def test_backward_pair(N, d, causal, rows, cols, what):
    (r0, r1), (c0, c1) = rows, cols
    Q, K, V, dO = problem(N, d, causal, seed=N + r0 + c0)
    scale = 0.3 if d == 16 else d ** -0.5
    exp, L, D = dense_blocks(Q, K, V, dO, scale, causal, r0, r1, c0, c1)
    got = ans.backward_pair(Q[..., r0:r1, :], K[..., c0:c1, :], V[..., c0:c1, :], dO[..., r0:r1, :], L[..., r0:r1],
                            D[..., r0:r1], scale, r0, c0, causal)
    assert isinstance(got, dict), f"backward_pair must return a dict with keys {NAMES}, got {type(got).__name__}"
    missing = [k for k in NAMES if k not in got]
    assert not missing, f"backward_pair's dict lacks {missing} (it must hold {NAMES})"
    alt_local = None
    if causal:
        r, c = torch.arange(N)[:, None], torch.arange(N)[None, :]
        local = (c - c0) > (r - r0)                      # the block-local mask, on this pair's entries
        alt_local = dense_blocks(Q, K, V, dO, scale, causal, r0, r1, c0, c1, mask=local)[0]
    check_all(f"backward_pair on {what} (rows {r0}..{r1 - 1}, keys {c0}..{c1 - 1}, N={N}, d={d}, scale={scale:g})",
              [(k, got[k], exp[k], 1e-10) for k in NAMES],
              pair_causes(got, exp, L[..., r0:r1], D[..., r0:r1], scale, alt_local))


@pytest.mark.parametrize("N,d,B_r,B_c,causal", [(1, 4, 16, 16, False), (29, 8, 8, 8, False), (29, 8, 8, 8, True),
                                                 (40, 16, 16, 4, True), (33, 8, 4, 16, True)])
def test_gradients_match_autograd_float64(N, d, B_r, B_c, causal):
    what = f"flash_backward with your functions, N={N}, d={d}, B_r={B_r}, B_c={B_c}, causal={causal}"
    Q, K, V, dO = problem(N, d, causal, seed=N + d)                   # a random dO: ones hide transpositions
    O, L = reference.flash_forward(Q, K, V, causal=causal, B_r=B_r, B_c=B_c)
    dQ, dK, dV = ans.flash_backward(Q, K, V, O, L, dO, causal=causal, B_r=B_r, B_c=B_c)
    q, k, v = (x.clone().requires_grad_() for x in (Q, K, V))
    reference.attention(q, k, v, causal=causal).backward(dO)
    causes = []
    if matches(dV, v.grad, 1e-10) and not matches(dK, k.grad, 1e-10):
        causes.append("dV is right and dK is not: look at dS_T (D_i, the mask) and the scale (the "
                      "backward_pair checks say which)")
    check_all(what, [("dQ", dQ, q.grad, 1e-10), ("dK", dK, k.grad, 1e-10), ("dV", dV, v.grad, 1e-10)], causes)
