"""Exercise 04: the backward pass's D_i, P_ij and dS_ij (Algorithm 2). Fill in the three TODOs;
flash_backward below is Algorithm 2 and calls your functions.

Symbols (reference.py): O, dO (..., N, d); L (..., N) the row log-sum-exp saved by the forward;
D (..., N); S_ij, P_ij, dP_ij, dS_ij (..., B_r, B_c); L_i, D_i (..., B_r).
"""
import math

import torch


def compute_D(dO, O):
    """Alg. 2 l.5: D = rowsum(dO o O), shape (..., N). (It equals rowsum(P o dP) of the whole row.)"""
    # TODO 1
    raise NotImplementedError("TODO 1: D")


def recompute_P(S_ij, L_i):
    """Alg. 2 l.12: P_ij = exp(S_ij - L_i), the forward's probabilities rebuilt from the saved L_i alone
    (no m_i, no l_i, no second pass). S_ij (..., B_r, B_c) already scaled; L_i (..., B_r)."""
    # TODO 2
    raise NotImplementedError("TODO 2: P_ij")


def compute_dS(P_ij, dP_ij, D_i):
    """Alg. 2 l.15: dS_ij = P_ij o (dP_ij - D_i), the gradient through the softmax of one block."""
    # TODO 3
    raise NotImplementedError("TODO 3: dS_ij")


def flash_backward(Q, K, V, O, L, dO, causal=False, softmax_scale=None, B_r=16, B_c=16):
    """Algorithm 2 with your three functions; returns dQ, dK, dV. (Given: nothing to do here.)"""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    D = compute_D(dO, O)                                                  # l.5
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for j in range(T_c):                                                  # l.6
        c0, c1 = j * B_c, min((j + 1) * B_c, N)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                     # l.7
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)         # l.8
        for i in range(c0 // B_r if causal else 0, T_r):                  # l.9
            r0, r1 = i * B_r, min((i + 1) * B_r, N)
            Q_i, dO_i, L_i, D_i = Q[..., r0:r1, :], dO[..., r0:r1, :], L[..., r0:r1], D[..., r0:r1]  # l.10
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.11
            P_ij = recompute_P(S_ij, L_i)                                 # l.12
            if causal:
                r = torch.arange(r0, r1)[:, None]
                c = torch.arange(c0, c1)[None, :]
                P_ij = P_ij.masked_fill(c > r, 0.0)
            dV_j = dV_j + P_ij.transpose(-1, -2) @ dO_i                   # l.13
            dP_ij = dO_i @ V_j.transpose(-1, -2)                          # l.14
            dS_ij = compute_dS(P_ij, dP_ij, D_i)                          # l.15
            dQ[..., r0:r1, :] += scale * dS_ij @ K_j                      # l.16
            dK_j = dK_j + scale * dS_ij.transpose(-1, -2) @ Q_i           # l.17
        dK[..., c0:c1, :], dV[..., c0:c1, :] = dK_j, dV_j                 # l.19
    return dQ, dK, dV
