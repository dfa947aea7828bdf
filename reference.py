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
    key/value head h // (H_q / H_kv), and dK, dV sum over the query heads of a group;
  - masks and score modifications, as FlashAttention's arguments: a window, window_size = (left, right),
    around each query's diagonal position i + N_k - N_q (causal is right = 0), ALiBi slopes and a softcap,
    applied to S_ij in one step (_modified, _hidden) before the online softmax; key blocks outside every window
    are skipped;
  - packed batches of sequences of different lengths (attention_varlen, FlashAttention's varlen layout): each
    sequence on its own rows, with its own N_q and N_k;
  - dropout of P_ij, as the first FlashAttention paper's Algorithms 2 and 4 (Dao et al., 2022, appendix B):
    O_i takes P_ij o Z_ij V_j while l_i sums P_ij itself, and the backward regenerates the same Z_ij
    (dropout_keep: the kernels' Philox bits, so that a kernel and this module drop the same entries).
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


def _window(causal, window):
    """(left, right) with causal as right = 0, FlashAttention's rule; -1 is no bound."""
    return (window[0], 0 if causal else window[1])


def _hidden(r0, r1, c0, c1, device, shift=0, window=(-1, -1)):
    """True where key c may not be seen by query r, for rows r0:r1 and columns c0:c1: outside the window
    r + shift - left <= c <= r + shift + right (a side of -1 has no bound). shift = N_k - N_q aligns the
    diagonal to the bottom right: with window (-1, 0) (causal), query r sees keys c <= r + shift."""
    r = torch.arange(r0, r1, device=device)[:, None]
    c = torch.arange(c0, c1, device=device)[None, :]
    left, right = window
    hidden = torch.zeros(r1 - r0, c1 - c0, dtype=torch.bool, device=device)  # (B_r, B_c)
    if right >= 0:
        hidden |= c > r + shift + right
    if left >= 0:
        hidden |= c < r + shift - left
    return hidden


def _modified(S, r0, c0, shift=0, softcap=0.0, alibi_slopes=None):
    """The score modifications on scaled scores S (..., H_q, rows, cols) of queries r0.. and keys c0..: a softcap
    c > 0 (S = c tanh(S / c)), then ALiBi (S -= slope_h |r + shift - c|, slopes (H_q,) or (B, H_q))."""
    if softcap > 0:
        S = softcap * torch.tanh(S / softcap)
    if alibi_slopes is not None:
        r = torch.arange(r0, r0 + S.shape[-2], device=S.device)[:, None]
        c = torch.arange(c0, c0 + S.shape[-1], device=S.device)[None, :]
        S = S - alibi_slopes.to(S.dtype)[..., None, None] * (r + shift - c).abs()
    return S


def _blocks(first, last, size, count):
    """The blocks of `size` that hold anything of first..last (clipped to 0..count-1 blocks)."""
    return range(max(0, first) // size, min(count - 1, last // size) + 1) if last >= 0 else range(0)


def philox(x, key, rounds=7):
    """Philox4x32-7 (Salmon et al., SC 2011), the kernels' counter-based generator: 128 random bits from a
    counter x (..., 4) and a key (k0, k1), all 32-bit words held in int64 tensors. Seven rounds (as
    FlashAttention-2; the paper's default is 10) of two 32 x 32 -> 64-bit products (split into 16-bit halves
    here, since int64 cannot hold them) mixed with the key, which Weyl constants bump between rounds."""
    def mulhilo(m, a):  # (m a) >> 32 and (m a) mod 2^32, exactly
        lo16, hi16 = a * (m & 0xFFFF), a * (m >> 16)               # each < 2^48
        return (hi16 + (lo16 >> 16)) >> 16, ((hi16 & 0xFFFF) << 16) + lo16 & 0xFFFFFFFF
    x0, x1, x2, x3 = x.unbind(-1)
    k0, k1 = key
    for round in range(rounds):
        if round > 0:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        hi0, lo0 = mulhilo(0xD2511F53, x0)
        hi1, lo1 = mulhilo(0xCD9E8D57, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
    return torch.stack((x0, x1, x2, x3), -1)


def dropout_threshold(dropout_p):
    """An entry is dropped when its random byte is below this: p is rounded to the nearest multiple of 1/256, a half
    upwards, as flash.cu's std::lround does (Python's round would take 32.5 to 32, the kernels to 33)."""
    return min(math.floor(dropout_p * 256 + 0.5), 255)


def dropout_scale(dropout_p):
    """1 / (1 - p) for the rounded p: the factor of a kept entry, so that Z_ij averages exactly 1."""
    return 256 / (256 - dropout_threshold(dropout_p))


def dropout_keep(seed, shape, dropout_p, device=None, first_batch=0, first_row=0, first_col=0):
    """The keep mask (B, H_q, N_q, N_k), bool, that the kernels draw for Philox key `seed` (a 64-bit int): entry
    (b, h, r, c) is kept when its random byte is >= dropout_threshold. One Philox call serves the 16 entries of
    rows {r, r + 8} x columns {c, c + 1, c + 8, c + 9, c + 16, c + 17, c + 24, c + 25} of a 16 x 32 tile (what
    one lane holds of four 16 x 8 tiles in the tensor cores' m16n8 layout); its counter is (column group, row
    group, h, b) and the entry's byte is byte 4 (c/8 mod 4) + 2 (r/8 mod 2) + c mod 2 of the 16, little-endian.
    first_batch, first_row, first_col: where the mask starts (a block Z_ij; in a packed batch, sequence b is
    batch b, its rows and keys counted from its start)."""
    B, H, N_q, N_k = shape
    r, c = torch.arange(first_row, first_row + N_q, device=device), torch.arange(first_col, first_col + N_k,
                                                                                  device=device)
    row_group, col_group = 8 * (r // 16) + r % 8, 4 * (c // 32) + c % 8 // 2       # (N_q,), (N_k,)
    slot = 4 * (c[None, :] // 8 % 4) + 2 * (r[:, None] // 8 % 2) + c[None, :] % 2   # (N_q, N_k)
    R, C = row_group.unique(), col_group.unique()                                    # the calls it takes
    b, h, R_, C_ = torch.meshgrid(torch.arange(first_batch, first_batch + B, device=device),
                                  torch.arange(H, device=device), R, C, indexing="ij")  # (B, H, rows, cols)
    words = philox(torch.stack((C_, R_, h, b), -1), (seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF))
    bytes_ = torch.stack([words >> 8 * e & 0xFF for e in range(4)], -1).flatten(-2)  # (B, H, rows, cols, 16)
    rows, cols = torch.searchsorted(R, row_group), torch.searchsorted(C, col_group)  # each entry's call
    return bytes_[:, :, rows[:, None], cols[None, :], slot] >= dropout_threshold(dropout_p)


def _dropout_block(Q, dropout_p, dropout_seed, r0, r1, c0, c1):
    """Z_ij for rows r0:r1 and keys c0:c1 of Q (B, H_q, N_q, d) or (H_q, N_q, d): 0 where dropped, else the
    scale 1 / (1 - p); 1 without dropout."""
    if dropout_p == 0:
        return 1.0
    B, H = (1, *Q.shape[-3:-2]) if Q.dim() == 3 else Q.shape[:2]
    keep = dropout_keep(dropout_seed, (B, H, r1 - r0, c1 - c0), dropout_p, Q.device, first_row=r0, first_col=c0)
    return (keep * dropout_scale(dropout_p)).to(Q.dtype).reshape(*Q.shape[:-2], r1 - r0, c1 - c0)


def attention(Q, K, V, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None, softcap=0.0,
              dropout=None):
    """Standard attention softmax(Q K^T * scale) V; builds the whole N_q x N_k matrix (the thing to avoid).
    A row whose keys are all masked gets 0 (FlashAttention's convention; softmax alone would give NaN).
    dropout: Z (..., H_q, N_q, N_k), the factor of each entry of P (0 or 1 / (1 - p)): O = (P o Z) V."""
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    N_q, N_k = Q.shape[-2], K.shape[-2]
    S = Q @ K.transpose(-1, -2) * _scale(Q, softmax_scale)                # (..., N_q, N_k)
    S = _modified(S, 0, 0, N_k - N_q, softcap, alibi_slopes)
    window = _window(causal, window_size)
    if window == (-1, -1):                                                # no mask: no passes over S and P for it
        P = torch.softmax(S, dim=-1)
    else:
        hidden = _hidden(0, N_q, 0, N_k, Q.device, N_k - N_q, window)
        P = torch.softmax(S.masked_fill(hidden, float("-inf")), dim=-1)
        P = P.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    return (P if dropout is None else P * dropout) @ V                     # (..., N_q, d)


def flash_forward(Q, K, V, causal=False, softmax_scale=None, B_r=64, B_c=64, key_blocks=None,
                  window_size=(-1, -1), alibi_slopes=None, softcap=0.0, dropout_p=0.0, dropout_seed=0, tau=0.0):
    """Algorithm 1 (forward). Returns O (..., N_q, d) and L (..., N_q), the row log-sum-exp.
    key_blocks: the key blocks j to visit (default: all T_c that the window reaches); split-KV (flash_decode)
    visits one range of them per part and merges the parts. dropout_p > 0: each block draws its Z_ij from
    dropout_seed (dropout_keep), as the kernels do; Q is then (B, H_q, N_q, d) or (H_q, N_q, d).
    tau > 0: lazy rescaling (the ampere forward, but for its int8 build at d <= 64, and the Hopper forward at
    d >= 128, with tau = 8 ln 2): m_i moves only where a block's row maximum passes it by more than tau. O and L do
    not change: O_i, l_i and L_i all use the same m_i, and P_ij <= e^tau."""
    if tau < 0:
        raise ValueError(f"tau must be >= 0 (m_i may only lag behind the row maximum), got {tau}")
    N_q, N_k = Q.shape[-2], K.shape[-2]
    scale = _scale(Q, softmax_scale)
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    shift = N_k - N_q                                                     # query r's diagonal key: r + shift
    left, right = window = _window(causal, window_size)
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
        # the key blocks some row of the block sees: the window's reach (blocks outside it are all masked)
        reach = _blocks(r0 + shift - left if left >= 0 else 0, r1 - 1 + shift + right if right >= 0 else N_k,
                        B_c, T_c)
        for j in (reach if key_blocks is None else key_blocks):           # l.6: for 1 <= j <= T_c
            c0, c1 = j * B_c, min((j + 1) * B_c, N_k)
            K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                 # l.7: load K_j, V_j (..., B_c, d)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.8: S_ij = Q_i K_j^T (..., B_r, B_c)
            S_ij = _modified(S_ij, r0, c0, shift, softcap, alibi_slopes)  #      softcap, ALiBi, the mask
            S_ij = S_ij.masked_fill(_hidden(r0, r1, c0, c1, Q.device, shift, window), float("-inf"))
            row_max = S_ij.amax(dim=-1)                                   # l.9: m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            m_new = torch.where(row_max > m_i + tau, row_max, m_i)        #      (tau = 0; else moved only past m_i + tau)
            P_ij = torch.exp(S_ij - m_new[..., None])                     #      P_ij = exp(S_ij - m_i^(j))
            alpha = torch.exp(m_i - m_new)                                #      rescales what was summed so far
            l_i = alpha * l_i + P_ij.sum(dim=-1)                          #      l_i^(j) = e^(m^(j-1) - m^(j)) l_i^(j-1) + rowsum(P_ij)
            # dropout, after the row sum (the first paper's Algorithm 2, line 14): P_ij o Z_ij
            P_ij = P_ij * _dropout_block(Q, dropout_p, dropout_seed, r0, r1, c0, c1)
            O_i = alpha[..., None] * O_i + P_ij @ V_j                     # l.10: O_i^(j) = diag(e^(m^(j-1) - m^(j))) O_i^(j-1) + P_ij V_j
            m_i = m_new
        # l.12: O_i = diag(l_i)^-1 O_i (a row that saw no key has l_i = 0: its O_i stays 0)
        O[..., r0:r1, :] = O_i / torch.where(l_i > 0, l_i, 1.0)[..., None]
        L[..., r0:r1] = m_i + torch.log(l_i)                              # l.13: L_i = m_i + log(l_i) (-inf if l_i = 0)
    return O, L


def flash_backward(Q, K, V, O, L, dO, causal=False, softmax_scale=None, B_r=64, B_c=64, window_size=(-1, -1),
                   alibi_slopes=None, softcap=0.0, dropout_p=0.0, dropout_seed=0):
    """Algorithm 2 (backward). Recomputes P_ij from Q_i, K_j and L_i; returns dQ, dK, dV. dropout_p,
    dropout_seed: the forward's; Z_ij is regenerated rather than stored (the first paper's Algorithm 4, lines
    14-18): dV_j takes P_ij o Z_ij, and dP_ij is multiplied by Z_ij before dS_ij; D_i = rowsum(dO_i o O_i) still
    holds, O having been dropped."""
    N_q, N_k = Q.shape[-2], K.shape[-2]
    scale = _scale(Q, softmax_scale)
    H_kv = K.shape[-3] if K.dim() > 2 else 0
    K, V = _query_heads(K, Q), _query_heads(V, Q)
    T_r, T_c = math.ceil(N_q / B_r), math.ceil(N_k / B_c)
    shift = N_k - N_q
    left, right = window = _window(causal, window_size)
    D = (dO * O).sum(dim=-1)                                              # l.4: D = rowsum(dO o O)  (..., N_q)
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for j in range(T_c):                                                  # l.5: for 1 <= j <= T_c
        c0, c1 = j * B_c, min((j + 1) * B_c, N_k)
        K_j, V_j = K[..., c0:c1, :], V[..., c0:c1, :]                     # l.6: load K_j, V_j
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)         # l.7: dK_j = dV_j = 0 (on chip)
        # the query blocks that see some key of the block: those whose window reaches it
        reach = _blocks(c0 - shift - right if right >= 0 else 0, c1 - 1 - shift + left if left >= 0 else N_q,
                        B_r, T_r)
        for i in reach:                                                   # l.8: for 1 <= i <= T_r
            r0, r1 = i * B_r, min((i + 1) * B_r, N_q)
            Q_i, dO_i = Q[..., r0:r1, :], dO[..., r0:r1, :]               # l.9: load Q_i, O_i, dO_i, dQ_i, L_i, D_i
            L_i, D_i = L[..., r0:r1], D[..., r0:r1]
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale                    # l.10: S_ij = Q_i K_j^T
            P_ij = torch.exp(_modified(S_ij, r0, c0, shift, softcap, alibi_slopes) - L_i[..., None])  # l.11
            P_ij = P_ij.masked_fill(_hidden(r0, r1, c0, c1, Q.device, shift, window), 0.0)  # P_ij = exp(S_ij - L_i)
            Z_ij = _dropout_block(Q, dropout_p, dropout_seed, r0, r1, c0, c1)  # dropout: P_ij o Z_ij, dP_ij o Z_ij
            dV_j = dV_j + (P_ij * Z_ij).transpose(-1, -2) @ dO_i          # l.12: dV_j += P_ij^T dO_i
            dP_ij = dO_i @ V_j.transpose(-1, -2) * Z_ij                   # l.13: dP_ij = dO_i V_j^T
            dS_ij = P_ij * (dP_ij - D_i[..., None])                       # l.14: dS_ij = P_ij o (dP_ij - D_i)
            if softcap > 0:  # through the softcap: d(c tanh(S / c))/dS = 1 - tanh^2 (ALiBi adds a constant)
                dS_ij = dS_ij * (1 - torch.tanh(S_ij / softcap) ** 2)
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


def flash_decode(Q, K, V, causal=False, softmax_scale=None, splits=4, B_r=64, B_c=64, **scores):
    """Split-KV ("flash-decoding"): Algorithm 1 with the key blocks divided into
    `splits` contiguous ranges. Each range gives a partial O and L over its keys (on a GPU, each range is its
    own thread block, so a few queries still occupy many SMs); merging the parts by L gives attention over
    all keys. (The paper's section 3.2 fills a GPU by running query blocks in parallel; with a single query
    block, as in decoding, only the keys are left to divide.) Returns O and L, as flash_forward; scores:
    window_size, alibi_slopes, softcap, as there."""
    T_c = math.ceil(K.shape[-2] / B_c)
    bounds = [T_c * s // splits for s in range(splits + 1)]               # split s: key blocks bounds[s] .. bounds[s+1]-1
    parts = [flash_forward(Q, K, V, causal, softmax_scale, B_r, B_c, range(bounds[s], bounds[s + 1]), **scores)
             for s in range(splits)]
    O, L = parts[0]
    for O_s, L_s in parts[1:]:
        O, L = merge(O, L, O_s, L_s)
    return O, L


def attention_varlen(Q, K, V, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, window_size=(-1, -1),
                     alibi_slopes=None, softcap=0.0):
    """A packed batch (FlashAttention's varlen layout): Q (total_q, H_q, d), K, V (total_k, H_kv, d), sequence b
    at rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 and cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1. Each sequence is
    attention() on its own rows, so every mask is aligned to its own N_q and N_k; alibi_slopes (H_q,) or
    (B, H_q). The kernels do the same in one launch: a block of the grid per (query block, head, sequence)."""
    q, k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    parts = []
    for b in range(len(q) - 1):
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        Q_b, K_b, V_b = (X[s:e].transpose(0, 1) for X, s, e in ((Q, q[b], q[b + 1]), (K, k[b], k[b + 1]),
                                                               (V, k[b], k[b + 1])))  # (H, N, d)
        parts.append(attention(Q_b, K_b, V_b, causal, softmax_scale, window_size, slopes, softcap).transpose(0, 1))
    return torch.cat(parts)                                                # (total_q, H_q, d)


# 8-bit attention (flash.cu's section 8), forward only: the quantization the kernels' inputs get, and the
# attention they compute, in float64 apart from the roundings to 8 bits.
QUANT_ROWS = 128  # rows of a head per scale
FP8_MAX, INT8_MAX = 448.0, 127.0  # the largest e4m3 value; int8's symmetric range
FP8_QK_MAX = 16.0  # fp8's Q and K up to d = 128: 128 products sum to at most 32768, which fp16 (the kernel's S) holds


def fp8_qk_max(d):
    """fp8's largest |x_hat| for Q and K of head dim d: FP8_QK_MAX up to d = 128, 11 up to 256 (256 * 11^2 = 30976),
    so that the kernel's fp16 sums of d products stay within 32768."""
    return FP8_QK_MAX if d <= 128 else 11.0


def rotation(D, signs):
    """R = diag(signs) H_D / sqrt(D), H_D Sylvester's Hadamard matrix (H_1 = 1, H_2n = [[H, H], [H, -H]]): orthogonal,
    so (Q R)(K R)^T = Q K^T. flash_quantize applies it as log2(D) butterfly stages instead of a D x D product."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    return torch.diag(signs.double().cpu()) @ H / math.sqrt(D)


def key_position(c):
    """Where V_j^T holds key c of each 16 (flash.cu's key_position): the order in which P_ij's accumulators hold
    the keys (lane t: 2t, 2t+1, 2t+8, 2t+9), so that P_ij needs no shuffle to become an 8-bit A fragment."""
    return 4 * (c % 8 // 2) + c % 2 + 2 * (c // 8)


def round_8bit(x, dtype):
    """x (already divided by its scale) rounded to the nearest value of dtype, as float64: e4m3 (3 mantissa bits,
    saturating at 448) or int8 (integers, -127 .. 127)."""
    if dtype == torch.int8:
        return x.round().clamp(-INT8_MAX, INT8_MAX)
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double()


def quantize_blocks(X, dtype, rows=QUANT_ROWS, value_range=None):
    """X (B, H, N, d) -> (X_hat, s): X_hat on dtype's grid (as float64) and s (B, H, T) with X ~ s X_hat row block
    by row block, s = max |X| / value_range over each block of `rows` rows (1 where the block is 0). value_range:
    by default 448 (e4m3) or 127 (int8)."""
    B, H, N, d = X.shape
    T = math.ceil(N / rows)
    blocks = torch.nn.functional.pad(X.double(), (0, 0, 0, T * rows - N)).view(B, H, T, rows, d)
    amax = blocks.abs().amax((-2, -1))
    value_range = value_range or (FP8_MAX if dtype != torch.int8 else INT8_MAX)
    s = torch.where(amax > 0, amax / value_range, torch.ones_like(amax))
    X_hat = round_8bit(blocks / s[..., None, None], dtype).view(B, H, T * rows, d)[:, :, :N]
    return X_hat, s


def attention_8bit(Q, K, V, dtype=torch.float8_e4m3fn, causal=False, softmax_scale=None, window_size=(-1, -1),
                   signs=None, smooth_k=False):
    """What flash_attention_8bit computes: Q and K (rotated by rotation(d, signs) if signs is given; K minus its
    mean over the keys if smooth_k) quantized by blocks of QUANT_ROWS rows, and S_hat = Q_hat K_hat^T, which the fp8
    kernel sums in fp16 (Q and K scaled to |x_hat| <= fp8_qk_max(d) for that; rounded here once, where the kernel rounds
    after each 32 columns of d); for fp8 also V, and P = softmax rounded to e4m3 after scaling by 2^8 (each row's
    largest entry becomes 256), as the kernel's P_ij V_j takes it; for int8, V and P stay as they are (the kernel keeps
    them in fp16/bf16)."""
    scale = _scale(Q, softmax_scale)
    Q, K, V = Q.double(), K.double(), V.double()
    if smooth_k:
        K = K - K.mean(-2, keepdim=True)
    if signs is not None:
        R = rotation(Q.shape[-1], signs).to(Q.device)
        Q, K = Q @ R, K @ R
    fp8 = dtype != torch.int8
    qk_range = fp8_qk_max(Q.shape[-1]) if fp8 else None
    (Q_hat, s_Q), (K_hat, s_K) = (quantize_blocks(X, dtype, value_range=qk_range) for X in (Q, K))
    S_hat = Q_hat @ _query_heads(K_hat, Q).transpose(-1, -2)
    if fp8:
        S_hat = S_hat.half().double()
    N_q, N_k = S_hat.shape[-2:]
    per_row = lambda s, N: s.repeat_interleave(QUANT_ROWS, -1)[..., :N, None]  # (B, H, T) -> (B, H, N, 1)
    S = S_hat * per_row(s_Q, N_q) * per_row(_query_heads(s_K[..., None], Q)[..., 0], N_k).transpose(-1, -2) * scale
    if fp8:
        V_hat, s_V = quantize_blocks(V, dtype)
        V = V_hat * per_row(s_V, V.shape[-2])
    S = S.masked_fill(_hidden(0, N_q, 0, N_k, S.device, N_k - N_q, _window(causal, window_size)), -math.inf)
    P = torch.exp(S - S.amax(-1, keepdim=True)) * 256
    l = P.sum(-1, keepdim=True)
    if fp8:
        P = round_8bit(P, dtype)
    return torch.nan_to_num(P / l) @ _query_heads(V, Q)
