"""Exercise 12: lazy rescaling, the online softmax's update with a threshold (FlashAttention-4's; flash.cu's
hopper forward at d >= 128, update_row_max's tau). Fill in the three TODOs; forward() is given.

Base 2, as the kernels: scores S_ij already carry scale * log2(e), P_ij = 2^(S_ij - m_i), and L = (m_i +
log2(l_i)) / log2(e) in natural-log units. Symbols as in reference.py: S_ij, P_ij (..., B_r, B_c); V_j (..., B_c,
d); m_i, l_i (..., B_r); O_i (..., B_r, d).
"""
import math

import torch

LOG2E = math.log2(math.e)


def block_update(S_ij, V_j, m_i, l_i, O_i, tau):
    """l.9-10 for one key block with lazy rescaling. S_ij: base-2 scores, -inf where masked. A row's m_i moves
    only where the block's row maximum passes it by more than tau (tau >= 0, base-2 units), and then becomes that
    maximum; elsewhere it stays, and alpha = 1 there. tau = 0 is FlashAttention-2's m_i = max(m_i, rowmax).
    Returns (m_i, l_i, O_i, moved), moved (..., B_r) bool: the rows whose m_i moved."""
    row_max = S_ij.amax(dim=-1)
    moved = row_max > m_i + tau
    m_new = torch.where(moved, row_max, m_i)
    alpha = torch.exp2(m_i - m_new)                       # exactly 1 where the row kept m_i
    P_ij = torch.exp2(S_ij - m_new[..., None])            # <= 2^tau
    return m_new, alpha * l_i + P_ij.sum(dim=-1), alpha[..., None] * O_i + P_ij @ V_j, moved


def warps_that_rescale(moved, warp_rows=16):
    """moved (..., B_r) bool, B_r a multiple of warp_rows. Returns (..., B_r // warp_rows) bool: True for a
    warp (warp_rows consecutive rows) some of whose rows moved m_i, the warps that must multiply O_i by alpha."""
    return moved.unflatten(-1, (-1, warp_rows)).any(dim=-1)


def largest_safe_tau(P_dtype):
    """The largest integer tau for which every P_ij <= 2^tau is finite in P_dtype, the dtype of P_ij as the
    operand of P_ij V_j (torch.float16, torch.bfloat16, torch.float8_e4m3fn)."""
    return math.floor(math.log2(torch.finfo(P_dtype).max))


def forward(Q, K, V, causal=False, B_c=16, tau=8.0, moves=None):
    """Algorithm 1 for one query block holding all the rows (B_r = N_q), key blocks of B_c, with block_update.
    Returns O (..., N_q, d) and L (..., N_q). If `moves` is a list, appends each block's `moved`."""
    N_q, N_k, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
    m_i = torch.full(Q.shape[:-1], torch.finfo(Q.dtype).min, dtype=Q.dtype)  # finite stand-in for -inf
    l_i = torch.zeros(Q.shape[:-1], dtype=Q.dtype)
    O_i = torch.zeros_like(Q)
    rows = torch.arange(N_q)[:, None] + N_k - N_q                           # bottom-right causal
    for c0 in range(0, N_k, B_c):
        c1 = min(c0 + B_c, N_k)
        S_ij = Q @ K[..., c0:c1, :].transpose(-1, -2) * (LOG2E / math.sqrt(d))
        if causal:
            S_ij = S_ij.masked_fill(torch.arange(c0, c1)[None, :] > rows, -math.inf)
        m_i, l_i, O_i, moved = block_update(S_ij, V[..., c0:c1, :], m_i, l_i, O_i, tau)
        if moves is not None:
            moves.append(moved)
    return O_i / l_i[..., None], (m_i + torch.log2(l_i)) / LOG2E
