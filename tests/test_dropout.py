"""Dropout of P (flash.cu's Dropout) and the deterministic backward, on every kernel.

The keep mask is a function of (seed, batch, head, row, key) alone: reference.dropout_keep computes it in
PyTorch with the kernels' Philox4x32-7, and the tests check that every kernel drops exactly those entries (read
back from O and dV with one-hot V and dO), then compare O and the gradients with float64 attention given the same
mask (tolerance as test_kernels.py: 3x the error of PyTorch's SDPA in the same dtype on the problem without
dropout, which SDPA cannot be given as a mask, plus a small floor). The generator's statistics (keep rate, no
correlation across heads, batches and blocks) and its known-answer vectors are checked on the CPU.
"""
import math
import os
import re

import pytest
import torch

import main
import reference
from main import dropout_mask, flash_attention, flash_attention_varlen, list_kernels, outputs, rel_err
from test_kernels import FLOOR, zero_bound
from test_masks import sdpa
from test_varlen import packed, per_sequence

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [(k["name"], getattr(torch, dtype)) for k in list_kernels() if k["available"] for dtype in k["dtypes"]]
BACKWARD = [(name, dtype) for name, dtype in CASES if name in ("fp32", "ampere", "hopper")]


# ---------------------------------------------------------------------------------------------------------
# The generator (CPU)

def test_philox_known_answers():
    # Random123's known-answer vectors for Philox4x32 with 7 rounds (the kernels') and 10 (counter, key -> output)
    pi = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    vectors = [(7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
               (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
               (7, *pi, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
               (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               (10, *pi, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for rounds, counter, key, expected in vectors:
        assert tuple(reference.philox(torch.tensor(counter), key, rounds).tolist()) == expected


def test_keep_rate_and_independence():
    p, seed = 0.2, 20241124
    keep = reference.dropout_keep(seed, (4, 8, 256, 256), p).float()       # 2M entries
    n = keep.numel()
    assert abs(keep.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert reference.dropout_threshold(p) / 256 == pytest.approx(p, abs=2 ** -9)

    def correlation(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()
    m = 256 * 256
    bound = 6 / math.sqrt(m)  # six standard errors of a correlation over m pairs
    assert abs(correlation(keep[0, 0], keep[0, 1])) < bound                # across heads
    assert abs(correlation(keep[0, 0], keep[1, 0])) < bound                # across batches
    assert abs(correlation(keep[0, 0, :128], keep[0, 0, 128:])) < bound    # across query blocks
    assert abs(correlation(keep[0, 0, :, :128], keep[0, 0, :, 128:])) < bound  # across key blocks
    assert abs(correlation(keep[0, 0, :, :-1], keep[0, 0, :, 1:])) < bound  # neighbours in a row (one call)
    assert abs(correlation(keep[0, 0, :-8], keep[0, 0, 8:])) < bound       # rows r and r + 8 (one call)
    assert abs(correlation(keep[0, 0, :, :-16], keep[0, 0, :, 16:])) < bound  # keys c and c + 16 (one call)
    other = reference.dropout_keep(seed + 1, (4, 8, 256, 256), p).float()
    assert abs(correlation(keep, other)) < 6 / math.sqrt(n)                 # across seeds


def test_threshold_rounds_as_the_kernels():
    # flash.cu rounds 256 p with std::lround, halves away from zero; reference must draw the same mask and scale
    assert re.search(r"std::lround\(dropout_p \* 256\)", open(os.path.join(main.ROOT, "flash.cu")).read())
    for k in range(255):
        assert reference.dropout_threshold((k + 0.5) / 256) == k + 1            # a half goes up (round() would not)
        assert reference.dropout_threshold((k + 0.49) / 256) == k
    assert reference.dropout_threshold(0.9999) == 255                          # at most 255: some entries stay


def test_reference_dropout_is_attention_with_the_mask():
    # Algorithms 2 and 4 of the first paper (flash_forward, flash_backward with Z) against autograd through
    # attention(..., dropout=Z), in float64
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 32, dtype=torch.float64) for n in (70, 90, 90))
    k, v = k[:, :2], v[:, :2]                                              # grouped-query attention
    do = torch.randn_like(q)
    Z = reference.dropout_keep(5, (2, 4, 70, 90), 0.3) * reference.dropout_scale(0.3)
    for causal in (False, True):
        ref = outputs(lambda q, k, v: reference.attention(q, k, v, causal, dropout=Z), q, k, v, do)
        # blocks that cut the 16 x 32 tiles of the Philox calls (B_r = 24, B_c = 10) draw the same Z_ij
        O, L = reference.flash_forward(q, k, v, causal, B_r=24, B_c=10, dropout_p=0.3, dropout_seed=5)
        grads = reference.flash_backward(q, k, v, O, L, do, causal, B_r=6, B_c=32, dropout_p=0.3, dropout_seed=5)
        for x, r in zip([O, *grads], ref):
            assert torch.allclose(x, r, atol=1e-10), (x - r).abs().max()


# ---------------------------------------------------------------------------------------------------------
# The kernels (GPU)

def exact(causal, Z, **scores):
    return lambda q, k, v: reference.attention(q, k, v, causal, dropout=Z, **scores)


def check(kernel, q, k, v, do, causal, p, seed, deterministic=False, **scores):
    """O, dQ, dK, dV against float64 attention with the mask of `seed`. SDPA cannot be given the mask (nor a
    softcap): its error on the same problem without them is the yardstick."""
    Z = dropout_mask(q, k, p, seed).double() * reference.dropout_scale(p)
    ref = outputs(exact(causal, Z, **scores), q.double(), k.double(), v.double(), do.double())
    ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal, kernel=kernel, dropout_p=p, dropout_seed=seed,
                                                   deterministic=deterministic, **scores), q, k, v, do)
    plain = {**scores, "softcap": 0.0}
    ref_sdpa = outputs(exact(causal, None, **plain), q.double(), k.double(), v.double(), do.double())
    theirs = outputs(sdpa(causal, None, plain), q, k, v, do)
    where = f"kernel={kernel}, q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal}, p={p}, {scores}"
    for name, x, s, r, rs in zip(["O", "dQ", "dK", "dV"], ours, theirs, ref, ref_sdpa):
        assert torch.isfinite(x).all(), f"{name} has non-finite values ({where})"
        if not r.any():  # (N_k = 1: dQ = dK = 0; see test_kernels.zero_bound)
            bound = zero_bound(name, x, q.shape[2] * q.shape[1] // k.shape[1])
            assert x.abs().max() <= bound, f"{name}: not 0 where float64 gives 0 ({where})"
            continue
        # (plus the rounding of the output to the dtype: with one key, SDPA's O is V exactly, ours V Z_ij rounded)
        err, err_sdpa = rel_err(x, r), rel_err(s, rs)
        bound = 3 * err_sdpa + FLOOR[q.dtype] + torch.finfo(q.dtype).eps / 2
        assert err <= bound, f"{name}: relative error {err:.2e} vs SDPA's {err_sdpa:.2e} ({where})"


@cuda
@pytest.mark.parametrize("kernel, dtype", CASES)
@pytest.mark.parametrize("B, H_q, H_kv, N_q, N_k, d, causal", [
    (2, 4, 4, 200, 200, 64, False),
    (1, 4, 4, 130, 130, 128, True),
    (2, 4, 2, 77, 190, 64, True),     # GQA, N_q < N_k
    (1, 2, 1, 150, 40, 64, True),     # MQA, N_q > N_k: rows that see no key
    (1, 2, 2, 1, 1, 64, False),       # N = 1
])
def test_dropout_against_float64(kernel, dtype, B, H_q, H_kv, N_q, N_k, d, causal):
    torch.manual_seed(N_q + N_k)
    q = torch.randn(B, H_q, N_q, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H_kv, N_k, d, device="cuda", dtype=dtype) for _ in range(2))
    check(kernel, q, k, v, torch.randn_like(q), causal, 0.17, 1234 + N_q)


@cuda
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_dropout_with_masks_and_scores(kernel, dtype):
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 160, 64, device="cuda", dtype=dtype) for _ in range(3))
    slopes = 2.0 ** (-torch.arange(1, 5, device="cuda", dtype=torch.float32))
    check(kernel, q, k, v, torch.randn_like(q), True, 0.3, 99, window_size=(40, -1), alibi_slopes=slopes, softcap=8.0)


@cuda
@pytest.mark.parametrize("kernel, dtype", CASES)
@pytest.mark.parametrize("N_q, N_k, d, p", [(100, 64, 64, 0.25), (37, 128, 128, 0.25), (50, 40, 64, 0.25),  # (40: a
                                           (50, 40, 64, 32.5 / 256)])  # partial call; p halfway between thresholds)
def test_kernels_drop_exactly_the_mask(kernel, dtype, N_q, N_k, d, p):
    # q = k = 0 makes P uniform (1 / N_k); one-hot rows of V (V[c] = e_c) then give O[r, c] = Z_rc / N_k, and
    # one-hot rows of dO (dO[r] = e_r) give dV[c, r] = Z_rc / N_k: every dropped entry shows as a 0, in the
    # forward's layout and in the backward's transposed one
    B, H, seed = 2, 3, 777
    q = torch.zeros(B, H, N_q, d, device="cuda", dtype=dtype)
    k = torch.zeros(B, H, N_k, d, device="cuda", dtype=dtype)
    v = torch.eye(N_k, d, device="cuda", dtype=dtype).expand(B, H, N_k, d).contiguous()
    keep = dropout_mask(q, k, p, seed)                                     # (B, H, N_q, N_k)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    o = flash_attention(q, k, v, kernel=kernel, dropout_p=p, dropout_seed=seed)
    assert torch.equal(o[..., :N_k].float() * N_k > 0.5, keep), f"kernel={kernel}: O drops other entries"
    scale = reference.dropout_scale(p)
    assert torch.allclose(o[..., :N_k].float() * N_k, keep * scale, rtol=1e-2), "kept entries are not scaled"
    backward = main.KERNELS[kernel]["backward_kernel"]
    do = torch.eye(N_q, d, device="cuda", dtype=dtype).expand(B, H, N_q, d)
    (dv,) = torch.autograd.grad(o, v, do)
    if N_q <= d:
        assert torch.equal(dv[..., :N_q].float().transpose(-1, -2) * N_k > 0.5, keep), \
            f"backward kernel {backward}: dV drops other entries"


@cuda
@pytest.mark.parametrize("kernel, dtype", [c for c in CASES if c[0] == "ampere"])
def test_kernels_drop_exactly_the_mask_on_99_kb_tiles(kernel, dtype, monkeypatch):
    # sm_86 and sm_89 give a block 99 KB: at d = 256 the ampere forward then takes B_c = 16, half of a Philox
    # call's 32 keys per block, the upper half in odd blocks (FLASH_SMEM_LIMIT makes this GPU choose the same)
    monkeypatch.setenv("FLASH_SMEM_LIMIT", str(99 * 1024))
    test_kernels_drop_exactly_the_mask(kernel, dtype, 100, 200, 256, 0.25)


@cuda
@pytest.mark.parametrize("kernel, dtype", BACKWARD)
def test_deterministic_backward(kernel, dtype):
    # dQ without atomics: two runs give the same bits, and the same values as the atomic path within rounding
    torch.manual_seed(1)
    q = torch.randn(2, 8, 700, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, 900, 64, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    run = lambda det, p=0.0: outputs(  # noqa: E731
        lambda q, k, v: flash_attention(q, k, v, True, kernel=kernel, deterministic=det, dropout_p=p, dropout_seed=5),
        q, k, v, do)
    first, second = run(True), run(True)
    for name, a, b in zip(["O", "dQ", "dK", "dV"], first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs (kernel={kernel})"
    atomic = run(False)
    for name, a, b in zip(["O", "dQ", "dK", "dV"], first, atomic):
        assert rel_err(a, b.double()) < 10 * FLOOR[dtype] + {torch.float32: 1e-6}.get(dtype, 1e-2), name
    assert all(torch.equal(a, b) for a, b in zip(run(True, 0.1), run(True, 0.1)))  # with dropout too
    torch.use_deterministic_algorithms(True)  # deterministic=None follows PyTorch's switch
    try:
        assert all(torch.equal(a, b) for a, b in zip(run(None), first))
    finally:
        torch.use_deterministic_algorithms(False)
    check(kernel, q, k, v, do, True, 0.1, 5, deterministic=True)


@cuda
def test_seed_reproduces_and_p_zero_is_no_dropout():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.manual_seed(42)
    a = flash_attention(q, k, v, dropout_p=0.5)
    b = flash_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(42)
    assert torch.equal(a, flash_attention(q, k, v, dropout_p=0.5)), "torch.manual_seed must reproduce the mask"
    assert not torch.equal(a, b), "each call draws a new mask"
    exact = reference.attention(q.double(), k.double(), v.double())  # p = 0 with a seed given: nothing dropped
    assert rel_err(flash_attention(q, k, v, dropout_p=0.0, dropout_seed=42), exact) < 3e-3


@cuda
@pytest.mark.parametrize("kernel, dtype", [c for c in CASES if c[0] in ("fp32", "ampere", "hopper")])
def test_varlen_dropout(kernel, dtype):
    # sequence b of a packed batch draws batch b's mask, its rows and keys counted from its own start
    torch.manual_seed(2)
    lengths_q, lengths_k, H, d, p, seed = [5, 130, 0, 64], [70, 20, 3, 64], 2, 64, 0.2, 31
    q, cu_q = packed(lengths_q, H, d, dtype)
    k, cu_k = packed(lengths_k, H, d, dtype)
    v, do = torch.randn_like(k), torch.randn_like(q)

    def exact_b(q, k, v, b):
        Z = reference.dropout_keep(seed, (1, H, q.shape[2], k.shape[2]), p, q.device, first_batch=b)
        return reference.attention(q, k, v, True, dropout=Z * reference.dropout_scale(p))
    ref = outputs(per_sequence(exact_b, cu_q, cu_k), q.double(), k.double(), v.double(), do.double())
    ours = outputs(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), True,
                                                          kernel=kernel, dropout_p=p, dropout_seed=seed), q, k, v, do)
    for name, x, r in zip(["O", "dQ", "dK", "dV"], ours, ref):
        assert rel_err(x, r) < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype], name


@cuda
def test_dropout_compiles():
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    attention = lambda q, k, v: flash_attention(q, k, v, True, dropout_p=0.1, dropout_seed=9)  # noqa: E731
    compiled = torch.compile(attention, fullgraph=True)
    do = torch.randn_like(q)
    for a, b in zip(outputs(compiled, q, k, v, do), outputs(attention, q, k, v, do)):
        assert torch.equal(a, b)
