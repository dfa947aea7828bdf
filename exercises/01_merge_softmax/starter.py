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
    raise NotImplementedError("TODO 1: combine")


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
        raise NotImplementedError("TODO 2: split_kv_attention")
