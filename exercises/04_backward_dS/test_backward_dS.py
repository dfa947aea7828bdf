"""Grader for exercise 04: python exercises/grade.py 04"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

import reference  # noqa: E402

ans = load_answer(__file__)


def close(name, got, expected, what, tol=1e-10):
    assert tuple(got.shape) == tuple(expected.shape), \
        f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    err = (got - expected).abs().max().item() if got.numel() else 0.0
    assert err < tol, (f"{what}: {name} differs by {err:.3e} (tolerance {tol:g}); expected "
                       f"{expected.flatten()[:3].tolist()} ..., got {got.flatten()[:3].tolist()} ...")


def test_D_is_rowsum_of_dO_times_O():
    g = torch.Generator().manual_seed(1)
    O, dO = (torch.randn(2, 3, 11, 5, generator=g, dtype=torch.float64) for _ in range(2))
    expected = torch.einsum("bhnd,bhnd->bhn", dO, O)
    close("D", ans.compute_D(dO, O), expected, "compute_D on (2, 3, 11, 5) inputs")


def test_D_equals_rowsum_P_dP():
    """The identity that makes D_i cheap: rowsum(dO o O) = rowsum(P o dP) for the whole row."""
    g = torch.Generator().manual_seed(2)
    Q, K, V, dO = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(4))
    P = torch.softmax(Q @ K.transpose(-1, -2) / 2, dim=-1)
    O, dP = P @ V, dO @ V.transpose(-1, -2)
    close("D", ans.compute_D(dO, O), (P * dP).sum(-1), "compute_D(dO, O) against rowsum(P o dP)")


def test_recompute_P_from_L():
    g = torch.Generator().manual_seed(3)
    S = 4 * torch.randn(2, 6, 10, generator=g, dtype=torch.float64)       # (..., B_r, B_c): one whole row here
    L = torch.logsumexp(S, dim=-1)
    close("P_ij", ans.recompute_P(S, L), torch.softmax(S, dim=-1), "recompute_P(S, logsumexp(S))")
    close("P_ij", ans.recompute_P(S[..., 3:7], L), torch.softmax(S, dim=-1)[..., 3:7],
          "recompute_P on columns 3..6 of the row (a block of keys) with the whole row's L")


def test_dS_against_autograd_of_softmax():
    g = torch.Generator().manual_seed(4)
    S = torch.randn(3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dP = torch.randn(3, 7, 8, generator=g, dtype=torch.float64)            # random upstream gradient, never ones
    P = torch.softmax(S, dim=-1)
    (dS_ref,) = torch.autograd.grad(P, S, dP)
    D = (P * dP).sum(-1).detach()
    close("dS_ij", ans.compute_dS(P.detach(), dP, D), dS_ref, "compute_dS(P, dP, rowsum(P o dP)) against autograd")


@pytest.mark.parametrize("N,d,B_r,B_c,causal", [(1, 4, 16, 16, False), (29, 8, 8, 8, False), (29, 8, 8, 8, True),
                                                 (40, 16, 16, 4, True), (33, 8, 4, 16, True)])
def test_gradients_match_autograd_float64(N, d, B_r, B_c, causal):
    what = f"flash_backward with your functions, N={N}, d={d}, B_r={B_r}, B_c={B_c}, causal={causal}"
    g = torch.Generator().manual_seed(N + d)
    Q, K, V, dO = (torch.randn(2, 2, N, d, generator=g, dtype=torch.float64) for _ in range(4))
    O, L = reference.flash_forward(Q, K, V, causal=causal, B_r=B_r, B_c=B_c)
    dQ, dK, dV = ans.flash_backward(Q, K, V, O, L, dO, causal=causal, B_r=B_r, B_c=B_c)
    q, k, v = (x.clone().requires_grad_() for x in (Q, K, V))
    reference.attention(q, k, v, causal=causal).backward(dO)
    for name, got, ref in [("dV", dV, v.grad), ("dK", dK, k.grad), ("dQ", dQ, q.grad)]:
        close(name, got, ref, what)
