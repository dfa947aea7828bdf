"""FlashAttention-2 in plain PyTorch, in the paper's notation.

This is the algorithm every kernel in flash.cu implements, written as explicit loops over blocks so it
can be read line by line against the paper (Dao, "FlashAttention-2", 2023, Algorithms 1 and 2) and run
on a CPU. Tests, notebooks and exercises use it; it is slow on purpose (Python loops over blocks).

Symbols, as in the paper:
    Q, K, V, O, dO   (..., N, d)       any leading batch dimensions, e.g. (B, H, N, d)
    B_r, B_c         rows of a query block Q_i, rows of a key/value block K_j, V_j
    T_r, T_c         number of query blocks ceil(N / B_r), number of key blocks ceil(N / B_c)
    S_ij, P_ij       (..., B_r, B_c)   scores and probabilities of one block pair
    m_i, l_i, L_i    (..., B_r)        running row max, running row sum, log-sum-exp m_i + log(l_i)
    D_i              (..., B_r)        rowsum(dO_i * O_i), used by the backward pass
The only departure from the paper: the scale softmax_scale (default 1/sqrt(d)) is written out, and
causal masking (query r sees key c only when c <= r) skips blocks that are entirely masked. The "l.N" tags
are the line numbers of the paper's Algorithms 1 and 2.
"""
import math

import torch


def attention(Q, K, V, causal=False, softmax_scale=None):
    """Standard attention softmax(Q K^T * scale) V; builds the whole N x N matrix (the thing to avoid)."""
    scale = 1.0 / math.sqrt(Q.shape[-1]) if softmax_scale is None else softmax_scale
    S = Q @ K.transpose(-1, -2) * scale                                  # (..., N, N)
    if causal:
        N = Q.shape[-2]
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool, device=Q.device).triu(1), float("-inf"))
    return torch.softmax(S, dim=-1) @ V                                  # (..., N, d)


def _causal_mask(r0, r1, c0, c1, device):
    """True where key c may not be seen by query r, for rows r0:r1 and columns c0:c1."""
    r = torch.arange(r0, r1, device=device)[:, None]
    c = torch.arange(c0, c1, device=device)[None, :]
    return c > r                                                          # (B_r, B_c)


def flash_forward(Q, K, V, causal=False, softmax_scale=None, B_r=64, B_c=64):
    """Algorithm 1 (forward). Returns O (..., N, d) and L (..., N), the row log-sum-exp."""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=Q.dtype, device=Q.device)
    for i in range(T_r):                                                  # l.3: for 1 <= i <= T_r
        r0, r1 = i * B_r, min((i + 1) * B_r, N)                           # a ragged last block is shorter
        Q_i = Q[..., r0:r1, :]                                            # l.4: load Q_i    (..., B_r, d)
        O_i = torch.zeros_like(Q_i)                                       # l.5: O_i = 0
        l_i = torch.zeros(Q_i.shape[:-1], dtype=Q.dtype, device=Q.device)  #      l_i = 0     (..., B_r)
        m_i = torch.full_like(l_i, float("-inf"))                         #      m_i = -inf  (..., B_r)
        last_j = (r1 - 1) // B_c if causal else T_c - 1                   # causal: later blocks are all masked
        for j in range(last_j + 1):                                       # l.6: for 1 <= j <= T_c
            c0, c1 = j * B_c, min((j + 1) * B_c, N)
            K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                 # l.7: load K_j, V_j (..., B_c, d)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.8: S_ij = Q_i K_j^T (..., B_r, B_c)
            if causal:
                S_ij = S_ij.masked_fill(_causal_mask(r0, r1, c0, c1, Q.device), float("-inf"))
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))                 # l.9: m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            P_ij = torch.exp(S_ij - m_new[..., None])                     #      P_ij = exp(S_ij - m_i^(j))
            alpha = torch.exp(m_i - m_new)                                #      rescales what was summed so far
            l_i = alpha * l_i + P_ij.sum(dim=-1)                          #      l_i^(j) = e^(m^(j-1) - m^(j)) l_i^(j-1) + rowsum(P_ij)
            O_i = alpha[..., None] * O_i + P_ij @ V_j                     # l.10: O_i^(j) = diag(e^(m^(j-1) - m^(j))) O_i^(j-1) + P_ij V_j
            m_i = m_new
        O[..., r0:r1, :] = O_i / l_i[..., None]                           # l.12: O_i = diag(l_i)^-1 O_i
        L[..., r0:r1] = m_i + torch.log(l_i)                              # l.13: L_i = m_i + log(l_i)
    return O, L


def flash_backward(Q, K, V, O, L, dO, causal=False, softmax_scale=None, B_r=64, B_c=64):
    """Algorithm 2 (backward). Recomputes P_ij from Q_i, K_j and L_i; returns dQ, dK, dV."""
    N, d = Q.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    D = (dO * O).sum(dim=-1)                                              # l.4: D = rowsum(dO o O)  (..., N)
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for j in range(T_c):                                                  # l.5: for 1 <= j <= T_c
        c0, c1 = j * B_c, min((j + 1) * B_c, N)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                     # l.6: load K_j, V_j
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)         # l.7: dK_j = dV_j = 0 (on chip)
        first_i = c0 // B_r if causal else 0                              # causal: earlier blocks are all masked
        for i in range(first_i, T_r):                                     # l.8: for 1 <= i <= T_r
            r0, r1 = i * B_r, min((i + 1) * B_r, N)
            Q_i, dO_i = Q[..., r0:r1, :], dO[..., r0:r1, :]               # l.9: load Q_i, O_i, dO_i, dQ_i, L_i, D_i
            L_i, D_i = L[..., r0:r1], D[..., r0:r1]
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.10: S_ij = Q_i K_j^T
            P_ij = torch.exp(S_ij - L_i[..., None])                       # l.11: P_ij = exp(S_ij - L_i)
            if causal:
                P_ij = P_ij.masked_fill(_causal_mask(r0, r1, c0, c1, Q.device), 0.0)
            dV_j = dV_j + P_ij.transpose(-1, -2) @ dO_i                   # l.12: dV_j += P_ij^T dO_i
            dP_ij = dO_i @ V_j.transpose(-1, -2)                          # l.13: dP_ij = dO_i V_j^T
            dS_ij = P_ij * (dP_ij - D_i[..., None])                       # l.14: dS_ij = P_ij o (dP_ij - D_i)
            dQ[..., r0:r1, :] += scale * dS_ij @ K_j                      # l.15: dQ_i += dS_ij K_j
            dK_j = dK_j + scale * dS_ij.transpose(-1, -2) @ Q_i           # l.16: dK_j += dS_ij^T Q_i
        dK[..., c0:c1, :], dV[..., c0:c1, :] = dK_j, dV_j                 # l.18: write dK_j, dV_j
    return dQ, dK, dV


def merge(O_a, L_a, O_b, L_b):
    """Attention over the keys of two parts, from each part's normalised output O and log-sum-exp L
    (..., N) (flash_forward's, or flash_attention(..., return_lse=True)'s): with L = log(l) + m, each part's
    O is its P V divided by its own l, so O = (e^L_a O_a + e^L_b O_b) / (e^L_a + e^L_b). Shifting both
    exponents by their maximum keeps them finite. Returns O and L = log(e^L_a + e^L_b) of the whole."""
    L = torch.logaddexp(L_a, L_b)                                         # (..., N)
    return torch.exp(L_a - L)[..., None] * O_a + torch.exp(L_b - L)[..., None] * O_b, L
