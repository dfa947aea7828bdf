"""Grader for exercise 18: python exercises/grade.py 18

Exactness is checked bit for bit: s against float32's own a + b, e against the exact a + b - s (float64 holds it for
the magnitudes used here, 2^-12 to 2^12), and S against the same operations in the same order. The last test runs
the exercise's measurement: the orders of thread_tile_XYt in flash.cu on random one-query problems.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)


def pairs(seed=0, n=4000):
    """float32 pairs over 24 binary orders of magnitude, half with |b| > |a|, some exact cancellations and zeros."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * 2.0 ** torch.randint(-12, 13, (n,), generator=g)
    b = torch.randn(n, generator=g) * 2.0 ** torch.randint(-12, 13, (n,), generator=g)
    b[:50], a[50:60], b[60:70] = -a[:50], 0.0, 0.0
    return a.float(), b.float()


def same_bits(x, y):
    return x.shape == y.shape and torch.equal(x.float().view(torch.int32), y.float().view(torch.int32))


def test_two_sum():
    a, b = pairs()
    s, e = ans.two_sum(a, b)
    assert s.dtype == e.dtype == torch.float32, f"two_sum: float32 results expected, got {s.dtype}, {e.dtype}"
    assert same_bits(s, a + b), "two_sum: s must be float32's own a + b (one rounded addition)"
    exact = a.double() + b.double()
    wrong = (s.double() + e.double() != exact).nonzero().flatten()
    if len(wrong):
        i = wrong[0].item()
        fast = b - (s - a)
        hint = (" This is Fast2Sum's e = b - (s - a): exact only when |a| >= |b|; 2Sum also recovers what the rounding "
                "took from a." if same_bits(e[wrong], fast[wrong]) else "")
        raise AssertionError(f"two_sum: s + e != a + b in {len(wrong)} of {len(a)} pairs, e.g. a = {a[i].item()!r}, "
                             f"b = {b[i].item()!r}: s = {s[i].item()!r}, e = {e[i].item()!r}, exact remainder "
                             f"{(exact[i] - s[i].double()).item()!r}." + hint)


def test_fast_two_sum():
    a, b = pairs(1)
    s, e = ans.fast_two_sum(a, b)
    assert same_bits(s, a + b), "fast_two_sum: s must be float32's own a + b"
    big = a.abs() >= b.abs()
    assert (s.double() + e.double() == a.double() + b.double())[big].all(), \
        "fast_two_sum: s + e != a + b for a pair with |a| >= |b|, where Fast2Sum is exact"
    if not same_bits(e, b - (s - a)):
        hint = (" That is 2Sum's six operations (exact for every pair); Fast2Sum is e = b - (s - a), three in all."
                if (s.double() + e.double() == a.double() + b.double()).all() else
                " With |a| >= |b|, s - a is exactly the part of b that s holds: e = b - (s - a).")
        raise AssertionError("fast_two_sum: e differs from b - (s - a) for some pairs." + hint)


def chunk_sums(q, K, chunk):
    """The grader's own copy of each chunk's part: FMAs from 0 over the chunk's values of k, in order."""
    d = K.shape[-1]
    for k0 in range(0, d, chunk):
        part = torch.zeros(K.shape[:2])
        for k in range(k0, min(k0 + chunk, d)):
            part = (q[:, None, k].double() * K[..., k].double() + part.double()).float()
        yield part


def expected_S(q, K, chunk, compensation, kahan_sign=1):
    """The grader's own copy of the order: each part into acc (kahan_sign=-1: Kahan with c's sign flipped, a mistake)."""
    acc, carry = torch.zeros(K.shape[:2]), torch.zeros(K.shape[:2])
    for part in chunk_sums(q, K, chunk):
        x = part - kahan_sign * carry if compensation == "kahan" else part
        total = acc + x
        if compensation == "lost":
            carry = carry + (x - (total - acc))
        elif compensation == "kahan":
            carry = (total - acc) - x
        acc = total
    return acc + carry if compensation == "lost" else acc


def test_dot_in_chunks():
    g = torch.Generator().manual_seed(2)
    for d, chunk in [(16, 4), (64, 4), (64, 16), (160, 16), (100, 16), (160, 160)]:
        q, K = torch.randn(20, d, generator=g) * 3, torch.randn(20, 30, d, generator=g) * 3
        for compensation in ("none", "lost", "kahan"):
            got = ans.dot_in_chunks(q, K, chunk, compensation)
            want = expected_S(q, K, chunk, compensation)
            if same_bits(got, want):
                continue
            call = f"dot_in_chunks(d = {d}, chunk = {chunk}, {compensation!r})"
            close = (got.double() - want.double()).abs().max().item()
            hints = []
            if compensation != "none" and same_bits(got, expected_S(q, K, chunk, "none")):
                hints.append("It equals the uncompensated sum: the compensation is computed but not used.")

            if compensation == "kahan" and same_bits(got, expected_S(q, K, chunk, "kahan", kahan_sign=-1)):
                hints.append("The sign of c: Kahan subtracts c = (t - acc) - y, the negative of Fast2Sum's e.")
            if same_bits(got, expected_S(q, K, K.shape[-1], "none")):
                hints.append("That is one FMA chain over all of d: part starts at 0 for each chunk.")
            raise AssertionError(f"{call}: differs from the expected order by up to {close:.2e} (bits must match: "
                                 "same operations, same order). " + " ".join(hints))


def test_o_error():
    g = torch.Generator().manual_seed(3)
    S_exact = torch.randn(50, 40, generator=g, dtype=torch.float64) * 10
    V = torch.randn(50, 40, 8, generator=g)
    S = S_exact.float()
    got = ans.o_error(S, S_exact, V, 0.5)
    O = (torch.softmax(S.double() * 0.5, -1)[..., None] * V.double()).sum(1)      # (50, 8)
    O64 = (torch.softmax(S_exact * 0.5, -1)[..., None] * V.double()).sum(1)
    want = (O - O64).norm(dim=-1) / O64.norm(dim=-1)
    assert got.shape == (50,), f"o_error: one error per problem, shape (50,), got {tuple(got.shape)}"
    if torch.allclose(got.double(), (O - O64).norm() / O64.norm() * torch.ones(50, dtype=torch.float64)):
        raise AssertionError("o_error: that is the error of all the rows together; one per row (problem) is asked")
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-13), \
        f"o_error: largest difference {(got.double() - want).abs().max():.2e} from ||O - O_exact|| / ||O_exact|| per row"


def test_what_the_order_buys():
    """One query against 94 keys at d = 160, scale 0.77 (a random problem of tests/test_fuzz.py on which the fp32
    kernel once erred 11x SDPA's error): the 99th percentile of O's error over 300 problems, each way."""
    g = torch.Generator().manual_seed(0)
    P, n, d, scale = 300, 94, 160, 0.77
    q, K, V = torch.randn(P, d, generator=g), torch.randn(P, n, d, generator=g), torch.randn(P, n, d, generator=g)
    S_exact = torch.einsum("pd,pnd->pn", q.double(), K.double())
    ways = {"one chain": (d, "none"), "chunks of 4": (4, "none"), "chunks of 16, lost": (16, "lost"),
            "chunks of 16, kahan": (16, "kahan")}
    p99 = {name: ans.o_error(ans.dot_in_chunks(q, K, chunk, c), S_exact, V, scale).quantile(0.99).item()
           for name, (chunk, c) in ways.items()}
    once = ans.o_error(S_exact.float(), S_exact, V, scale).quantile(0.99).item()
    report = ", ".join(f"{name} {e:.1e}" for name, e in p99.items()) + f"; S rounded once {once:.1e}"
    assert p99["one chain"] > p99["chunks of 4"] > 1.5 * p99["chunks of 16, lost"], report
    assert p99["chunks of 16, lost"] < 3 * once and p99["chunks of 16, kahan"] < 3 * once, report
