"""What every kernel guarantees beyond matching float64 on ordinary inputs: run-to-run determinism, huge and
equal scores, the first causal row, where a NaN or an Inf in the inputs ends up, and that every output element
is written (made in memory full of NaN, it equals what fresh memory gives).

Errors follow test_kernels.py's rule: at most 3x the error of PyTorch's scaled_dot_product_attention (SDPA)
in the same dtype on the same inputs, plus a small floor. Skipped, visibly, without a CUDA GPU.
"""
import pytest
import torch
import torch.nn.functional as F

import reference
from main import flash_attention, outputs, rel_err
from test_kernels import CASES, DTYPES, FLOOR, check  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# dQ is summed with fp32 atomics in an order that can change between runs; the two runs may differ by this
# much (relative Frobenius difference): a few fp32 roundings, or one rounding of the 16-bit result.
DQ_RUN_TO_RUN = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-3}
# The largest score q.k * scale the large-score test reaches: exp of it overflows fp32 (e^89 already does),
# so only subtracting the running max m_i keeps the softmax finite; the unscaled q.k still fits the dtype.
LARGEST_SCORE = {"float32": 1e4, "float16": 1e3, "bfloat16": 1e3}
ROW, COL = 70, 5  # where a NaN or Inf goes: row 70 is inside a tile of every kernel (tiles are 16 to 128 rows)


def problem(d, dtype, N=130, B=1, H=2, seed=0):
    """Random q, k, v, dO of shape (B, H, N, d)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, N, d, device="cuda", dtype=DTYPES[dtype], generator=g) for _ in range(4)]


def ours(kernel, causal):
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, kernel=kernel)


def sdpa(causal):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_run_to_run_determinism(kernel, dtype, d, causal):
    """O, dK and dV are bit-identical between two runs; dQ, summed with atomics, is close."""
    q, k, v, do = problem(d, dtype, N=700, B=2, H=4)  # 6 to 22 blocks per head: many atomics race on dQ
    (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = (outputs(ours(kernel, causal), q, k, v, do) for _ in range(2))
    for name, a, b in [("O", o1, o2), ("dK", dk1, dk2), ("dV", dv1, dv2)]:
        assert torch.equal(a, b), f"{name} differs between two runs by up to {(a - b).abs().max().item():.1e}"
    assert rel_err(dq1, dq2.double()) <= DQ_RUN_TO_RUN[dtype], f"dQ: runs differ by {rel_err(dq1, dq2.double()):.1e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_large_scores(kernel, dtype, d, causal):
    q, k, v, do = problem(d, dtype)
    scores = q.double() @ k.double().transpose(-1, -2) * d**-0.5
    stretch = (LARGEST_SCORE[dtype] / scores.abs().max()).sqrt().item()
    q, k = q * stretch, k * stretch
    unscaled = (q.double() @ k.double().transpose(-1, -2)).abs().max().item()
    assert unscaled * d**-0.5 >= 0.9 * LARGEST_SCORE[dtype] and unscaled < torch.finfo(q.dtype).max, \
        f"largest score {unscaled * d**-0.5:.0f}, largest unscaled q.k {unscaled:.0f}"
    check(kernel, q, k, v, do, causal)


@pytest.mark.parametrize("equal_scores", ["q = 0", "identical keys"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_equal_scores_average_the_visible_values(kernel, dtype, d, causal, equal_scores):
    q, k, v, do = problem(d, dtype)
    if equal_scores == "q = 0":
        q = torch.zeros_like(q)
    else:
        k = k[:, :, :1].expand_as(k).contiguous()
    N = q.shape[2]
    seen = torch.arange(1, N + 1, device="cuda")[:, None] if causal else N  # keys row i sees
    mean = (v.double().cumsum(-2) if causal else v.double().sum(-2, keepdim=True)) / seen
    torch.testing.assert_close(reference.attention(q.double(), k.double(), v.double(), causal), mean.expand_as(v),
                               rtol=1e-12, atol=1e-12)  # uniform weights: the test asks the kernels for the mean
    check(kernel, q, k, v, do, causal)


@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_first_causal_row_is_v0_exactly(kernel, dtype, d):
    """Same-length causal attention never masks a whole row: row i sees keys 0..i, its largest score adds
    exp(0) = 1 to l_i, so l_i >= 1. Row 0 sees key 0 alone: P_00 = 1, every other weight is exp(-inf) = 0,
    and O_0 = 1 * v_0 / 1 is v_0 bit for bit."""
    q, k, v, _ = problem(d, dtype)
    o = flash_attention(q, k, v, causal=True, kernel=kernel)
    assert torch.equal(o[:, :, 0], v[:, :, 0]), f"row 0 differs from v_0 by {(o[:, :, 0] - v[:, :, 0]).abs().max()}"


def nonfinite_rows(o):
    """(B, H, N) mask of the rows of o that hold a NaN or an Inf."""
    return ~torch.isfinite(o).all(dim=-1)


def rows(mask):
    return mask[0, 0].nonzero().flatten().tolist()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_nan_and_inf_reach_the_rows_that_see_them(kernel, dtype, d, where, bad, causal):
    """A NaN or +Inf at [ROW, COL] of q, k or v in head 0 makes these rows of O non-finite, in our kernels
    and in SDPA: q -> row ROW; k or v -> every row that sees key ROW (all rows; causal: rows >= ROW), except
    that +Inf in k gives row i the score -Inf when q[i, COL] < 0: a weight of 0 and a finite row, as in
    float64 (SDPA's fused kernels make those rows non-finite too: ours is checked against float64 there). Every
    other row is finite and correct, with one exception: a masked weight is an exact 0 that
    still multiplies v[ROW] in the product P V, and 0 * NaN = NaN, so with v causal, rows < ROW may be NaN
    (all of them in the dense formula; in a tiled kernel, those whose tiles hold key ROW). Other heads are
    untouched."""
    q, k, v, _ = problem(d, dtype)
    {"q": q, "k": k, "v": v}[where][0, 0, ROW, COL] = bad
    o, o_sdpa = ours(kernel, causal)(q, k, v), sdpa(causal)(q, k, v)
    i = torch.arange(q.shape[2], device="cuda")
    sees = i >= ROW if causal else torch.ones_like(i, dtype=torch.bool)
    if where == "q":
        expected = i == ROW
    elif where == "k" and bad > 0:
        expected = sees & ~(q[0, 0, :, COL] < 0)  # q_i . k_ROW = +Inf, or NaN when q[i, COL] = 0
    else:
        expected = sees
    for name, out in [("ours", o), ("SDPA", o_sdpa)]:
        found = nonfinite_rows(out)
        message = f"{name}: non-finite rows of head 0 {rows(found)}, expected {expected.nonzero().flatten().tolist()}"
        assert not found[:, 1:].any() and (found[0, 0] >= expected).all(), message
        # and no other rows, except: v causal (0 * NaN); in SDPA, k causal (whether its rows < ROW see the NaN
        # score depends on how it masks) and +Inf in k (its fused kernels make every row that sees it non-finite)
        if not (causal and where == "v") and not (name == "SDPA" and where == "k" and (causal or bad > 0)):
            assert torch.equal(found[0, 0], expected), message

    # float64 reference for the finite rows; with v, finite rows do not see v[ROW], so it is zeroed (0 * NaN)
    x64 = [t.double() for t in (q, k, v)]
    if where == "v":
        x64[2][0, 0, ROW, COL] = 0
    o64 = reference.attention(*x64, causal)
    good = ~nonfinite_rows(o) & ~nonfinite_rows(o_sdpa)
    err, err_sdpa = rel_err(o[good], o64[good]), rel_err(o_sdpa[good], o64[good])
    assert err <= 3 * err_sdpa + FLOOR[q.dtype], f"finite rows: relative error {err:.2e} vs SDPA's {err_sdpa:.2e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_nan_and_inf_in_q_reach_the_gradients(kernel, dtype, d, bad, causal):
    """q[ROW] bad: row ROW of dQ is non-finite and the other rows are finite and correct (dQ_i = dS_i K
    reads row i of dS only); dK and dV are non-finite wherever row ROW's weights reach them. Same in SDPA."""
    q, k, v, do = problem(d, dtype)
    q[0, 0, ROW, COL] = bad
    _, dq64, _, _ = outputs(lambda q, k, v: reference.attention(q, k, v, causal), q.double(), k.double(), v.double(),
                        do.double())
    grads = {"ours": outputs(ours(kernel, causal), q, k, v, do)[1:], "SDPA": outputs(sdpa(causal), q, k, v, do)[1:]}
    for name, (dq, dk, dv) in grads.items():
        nonfinite = nonfinite_rows(dq)
        assert rows(nonfinite) == [ROW] and not nonfinite[:, 1:].any(), \
            f"{name}: dQ non-finite in rows {rows(nonfinite)} of head 0, expected [{ROW}]"
        assert not torch.isfinite(dk).all() and not torch.isfinite(dv).all(), f"{name}: dK or dV stayed finite"
    good = ~nonfinite_rows(grads["ours"][0])
    err, err_sdpa = (rel_err(grads[name][0][good], dq64[good]) for name in ("ours", "SDPA"))
    assert err <= 3 * err_sdpa + FLOOR[q.dtype], f"dQ, finite rows: relative error {err:.2e} vs SDPA's {err_sdpa:.2e}"


def nan_filled_cache(*nbytes, copies=8):
    """Fills memory with 0xFF bytes (NaN in fp32, fp16, bf16 and e4m3) and gives it back to PyTorch's caching
    allocator, which hands it to the next allocations of these sizes: `copies` blocks of each size in nbytes.
    Returns the byte ranges [start, end) that now hold NaN, adjacent ones merged."""
    torch.cuda.empty_cache()
    filled = [torch.full((-(-n // 512) * 512,), -1, device="cuda", dtype=torch.int8) for n in nbytes
              for _ in range(copies)]  # (the allocator rounds every block up to 512 bytes)
    torch.cuda.synchronize()
    ranges = []
    for start, end in sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in filled):
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
    return ranges  # (`filled` is freed here: the memory goes back to the cache, NaN inside)


def landed_in(t, ranges):
    """Whether all of t's bytes lie in one of the ranges."""
    start = t.data_ptr()
    return any(lo <= start and start + t.numel() * t.element_size() <= hi for lo, hi in ranges)


@pytest.mark.parametrize("shape", ["N = 130", "decoding"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d", [case for case in CASES if case[2] in (64, 128, 256)])
def test_every_output_element_is_written(kernel, dtype, d, causal, shape):
    """O, L, dQ, dK and dV made in memory full of NaN equal those made in fresh memory: no kernel leaves an
    element unwritten (a ragged last tile, a split of the keys) or adds into a buffer it did not zero.
    compute-sanitizer's initcheck cannot tell this for the kernels that store through TMA (tests/sanitize.py)."""
    q, k, v, do = problem(d, dtype)  # N = 130: a ragged last tile
    if shape == "decoding":  # N_q = 1 against 1100 keys, 4 query heads a key/value head: the split-KV kernels
        q, do = q[:, :, :1].repeat(1, 4, 1, 1), do[:, :, :1].repeat(1, 4, 1, 1)
        k, v = (torch.cat([x] * 9, dim=2)[:, :, :1100].contiguous() for x in (k, v))

    def run(copies):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        sizes = [q.nbytes, k.nbytes, 2 * q.nbytes, 2 * k.nbytes, q.numel() // d * 4]  # (fp32 buffers, L)
        nan = nan_filled_cache(*sizes, copies=copies) if copies else []
        o, lse = flash_attention(*leaves, causal=causal, kernel=kernel, return_lse=True)
        placed = {"O": landed_in(o, nan), "L": landed_in(lse, nan)}
        nan = nan_filled_cache(*sizes, copies=copies) if copies else []
        grads = torch.autograd.grad(o, leaves, do)
        placed.update({name: landed_in(g, nan) for name, g in zip(("dQ", "dK", "dV"), grads)})
        return dict(zip(("O", "L", "dQ", "dK", "dV"), (o, lse, *grads))), placed

    fresh, _ = run(copies=0)
    # Where the allocator puts an output depends on what earlier tests left in its cache (a free block of the
    # size, not filled, at a lower address goes first): more filled blocks, until every output lands in one
    for copies in (8, 64, 256):
        filled, placed = run(copies)
        if all(placed.values()):
            break
    assert all(placed.values()), f"not placed in NaN memory (the test's premise): {placed}"
    for name, x in filled.items():
        assert torch.isfinite(x).all(), f"{name} holds NaN where it was made in NaN memory"
        if name == "dQ":  # (summed with atomics)
            err = rel_err(x, fresh[name].double())
            assert err <= DQ_RUN_TO_RUN[dtype], f"dQ differs from fresh memory's by {err:.1e}"
        else:
            assert torch.equal(x, fresh[name]), f"{name} differs from fresh memory's by {(x - fresh[name]).abs().max()}"
