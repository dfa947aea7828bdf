"""Exercise 04: one step of the backward pass (Algorithm 2, lines 10-16) for one block pair, key-major.
Fill in the two TODOs; flash_backward below is Algorithm 2's loops and calls your functions.

Key-major: the tensor-core backward kernels in flash.cu give each warp a set of keys and compute the
transposed products S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T, so that the keys are the rows of every
block they hold: dK_j and dV_j (rows = keys) then build up in the registers that own those keys, and
P_ij^T, dS_ij^T are already the left operands of dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i. This
exercise is the same step in PyTorch, in that layout.

Symbols (reference.py): Q_i, dO_i (..., B_r, d); K_j, V_j (..., B_c, d); L_i, D_i (..., B_r);
S_T, P_T, dP_T, dS_T (..., B_c, B_r): the transposes of S_ij, P_ij, dP_ij, dS_ij.
"""
import math

import torch


def compute_D(dO, O):
    """Alg. 2 l.4: D = rowsum(dO o O), shape (..., N). (It equals rowsum(P o dP) of the whole row.)"""
    # TODO 1
    return (dO * O).sum(dim=-1)


def backward_pair(Q_i, K_j, V_j, dO_i, L_i, D_i, scale, r0, c0, causal):
    """Alg. 2 l.10-16 for query block i (rows r0 .. r0 + B_r - 1) and key block j (keys c0 .. c0 + B_c - 1),
    key-major. Returns a dict:
        S_T   (..., B_c, B_r)  scale * K_j Q_i^T, before any mask
        P_T   (..., B_c, B_r)  exp(S_ij - L_i)^T, with 0 where key c > query r when causal
        dP_T  (..., B_c, B_r)  (dO_i V_j^T)^T
        dS_T  (..., B_c, B_r)  (P_ij o (dP_ij - D_i))^T
        dV_j  (..., B_c, d)    this pair's term of dV_j:  P_ij^T dO_i
        dK_j  (..., B_c, d)    this pair's term of dK_j:  scale * dS_ij^T Q_i
        dQ_i  (..., B_r, d)    this pair's term of dQ_i:  scale * dS_ij K_j
    computed from the key-major blocks (no S_ij, P_ij, dS_ij in query-major form)."""
    # TODO 2: seven quantities, each one line; the causal mask in absolute indices.
    S_T = K_j @ Q_i.transpose(-1, -2) * scale                             # l.10: S_ij^T  (..., B_c, B_r)
    P_T = torch.exp(S_T - L_i[..., None, :])                              # l.11: L_i runs along the columns
    if causal:
        c = torch.arange(c0, c0 + K_j.shape[-2], device=Q_i.device)[:, None]   # keys: rows
        r = torch.arange(r0, r0 + Q_i.shape[-2], device=Q_i.device)[None, :]   # queries: columns
        P_T = P_T.masked_fill(c > r, 0.0)
    dV_j = P_T @ dO_i                                                     # l.12: (..., B_c, d)
    dP_T = V_j @ dO_i.transpose(-1, -2)                                   # l.13: dP_ij^T = V_j dO_i^T
    dS_T = P_T * (dP_T - D_i[..., None, :])                               # l.14
    dQ_i = scale * dS_T.transpose(-1, -2) @ K_j                           # l.15: (..., B_r, d)
    dK_j = scale * dS_T @ Q_i                                             # l.16: (..., B_c, d)
    return dict(S_T=S_T, P_T=P_T, dP_T=dP_T, dS_T=dS_T, dV_j=dV_j, dK_j=dK_j, dQ_i=dQ_i)


def flash_backward(Q, K, V, O, L, dO, causal=False, softmax_scale=None, B_r=16, B_c=16):
    """Algorithm 2 with your two functions; returns dQ, dK, dV. (Given: nothing to do here.)"""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    D = compute_D(dO, O)                                                  # l.4
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for j in range(T_c):                                                  # l.5
        c0, c1 = j * B_c, min((j + 1) * B_c, N)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                     # l.6
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)         # l.7
        for i in range(c0 // B_r if causal else 0, T_r):                  # l.8 (causal: earlier blocks all masked)
            r0, r1 = i * B_r, min((i + 1) * B_r, N)
            step = backward_pair(Q[..., r0:r1, :], K_j, V_j, dO[..., r0:r1, :], L[..., r0:r1], D[..., r0:r1],
                                 scale, r0, c0, causal)                   # l.9-16
            dV_j = dV_j + step["dV_j"]
            dK_j = dK_j + step["dK_j"]
            dQ[..., r0:r1, :] += step["dQ_i"]
        dK[..., c0:c1, :], dV[..., c0:c1, :] = dK_j, dV_j                 # l.18
    return dQ, dK, dV
