"""Exercise 02: FlashAttention-2 Algorithm 1 (forward), the inner loop body. Fill in the TODOs.

Symbols as in reference.py and the paper: Q, K, V (..., N, d); blocks Q_i (..., B_r, d), K_j, V_j
(..., B_c, d); S_ij, P_ij (..., B_r, B_c); m_i, l_i (..., B_r); O_i (..., B_r, d); L (..., N).
Causal: query r sees key c only when c <= r. Rows and keys past N do not exist (the last block of
each kind may be shorter than B_r or B_c).
"""
import math

import torch


def flash_forward(Q, K, V, causal=False, softmax_scale=None, B_r=64, B_c=64):
    """Algorithm 1. Returns O (..., N, d) and L (..., N), the row log-sum-exp of the scaled scores."""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=Q.dtype, device=Q.device)
    for i in range(T_r):                                                  # l.4: for 1 <= i <= T_r
        r0, r1 = i * B_r, min((i + 1) * B_r, N)                           # rows r0 .. r1-1 of this block
        Q_i = Q[..., r0:r1, :]                                            # l.5: load Q_i     (..., B_r, d)
        O_i = torch.zeros_like(Q_i)                                       # l.6: O_i = 0
        l_i = torch.zeros(Q_i.shape[:-1], dtype=Q.dtype, device=Q.device)  #      l_i = 0      (..., B_r)
        m_i = torch.full_like(l_i, float("-inf"))                         #      m_i = -inf   (..., B_r)
        for j in range(T_c):                                              # l.7: for 1 <= j <= T_c
            c0, c1 = j * B_c, min((j + 1) * B_c, N)                       # keys c0 .. c1-1 of this block
            # TODO 1 (l.8-9): load K_j, V_j and compute S_ij = Q_i K_j^T * scale, (..., B_r, B_c).
            #        Causal: set S_ij to -inf where key c > query r (r = r0 + row, c = c0 + column).
            K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                 # l.8: load K_j, V_j (..., B_c, d)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.9: S_ij = Q_i K_j^T
            if causal:
                r = torch.arange(r0, r1, device=Q.device)[:, None]
                c = torch.arange(c0, c1, device=Q.device)[None, :]
                S_ij = S_ij.masked_fill(c > r, float("-inf"))             # (B_r, B_c) broadcast
            # TODO 2 (l.10-11): the online softmax. New row max m_i^(j), P_ij = exp(S_ij - m_i^(j)),
            #        l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(P_ij),
            #        O_i^(j) = diag(exp(m_i^(j-1) - m_i^(j))) O_i^(j-1) + P_ij V_j, then m_i = m_i^(j).
            #        (Key 0 is never masked and j = 0 comes first, so m_i^(j) is always finite here.)
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))                 # l.10: m_i^(j)     (..., B_r)
            P_ij = torch.exp(S_ij - m_new[..., None])                     #       P_ij        (..., B_r, B_c)
            alpha = torch.exp(m_i - m_new)                                #       e^(m^(j-1) - m^(j))
            l_i = alpha * l_i + P_ij.sum(dim=-1)                          #       l_i^(j)
            O_i = alpha[..., None] * O_i + P_ij @ V_j                     # l.11: O_i^(j)     (..., B_r, d)
            m_i = m_new
        O[..., r0:r1, :] = O_i / l_i[..., None]                           # l.13: O_i = diag(l_i)^-1 O_i
        L[..., r0:r1] = m_i + torch.log(l_i)                              # l.14: L_i = m_i + log(l_i)
    return O, L
