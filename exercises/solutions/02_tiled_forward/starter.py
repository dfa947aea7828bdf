"""Exercise 02: FlashAttention-2's forward (Algorithm 1) with the key blocks visited last to first.
Fill in the TODO: the whole loop over key blocks.

Symbols as in reference.py and the paper: Q, K, V (..., N, d); blocks Q_i (..., B_r, d), K_j, V_j
(..., B_c, d); S_ij, P_ij (..., B_r, B_c); m_i, l_i (..., B_r); O_i (..., B_r, d); L (..., N).
Causal: query r sees key c only when c <= r. The last block of each kind may be shorter than B_r or B_c.

Why last to first: a causal kernel that starts with the diagonal block does the masked work first and
can run the rest without a mask (FlashAttention-2's CUDA kernels do this). The price: the first block
a row sees may hold none of its keys, which the order of reference.flash_forward never allows.
"""
import math

import torch


def flash_forward(Q, K, V, causal=False, softmax_scale=None, B_r=64, B_c=64, visited=None):
    """Algorithm 1, key blocks in decreasing j. Returns O (..., N, d) and L (..., N), the row log-sum-exp
    of the scaled scores. If `visited` is a list, append (i, j) to it for every block pair whose S_ij
    is computed, in the order computed (blocks are numbered from 0)."""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=Q.dtype, device=Q.device)
    for i in range(T_r):                                                  # l.3: for 1 <= i <= T_r
        r0, r1 = i * B_r, min((i + 1) * B_r, N)                           # rows r0 .. r1-1 of this block
        Q_i = Q[..., r0:r1, :]                                            # l.4: load Q_i     (..., B_r, d)
        O_i = torch.zeros_like(Q_i)                                       # l.5: O_i = 0
        l_i = torch.zeros(Q_i.shape[:-1], dtype=Q.dtype, device=Q.device)  #      l_i = 0      (..., B_r)
        m_i = torch.full_like(l_i, float("-inf"))                         #      m_i = -inf   (..., B_r)
        # TODO: l.6-10 with j from the last key block any row of Q_i sees down to 0 (causal: skip the
        #       blocks that are entirely masked; record (i, j) in `visited`). A row may see none of the
        #       keys of the first block visited: its m_i must not turn into NaN there.
        last_j = (r1 - 1) // B_c if causal else T_c - 1                   # causal: later blocks all masked
        for j in range(last_j, -1, -1):                                   # l.6: for j = last_j .. 0
            if visited is not None:
                visited.append((i, j))
            c0, c1 = j * B_c, min((j + 1) * B_c, N)
            K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                 # l.7: load K_j, V_j (..., B_c, d)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.8: S_ij = Q_i K_j^T (..., B_r, B_c)
            if causal:
                r = torch.arange(r0, r1, device=Q.device)[:, None]        # absolute row and key indices
                c = torch.arange(c0, c1, device=Q.device)[None, :]
                S_ij = S_ij.masked_fill(c > r, float("-inf"))
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))                 # l.9: m_i^(j); -inf: no key seen yet
            m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # then any finite value:
            P_ij = torch.exp(S_ij - m_use[..., None])                     #      P_ij = 0 and alpha = 0, no NaN
            alpha = torch.exp(m_i - m_use)                                #      e^(m^(j-1) - m^(j))
            l_i = alpha * l_i + P_ij.sum(dim=-1)                          #      l_i^(j)
            O_i = alpha[..., None] * O_i + P_ij @ V_j                     # l.10: O_i^(j)
            m_i = m_new
        O[..., r0:r1, :] = O_i / l_i[..., None]                           # l.12: O_i = diag(l_i)^-1 O_i
        L[..., r0:r1] = m_i + torch.log(l_i)                              # l.13: L_i = m_i + log(l_i)
    return O, L
