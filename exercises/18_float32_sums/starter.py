"""Exercise 18: the order of a float32 dot product, and what a rounding of S_ij costs O (notebook 04, Part 3,
"Rounding in S_ij"). Fill in the four TODOs.

Every tensor here is float32 and every operation rounds as the GPU's do: `a + b` and `a - b` on float32 tensors
are one IEEE addition each (rounded to nearest), and fma32 below is one fused multiply-add.
"""
import torch


def fma32(a, b, c):
    """a * b + c rounded once to float32, as an FMA does (float64 holds the product of two float32 exactly)."""
    return (a.double() * b.double() + c.double()).float()


def two_sum(a, b):
    """(s, e) with s = a + b rounded and e what that rounding lost: s + e == a + b exactly, for any a and b."""
    raise NotImplementedError("TODO: s = a + b, then what the rounding lost from a and from b (six operations)")


def fast_two_sum(a, b):
    """(s, e) as two_sum, in 3 operations instead of 6: exact when |a| >= |b|."""
    raise NotImplementedError("TODO: s = a + b, and e from s - a (three operations)")


def dot_in_chunks(q, K, chunk, compensation):
    """S = q K^T in float32 as a thread of the fp32 kernel sums it: q (P, d), K (P, n, d) -> (P, n). For each chunk
    of `chunk` values of k, part = 0 and then part = fma32(q_k, K_k, part) for k in order; then part goes into acc:
      "none":  acc = acc + part
      "lost":  (acc, e) = fast_two_sum(acc, part), lost = lost + e, and acc + lost at the end (thread_tile_XYt)
      "kahan": y = part - c, then (acc, e) = fast_two_sum(acc, y) and c = -e (the compensation fed back into the
               next addition instead of kept apart; nothing added at the end)"""
    raise NotImplementedError("TODO: chunks of FMAs into part, then part into acc three ways")


def o_error(S, S_exact, V, scale):
    """O's relative error in each row: O = softmax(S * scale) V in float64 from the float32 S (P, n), against the same
    from S_exact (float64); V (P, n, d). Returns (P,) float64: ||O - O_exact|| / ||O_exact|| per problem."""
    raise NotImplementedError("TODO: O from S and from S_exact in float64, the relative error of each row")
