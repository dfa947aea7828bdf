"""Exercise 01: combine the partial results of a split-KV forward. Fill in the two TODOs.

A split-KV kernel cuts the keys of every row into k parts, runs the forward on each part separately (in
parallel, on different thread blocks), and writes per part a normalised output and a log-sum-exp:
    O_k     = sum_{c in part k} 2^(s'_c) v_c / sum_{c in part k} 2^(s'_c)     (..., N_q, d)
    lse2_k  = log2( sum_{c in part k} 2^(s'_c) )                               (..., N_q)
in base 2, as the kernels keep their scores: s'_c = (q . k_c) * softmax_scale * log2(e), so that
2^(s'_c) = e^(s_c). A part with no visible key for a row (all its keys masked, or no keys at all) has
lse2_k = -inf there, and its O_k is whatever the kernel left: it may hold NaN.
"""
import math

import torch

LOG2E = 1.0 / math.log(2.0)      # log2(e)
LN2 = math.log(2.0)              # ln(2): a base-2 logarithm times LN2 is a natural one


def combine(O_parts, lse2_parts):
    """O (..., N_q, d) and lse2 (..., N_q) over all k parts, from O_parts (k, ..., N_q, d) and
    lse2_parts (k, ..., N_q). Exact; in one pass over the parts (no pairwise fold needed); no overflow
    for lse2 of a few thousand; empty parts contribute nothing even when their O holds NaN; a row that
    every part leaves empty gets O = 0 and lse2 = -inf."""
    # TODO 1: weights 2^(lse2_k - M) relative to the largest lse2 M of each row, then O and lse2.
    M = lse2_parts.amax(dim=0)                                            # (..., N_q) the largest part
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))            # all parts empty: any finite M
    w = torch.exp2(lse2_parts - M)                                        # (k, ..., N_q) in [0, 1]
    total = w.sum(dim=0)                                                  # (..., N_q) >= 1 unless all empty
    terms = torch.where(w[..., None] > 0, w[..., None] * O_parts, torch.zeros_like(O_parts))  # 0 * NaN is NaN
    O = terms.sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return O, M + torch.log2(total)                                       # log2(0) = -inf for empty rows


def split_kv_attention(Q, K, V, n_splits, causal=False, softmax_scale=None):
    """Attention computed as a split-KV kernel does it: keys cut into n_splits contiguous parts, part s
    holding keys s*N // n_splits .. (s+1)*N // n_splits - 1 (a part may hold no key when n_splits > N);
    per part O_s and lse2_s computed on their own, then combined. Q, K, V (..., N, d). Causal: query r
    sees key c only when c <= r. Returns O (..., N, d) and L (..., N), L the natural-log log-sum-exp of
    the scaled scores (what Algorithm 1 writes)."""
    N, d = Q.shape[-2], Q.shape[-1]
    scale_log2 = (1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale) * LOG2E
    O_parts, lse2_parts = [], []
    for s in range(n_splits):
        # TODO 2: this part's keys, its scores in base 2 (masked), its O_s and lse2_s; then combine.
        c0, c1 = s * N // n_splits, (s + 1) * N // n_splits
        S = Q @ K[..., c0:c1, :].transpose(-1, -2) * scale_log2          # (..., N, c1 - c0) base 2
        if causal:
            r = torch.arange(N, device=Q.device)[:, None]
            c = torch.arange(c0, c1, device=Q.device)[None, :]            # absolute key indices
            S = S.masked_fill(c > r, -math.inf)
        lse2 = torch.logsumexp(S * LN2, dim=-1) * LOG2E                   # (..., N); -inf where all masked
        P = torch.exp2(S - lse2[..., None])                               # NaN on rows with no key: ignored
        O_parts.append(P @ V[..., c0:c1, :])
        lse2_parts.append(lse2)
    O, lse2 = combine(torch.stack(O_parts), torch.stack(lse2_parts))
    return O, lse2 * LN2
