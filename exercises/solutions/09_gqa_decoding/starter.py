"""Exercise 09: grouped-query attention, the bottom-right causal mask, and a decoding step's packed rows. Fill in
the six TODOs; README.md says what each one is for.

Shapes: Q (B, H_q, N_q, d); K, V (B, H_kv, N_k, d), with H_kv dividing H_q: G = H_q // H_kv query heads share
each key/value head. Everything in float64, softmax scale 1 / sqrt(d).
"""
import math

import torch


def kv_head(h, H_q, H_kv):
    """The key/value head that query head h reads."""
    # TODO 1: consecutive query heads share a key/value head
    return h // (H_q // H_kv)


def visible(N_q, N_k):
    """(N_q, N_k) bool, True where query i may see key j under the causal mask aligned to the bottom right
    (FlashAttention >= 2.1): the last query sees every key, as the newest token of a decoding step does."""
    # TODO 2
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    return j <= i + N_k - N_q


def attention_gqa(Q, K, V, causal=False):
    """O (B, H_q, N_q, d) and the natural-log L (B, H_q, N_q): query head h against key/value head
    kv_head(h, H_q, H_kv). A row that sees no key (causal, N_q > N_k) gets O = 0 and L = -inf."""
    # TODO 3
    B, H_q, N_q, d = Q.shape
    H_kv, N_k = K.shape[1], K.shape[2]
    heads = [kv_head(h, H_q, H_kv) for h in range(H_q)]
    S = Q @ K[:, heads].transpose(-1, -2) / math.sqrt(d)                  # (B, H_q, N_q, N_k)
    if causal:
        S = S.masked_fill(~visible(N_q, N_k), -math.inf)
    L = torch.logsumexp(S, dim=-1)
    P = torch.exp(S - torch.where(torch.isinf(L), torch.zeros_like(L), L)[..., None])  # rows seeing nothing: 0
    return P @ V[:, heads], L


def sum_over_groups(dX, H_kv):
    """dK or dV of the key/value heads, (B, H_kv, N_k, d), from dX (B, H_q, N_k, d), the gradient each query head
    sends to the key/value head it reads."""
    # TODO 4
    B, H_q, N_k, d = dX.shape
    return dX.reshape(B, H_kv, H_q // H_kv, N_k, d).sum(dim=2)


def pack_rows(Q, H_kv):
    """A decoding step's packed rows, (B, H_kv, N_q G, d) from Q (B, H_q, N_q, d): for each sequence and key/value
    head h_kv, the rows of its G query heads stacked into one block of queries, query-major: row x is query x // G
    of head h_kv G + x % G, so that the G rows of one query sit together (flash.cu packs the other way, head-major:
    notebook 09, section 5)."""
    # TODO 5
    B, H_q, N_q, d = Q.shape
    G = H_q // H_kv
    return Q.reshape(B, H_kv, G, N_q, d).transpose(2, 3).reshape(B, H_kv, N_q * G, d)  # row x: (x // G, x % G)


def decode_packed(Q, K, V, causal=False):
    """attention_gqa's O and L, computed on packed rows as a decoding kernel does: for each sequence and key/value
    head, the block of rows pack_rows(Q, H_kv) gives attends to the head's K and V once, for the whole group; then
    O and L are unstacked to (B, H_q, N_q, d) and (B, H_q, N_q)."""
    # TODO 6
    B, H_q, N_q, d = Q.shape
    H_kv, N_k = K.shape[1], K.shape[2]
    G = H_q // H_kv
    rows = pack_rows(Q, H_kv)                                             # (B, H_kv, N_q G, d)
    S = rows @ K.transpose(-1, -2) / math.sqrt(d)                         # (B, H_kv, N_q G, N_k)
    if causal:
        S = S.masked_fill(~visible(N_q, N_k)[torch.arange(N_q * G) // G], -math.inf)  # row x is query x // G
    L = torch.logsumexp(S, dim=-1)
    P = torch.exp(S - torch.where(torch.isinf(L), torch.zeros_like(L), L)[..., None])
    O = (P @ V).reshape(B, H_kv, N_q, G, d).transpose(2, 3).reshape(B, H_q, N_q, d)
    return O, L.reshape(B, H_kv, N_q, G).transpose(2, 3).reshape(B, H_q, N_q)
