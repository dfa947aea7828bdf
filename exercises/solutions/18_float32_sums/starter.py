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
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    return s, (a - a_virtual) + (b - b_virtual)


def fast_two_sum(a, b):
    """(s, e) as two_sum, in 3 operations instead of 6: exact when |a| >= |b|."""
    s = a + b
    return s, b - (s - a)


def dot_in_chunks(q, K, chunk, compensation):
    """S = q K^T in float32 as a thread of the fp32 kernel sums it: q (P, d), K (P, n, d) -> (P, n). For each chunk
    of `chunk` values of k, part = 0 and then part = fma32(q_k, K_k, part) for k in order; then part goes into acc:
      "none":  acc = acc + part
      "lost":  (acc, e) = fast_two_sum(acc, part), lost = lost + e, and acc + lost at the end (thread_tile_XYt)
      "kahan": y = part - c, then (acc, e) = fast_two_sum(acc, y) and c = -e (the compensation fed back into the
               next addition instead of kept apart; nothing added at the end)"""
    acc = torch.zeros(K.shape[:2])
    carry = torch.zeros_like(acc)
    for k0 in range(0, K.shape[-1], chunk):
        part = torch.zeros_like(acc)
        for k in range(k0, min(k0 + chunk, K.shape[-1])):
            part = fma32(q[:, None, k], K[..., k], part)
        if compensation == "none":
            acc = acc + part
        elif compensation == "lost":
            acc, e = fast_two_sum(acc, part)
            carry = carry + e
        else:
            acc, e = fast_two_sum(acc, part - carry)
            carry = -e
    return acc + carry if compensation == "lost" else acc


def o_error(S, S_exact, V, scale):
    """O's relative error in each row: O = softmax(S * scale) V in float64 from the float32 S (P, n), against the same
    from S_exact (float64); V (P, n, d). Returns (P,) float64: ||O - O_exact|| / ||O_exact|| per problem."""
    O = torch.einsum("pn,pnd->pd", torch.softmax(S.double() * scale, -1), V.double())
    O_exact = torch.einsum("pn,pnd->pd", torch.softmax(S_exact * scale, -1), V.double())
    return (O - O_exact).norm(dim=-1) / O_exact.norm(dim=-1)
