"""Exercise 01: merge two partial softmax results (m, l, O~). Fill in the two TODOs.

A partial result over a set of keys A, for every query row (notebook 03, section 3):
    m_A  = max_{c in A} s_c                            (..., N_q)      the row max
    l_A  = sum_{c in A} exp(s_c - m_A)                 (..., N_q)      the row sum
    O~_A = sum_{c in A} exp(s_c - m_A) v_c             (..., N_q, d)   the unnormalised output
A set with no keys (for example a block that the causal mask hides completely) is m = -inf, l = 0, O~ = 0.
"""
import torch


def merge(a, b):
    """(m, l, O~) over the keys of a and of b together, from the two partial results a = (m_a, l_a, O_a)
    and b = (m_b, l_b, O_b) over disjoint key sets. Shapes (..., N_q), (..., N_q), (..., N_q, d).

    Must be exact (it is the union's triple, not an approximation) and must give the empty triple
    (-inf, 0, 0) without NaN when both parts are empty."""
    (m_a, l_a, O_a), (m_b, l_b, O_b) = a, b
    # TODO 1: m = max(m_a, m_b); rescale each part by exp(m_x - m) and add. Where both parts are empty,
    # m = -inf and exp(-inf - (-inf)) is NaN: use a finite stand-in for m in the exponentials there.
    raise NotImplementedError("TODO 1: merge (m, l, O~)")
    return m, l, O


def merge_normalised(a, b):
    """The same merge for normalised results a = (O_a, L_a), b = (O_b, L_b), with O_x = O~_x / l_x and
    L_x = m_x + log(l_x) the row log-sum-exp (what a split-KV kernel writes per part).
    Returns (O, L) over both key sets. Must not overflow for L of a few thousand."""
    (O_a, L_a), (O_b, L_b) = a, b
    # TODO 2: L = log(exp(L_a) + exp(L_b)), computed without overflow; O = weights exp(L_x - L) times O_x.
    raise NotImplementedError("TODO 2: merge (O, L)")
    return O, L
