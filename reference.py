"""FlashAttention-2 in plain PyTorch, in the paper's notation.

This is the algorithm every kernel in flash.cu implements, written as explicit loops over blocks so it
can be read line by line against the paper (Dao, "FlashAttention-2", 2023, Algorithms 1 and 2) and run
on a CPU. Tests, notebooks and exercises use it; it is slow on purpose (Python loops over blocks).

Symbols, as in the paper:
    Q, dO, O         (..., H_q, N_q, d)   queries: any leading batch dimensions, e.g. (B, H_q, N_q, d)
    K, V             (..., H_kv, N_k, d)  keys and values: N_k may differ from N_q (cross-attention, a
                                          KV cache), and H_kv may divide H_q (grouped-query attention)
    B_r, B_c         rows of a query block Q_i, rows of a key/value block K_j, V_j
    T_r, T_c         number of query blocks ceil(N_q / B_r), number of key blocks ceil(N_k / B_c)
    S_ij, P_ij       (..., B_r, B_c)   scores and probabilities of one block pair
    m_i, l_i, L_i    (..., B_r)        running row max, running row sum, log-sum-exp m_i + log(l_i)
    D_i              (..., B_r)        rowsum(dO_i * O_i), used by the backward pass
The departures from the paper, each of which the kernels share:
  - the scale softmax_scale (default 1/sqrt(d)) is written out;
  - causal masking is aligned to the bottom right, as in FlashAttention >= 2.1: query i sees keys
    j <= i + N_k - N_q (with N_q = N_k, j <= i), so that the last query sees every key; blocks that are
    entirely masked are skipped. A query that sees no key at all (causal, N_q > N_k) gets O = 0, L = -inf;
  - grouped-query attention (GQA, the paper's section 3.1; MQA when H_kv = 1): query head h reads
    key/value head h // (H_q / H_kv), and dK, dV sum over the query heads of a group.
The "l.N" tags are the line numbers of the paper's Algorithms 1 and 2.
"""
import math

import torch


def _scale(Q, softmax_scale):
    return 1.0 / math.sqrt(Q.shape[-1]) if softmax_scale is None else softmax_scale


def _query_heads(X, Q):
    """K or V (..., H_kv, N_k, d) seen from each of Q's H_q query heads: head h reads head h // (H_q / H_kv).
    (A copy here, to keep the loops below those of the paper; the kernels only index.)"""
    H_q = Q.shape[-3] if Q.dim() > 2 else 0
    if X.dim() < 3 or X.shape[-3] == H_q:
        return X
    if H_q % X.shape[-3]:
        raise ValueError(f"H_q = {H_q} is not a multiple of H_kv = {X.shape[-3]}")
    return X.repeat_interleave(H_q // X.shape[-3], dim=-3)


def _sum_over_groups(dX, H_kv):
    """The gradient of a key/value head: the sum of what each query head of its group sent back."""
    if dX.dim() < 3 or dX.shape[-3] == H_kv:
        return dX
    return dX.unflatten(-3, (H_kv, dX.shape[-3] // H_kv)).sum(-3)


def _causal_mask(r0, r1, c0, c1, device, shift=0):
    """True where key c may not be seen by query r, for rows r0:r1 and columns c0:c1. shift = N_k - N_q
    aligns the diagonal to the bottom right: query r sees keys c <= r + shift."""
    r = torch.arange(r0, r1, device=device)[:, None]
    c = torch.arange(c0, c1, device=device)[None, :]
    return c > r + shift                                                  # (B_r, B_c)


def attention(Q, K, V, causal=False, softmax_scale=None):
    """Standard attention softmax(Q K^T * scale) V; builds the whole N_q x N_k matrix (the thing to avoid).
    A row whose keys are all masked gets 0 (FlashAttention's convention; softmax alone would give NaN)."""
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    S = Q @ K.transpose(-1, -2) * _scale(Q, softmax_scale)                # (..., N_q, N_k)
    if not causal:
        return torch.softmax(S, dim=-1) @ V                               # (..., N_q, d)
    N_q, N_k = Q.shape[-2], K.shape[-2]
    hidden = _causal_mask(0, N_q, 0, N_k, Q.device, shift=N_k - N_q)
    P = torch.softmax(S.masked_fill(hidden, float("-inf")), dim=-1)
    return P.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0) @ V


def flash_forward(Q, K, V, causal=False, softmax_scale=None, B_r=64, B_c=64, key_blocks=None):
    """Algorithm 1 (forward). Returns O (..., N_q, d) and L (..., N_q), the row log-sum-exp.
    key_blocks: the key blocks j to visit (default: all T_c); split-KV (flash_decode) visits one range of them
    per part and merges the parts."""
    N_q, N_k = Q.shape[-2], K.shape[-2]
    scale = _scale(Q, softmax_scale)
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    shift = N_k - N_q                                                     # causal: query r sees keys c <= r + shift
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=Q.dtype, device=Q.device)
    for i in range(T_r):                                                  # l.3: for 1 <= i <= T_r
        r0, r1 = i * B_r, min((i + 1) * B_r, N_q)                         # a ragged last block is shorter
        Q_i = Q[..., r0:r1, :]                                            # l.4: load Q_i    (..., B_r, d)
        O_i = torch.zeros_like(Q_i)                                       # l.5: O_i = 0
        l_i = torch.zeros(Q_i.shape[:-1], dtype=Q.dtype, device=Q.device)  #      l_i = 0     (..., B_r)
        # m_i = -inf in the paper; the lowest finite value instead, so that a row that sees no key of a block
        # gets P_ij = exp(-inf - m_i) = 0 where -inf - (-inf) would give NaN
        m_i = torch.full_like(l_i, torch.finfo(Q.dtype).min)              #      m_i = -inf  (..., B_r)
        last_j = min(T_c - 1, (r1 - 1 + shift) // B_c) if causal else T_c - 1  # causal: later blocks all masked
        for j in (range(last_j + 1) if key_blocks is None else key_blocks):  # l.6: for 1 <= j <= T_c
            c0, c1 = j * B_c, min((j + 1) * B_c, N_k)
            K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                 # l.7: load K_j, V_j (..., B_c, d)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.8: S_ij = Q_i K_j^T (..., B_r, B_c)
            if causal:
                S_ij = S_ij.masked_fill(_causal_mask(r0, r1, c0, c1, Q.device, shift), float("-inf"))
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))                 # l.9: m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            P_ij = torch.exp(S_ij - m_new[..., None])                     #      P_ij = exp(S_ij - m_i^(j))
            alpha = torch.exp(m_i - m_new)                                #      rescales what was summed so far
            l_i = alpha * l_i + P_ij.sum(dim=-1)                          #      l_i^(j) = e^(m^(j-1) - m^(j)) l_i^(j-1) + rowsum(P_ij)
            O_i = alpha[..., None] * O_i + P_ij @ V_j                     # l.10: O_i^(j) = diag(e^(m^(j-1) - m^(j))) O_i^(j-1) + P_ij V_j
            m_i = m_new
        # l.12: O_i = diag(l_i)^-1 O_i (a row that saw no key has l_i = 0: its O_i stays 0)
        O[..., r0:r1, :] = O_i / torch.where(l_i > 0, l_i, 1.0)[..., None]
        L[..., r0:r1] = m_i + torch.log(l_i)                              # l.13: L_i = m_i + log(l_i) (-inf if l_i = 0)
    return O, L


def flash_backward(Q, K, V, O, L, dO, causal=False, softmax_scale=None, B_r=64, B_c=64):
    """Algorithm 2 (backward). Recomputes P_ij from Q_i, K_j and L_i; returns dQ, dK, dV."""
    N_q, N_k = Q.shape[-2], K.shape[-2]
    scale = _scale(Q, softmax_scale)
    H_kv = K.shape[-3] if K.dim() > 2 else 0
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    shift = N_k - N_q
    D = (dO * O).sum(dim=-1)                                              # l.4: D = rowsum(dO o O)  (..., N_q)
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for j in range(T_c):                                                  # l.5: for 1 <= j <= T_c
        c0, c1 = j * B_c, min((j + 1) * B_c, N_k)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                     # l.6: load K_j, V_j
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)         # l.7: dK_j = dV_j = 0 (on chip)
        first_i = max(0, c0 - shift) // B_r if causal else 0              # causal: earlier blocks are all masked
        for i in range(first_i, T_r):                                     # l.8: for 1 <= i <= T_r
            r0, r1 = i * B_r, min((i + 1) * B_r, N_q)
            Q_i, dO_i = Q[..., r0:r1, :], dO[..., r0:r1, :]               # l.9: load Q_i, O_i, dO_i, dQ_i, L_i, D_i
            L_i, D_i = L[..., r0:r1], D[..., r0:r1]
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.10: S_ij = Q_i K_j^T
            P_ij = torch.exp(S_ij - L_i[..., None])                       # l.11: P_ij = exp(S_ij - L_i)
            if causal:
                P_ij = P_ij.masked_fill(_causal_mask(r0, r1, c0, c1, Q.device, shift), 0.0)
            dV_j = dV_j + P_ij.transpose(-1, -2) @ dO_i                   # l.12: dV_j += P_ij^T dO_i
            dP_ij = dO_i @ V_j.transpose(-1, -2)                          # l.13: dP_ij = dO_i V_j^T
            dS_ij = P_ij * (dP_ij - D_i[..., None])                       # l.14: dS_ij = P_ij o (dP_ij - D_i)
            dQ[..., r0:r1, :] += scale * dS_ij @ K_j                      # l.15: dQ_i += dS_ij K_j
            dK_j = dK_j + scale * dS_ij.transpose(-1, -2) @ Q_i           # l.16: dK_j += dS_ij^T Q_i
        dK[..., c0:c1, :], dV[..., c0:c1, :] = dK_j, dV_j                 # l.18: write dK_j, dV_j
    return dQ, _sum_over_groups(dK, H_kv), _sum_over_groups(dV, H_kv)


def merge(O_a, L_a, O_b, L_b):
    """Attention over the keys of two parts, from each part's normalised output O and log-sum-exp L
    (..., N) (flash_forward's, or flash_attention(..., return_lse=True)'s): with L = log(l) + m, each part's
    O is its P V divided by its own l, so O = (e^L_a O_a + e^L_b O_b) / (e^L_a + e^L_b). Shifting both
    exponents by their maximum keeps them finite. Returns O and L = log(e^L_a + e^L_b) of the whole.
    A part in which a row saw no key has L = -inf there and weighs 0; if neither part saw one, O = 0."""
    L = torch.logaddexp(L_a, L_b)                                         # (..., N)
    L_safe = torch.where(L == float("-inf"), 0.0, L)                      # (-inf - -inf would be NaN)
    return torch.exp(L_a - L_safe)[..., None] * O_a + torch.exp(L_b - L_safe)[..., None] * O_b, L


def flash_decode(Q, K, V, causal=False, softmax_scale=None, splits=4, B_r=64, B_c=64):
    """Split-KV ("flash-decoding"): Algorithm 1 with the key blocks divided into
    `splits` contiguous ranges. Each range gives a partial O and L over its keys (on a GPU, each range is its
    own thread block, so a few queries still occupy many SMs); merging the parts by L gives attention over
    all keys. (The paper's section 3.2 fills a GPU by running query blocks in parallel; with a single query
    block, as in decoding, only the keys are left to divide.) Returns O and L, as flash_forward."""
    T_c = math.ceil(K.shape[-2] / B_c)
    bounds = [T_c * s // splits for s in range(splits + 1)]               # split s: key blocks bounds[s] .. bounds[s+1]-1
    parts = [flash_forward(Q, K, V, causal, softmax_scale, B_r, B_c, key_blocks=range(bounds[s], bounds[s + 1]))
             for s in range(splits)]
    O, L = parts[0]
    for O_s, L_s in parts[1:]:
        O, L = merge(O, L, O_s, L_s)
    return O, L
