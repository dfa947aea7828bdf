"""8-bit attention (flash.cu's section 8): quantize() and flash_attention_8bit, fp8 on Hopper and int8 on sm_80+.

An 8-bit forward is not exact, so its error against float64 attention is bounded by the error of the same
quantization computed in float64 (reference.attention_8bit: the scales, roundings and rotation of the kernels, in
PyTorch): a kernel within 1.5x of it (plus a small floor) quantizes and multiplies as designed, while a wrong
layout (V^T's key order, a fragment, a scale) gives errors of order 1. quantize()'s output is compared with
reference.quantize_blocks value for value, V's transposed layout byte for byte.
"""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import main
import reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _available(dtype):
    if not torch.cuda.is_available():
        return False
    arch = main._arch()
    return arch == 90 and main._builds_sm90a() if dtype == torch.float8_e4m3fn else arch >= 80


DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(not _available(dt), reason=f"no GPU for {dt}"))
          for dt in (torch.float8_e4m3fn, torch.int8)]


def rmse(x, ref):
    return ((x.double() - ref) ** 2).mean().sqrt().item()


# ---------------------------------------------------------------------------------------------------------
# The reference's pieces (CPU)

def test_rotation_is_orthogonal_and_keeps_scores():
    signs = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(1)) * 2.0 - 1
    R = reference.rotation(64, signs)
    assert torch.allclose(R @ R.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    q, k = torch.randn(5, 64, dtype=torch.float64), torch.randn(7, 64, dtype=torch.float64)
    assert torch.allclose((q @ R) @ (k @ R).T, q @ k.T, atol=1e-12)


def test_key_position_matches_the_fragments():
    # lane t holds keys 2t, 2t+1, 2t+8, 2t+9 of each 16 in its accumulators; the 8-bit A fragment wants them at 4t..4t+3
    assert sorted(reference.key_position(c) for c in range(16)) == list(range(16))
    for t in range(4):
        assert [reference.key_position(c) for c in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)] == list(range(4 * t, 4 * t + 4))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantize_blocks_error(dtype):
    x = torch.randn(2, 3, 300, 64, dtype=torch.float64)
    x[0, 1, 5, 7] = 40.0  # an outlier: only its own block's scale grows
    x_hat, s = reference.quantize_blocks(x, dtype)
    assert s.shape == (2, 3, 3)
    assert s[0, 1, 0] > 5 * s[0, 1, 1]
    err = (x_hat * s.repeat_interleave(128, -1)[..., :300, None] - x).abs()
    step = s.repeat_interleave(128, -1)[..., :300, None]
    if dtype == torch.int8:
        assert (err <= step / 2 + 1e-12).all()
    else:  # 3 mantissa bits: relative error <= 2^-4 above e4m3's smallest normal (2^-6)
        assert (err <= x.abs() / 16 + step * 2.0 ** -10 + 1e-12).all()


def test_attention_8bit_reference_error():
    q, k, v = (torch.randn(1, 2, 256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    exact = reference.attention(q, k, v)
    fp8 = rmse(reference.attention_8bit(q, k, v, torch.float8_e4m3fn), exact)
    int8 = rmse(reference.attention_8bit(q, k, v, torch.int8, smooth_k=True), exact)
    assert 1e-4 < int8 < fp8 < 2e-2


def test_fp8_ranges_of_q_and_k():
    """main's ranges (by tile width) and the reference's (by head dim) agree, and keep the fp8 kernel's fp16 sums of
    D products of |x_hat| <= range within 32768 (fp16 holds 65504)."""
    for D in main.EIGHT_BIT_HEAD_DIMS:
        assert main.FP8_QK_MAX[D] == reference.fp8_qk_max(D) == reference.fp8_qk_max(D // 2 + 1)
        assert D * main.FP8_QK_MAX[D] ** 2 <= 32768


def test_validation_before_any_launch():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        main.quantize(q, q, q)
    h = q.half().requires_grad_()
    with torch.enable_grad(), pytest.raises(ValueError, match="forward only"):
        main.flash_attention_8bit(h, h, h)
    x = main.Quantized(h, h, h, h, h, None, False, 64, torch.float16)
    with pytest.raises(ValueError, match="either q, k, v or one Quantized"):
        main.flash_attention_8bit(x, h, h)
    with pytest.raises(ValueError, match="softmax_scale >= 0, got -0.125"):  # (fp8 scales each row's maximum)
        main.flash_attention_8bit(x, softmax_scale=-0.125)
    with pytest.raises(ValueError, match="a Quantized was made by quantize"):  # (it would be ignored)
        main.flash_attention_8bit(x, rotate=True)
    h = h.detach()  # the arguments are checked before quantize launches anything
    for kwargs, error, words in [(dict(causal=1), TypeError, "causal must be True or False, got 1"),
                                 (dict(softmax_scale=-1.0), ValueError, "softmax_scale >= 0, got -1.0"),
                                 (dict(window_size=(-2, 0)), ValueError, "each >= -1 (-1: no bound), got (-2, 0)")]:
        with pytest.raises(error, match=re.escape(words)):
            main.flash_attention_8bit(h, h, h, **kwargs)
    for kwargs, error, words in [(dict(dtype=torch.float16), ValueError, "dtype must be torch.float8_e4m3fn or"),
                                 (dict(smooth_k=1), TypeError, "smooth_k must be True or False, got 1"),
                                 (dict(seed=1.5), ValueError, "seed must be an integer in [0, 2^32), got 1.5"),
                                 (dict(dtype=torch.int8, transpose_v=True), ValueError, "got dtype torch.int8")]:
        with pytest.raises(error, match=re.escape(words)):
            main.quantize(h, h, h, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# The kernels (GPU)

SHAPES = [  # B, H_q, H_kv, N_q, N_k, d: ragged blocks, GQA, N_q != N_k, one query, one key, padded d; causal, the
    # first tile's padding slab (Mask::first_row) at 300, 517 and 129 queries (two consumers) and at 1050 (three)
    (2, 4, 2, 200, 333, 64), (1, 2, 2, 1, 77, 128), (2, 2, 1, 300, 300, 128), (1, 3, 3, 129, 1000, 96),
    (1, 1, 1, 1, 1, 64), (1, 2, 1, 517, 260, 40), (1, 2, 1, 300, 400, 256), (1, 1, 1, 130, 130, 200),
    (1, 2, 1, 1050, 1300, 128)]


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_against_float64(dtype, shape, causal, rotate):
    B, H_q, H_kv, N_q, N_k, d = shape
    torch.manual_seed(sum(shape))
    q = torch.randn(B, H_q, N_q, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H_kv, N_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    exact = reference.attention(q.double(), k.double(), v.double(), causal)
    D = min(D for D in main.EIGHT_BIT_HEAD_DIMS if D >= d)
    signs = main.rotation_signs(D, 0, "cuda") if rotate else None
    pad = lambda x: torch.nn.functional.pad(x.double(), (0, D - d))
    emulated = reference.attention_8bit(pad(q), pad(k), pad(v), dtype, causal, 1 / math.sqrt(d), signs=signs,
                                        smooth_k=dtype == torch.int8)[..., :d]
    bound = 1.5 * rmse(emulated, exact) + 1e-3
    for transpose_v in ([False, True] if dtype == torch.float8_e4m3fn else [False]):
        o = main.flash_attention_8bit(q, k, v, causal=causal, dtype=dtype, rotate=rotate, transpose_v=transpose_v)
        assert o.shape == q.shape and o.dtype == q.dtype
        err = rmse(o, exact)
        assert err < bound, f"transpose_v={transpose_v}: rmse {err:.2e}, the quantization's own {bound:.2e}"


fp8 = pytest.mark.skipif(not _available(torch.float8_e4m3fn), reason="no GPU for fp8 (sm_90)")


@fp8
@pytest.mark.parametrize("d", [128, 256])
def test_many_launches(d):
    """The benchmark's shape (1024 thread blocks of 8 key blocks each): right against float64, and then launched
    600 times in a child process with a time limit. Freeing K_j's stage a step early once let a consumer wait on an
    mbarrier for a phase that could only come after that consumer went on: at d = 256 it hung within 40 launches
    (flash.cu, forward_schedule's release_K), where tests of a few launches passed."""
    torch.manual_seed(d)
    q, k, v = (torch.randn(16, 8, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    exact = reference.attention(q.double(), k.double(), v.double(), False)
    emulated = reference.attention_8bit(q.double(), k.double(), v.double(), torch.float8_e4m3fn, False, d ** -0.5)
    bound = 1.5 * rmse(emulated, exact) + 1e-3
    for transpose_v in (False, True):
        err = rmse(main.flash_attention_8bit(q, k, v, transpose_v=transpose_v), exact)
        assert err < bound, f"transpose_v={transpose_v}: rmse {err:.2e}, the quantization's own {bound:.2e}"
    script = (f"import sys, torch; sys.path.insert(0, {str(Path(main.__file__).parent)!r}); import main\n"
              f"q, k, v = (torch.randn(16, 8, 1024, {d}, device='cuda', dtype=torch.bfloat16) for _ in range(3))\n"
              "for transpose_v in (False, True):\n"
              "    x = main.quantize(q, k, v, transpose_v=transpose_v)\n"
              "    for _ in range(300): main.flash_attention_8bit(x)\n"
              "torch.cuda.synchronize()\n")
    try:
        child = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"d = {d}: 600 launches did not finish in 60 s (a deadlock)")
    assert child.returncode == 0, child.stderr[-2000:]


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 256])
def test_largest_scores(dtype, d):
    """Rows of equal values quantize to the largest |x_hat| in every column, so that S_ij reaches the bound the
    ranges are chosen for (fp8: fp16 sums of d products, main.FP8_QK_MAX; int8: s32 sums, flash.cu's SUM_START):
    the scores are all equal, and O is the mean of V's rows."""
    torch.manual_seed(3)
    q, k = (torch.full((1, 1, 256, d), 0.5, device="cuda", dtype=torch.float16) for _ in range(2))
    v = torch.randn(1, 1, 256, d, device="cuda", dtype=torch.float16)
    x = main.quantize(q, k, v, dtype, smooth_k=False)  # (smoothed, k would be 0)
    assert x.q.float().abs().max() == (main.FP8_QK_MAX[d] if dtype != torch.int8 else main.INT8_MAX)
    o = main.flash_attention_8bit(x)
    mean = v.double().mean(2, keepdim=True).expand_as(o)
    assert o.isfinite().all() and rmse(o, mean) < 2e-2


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_key_and_large_inputs(dtype):
    """Scores far from N(0, 1)'s scale. With one key, int8's smoothing leaves K a block of zeros (scale 1). With
    |Q|, |K| ~ 1000 one step of the int8 scores is 15-19 (base 2) and the softmax nearly one-hot; the emulation's
    own error is then 0.2-0.4, so int8, whose scores are the emulation's integers, is also held to the emulation row
    by row. Not every row: the kernel rounds x (1 / s) in float32, the emulation x / s in float64, and where one lies
    within 1e-5 of a half-integer the two integers differ by one, which moves a score by up to 127 steps and can
    change the row's largest entry. The int8 kernel folds its s32 offset into the exponent's bias only where that
    step is small (flash.cu, SUM_START): folded at any step, one key gave V to within 2.7e-3, not exactly, and the
    large inputs overflowed P_ij in fp16 (NaN)."""
    torch.manual_seed(5)
    for dt in (torch.float16, torch.bfloat16):
        for d in (32, 64, 160):
            q = torch.randn(2, 4, 37, d, device="cuda", dtype=dt)
            k, v = (torch.randn(2, 2, 1, d, device="cuda", dtype=dt) for _ in range(2))
            o = main.flash_attention_8bit(q, k, v, dtype=dtype)
            V = v.repeat_interleave(2, 1).expand_as(o)  # one key: O is its value
            if dtype == torch.int8:
                assert torch.equal(o, V), f"{dt}, d = {d}: {(o - V).abs().max().item():.2e} from V"
            else:  # (V is rounded to e4m3)
                emulated = reference.attention_8bit(q, k, v, dtype)
                assert rmse(o, V.double()) < 1.5 * rmse(emulated, V.double()) + 1e-3
        for d in (64, 128):
            q, k = (300 * torch.randn(1, 2, 300, d, device="cuda", dtype=dt) for _ in range(2))
            v = torch.randn(1, 2, 300, d, device="cuda", dtype=dt)
            exact = reference.attention(q.double(), k.double(), v.double())
            emulated = reference.attention_8bit(q, k, v, dtype, smooth_k=dtype == torch.int8)
            o = main.flash_attention_8bit(q, k, v, dtype=dtype)
            assert o.isfinite().all(), f"{dt}, d = {d}"
            assert rmse(o, exact) < 1.5 * rmse(emulated, exact) + 1e-3, f"{dt}, d = {d}"
            if dtype == torch.int8:  # the same integer scores in all but a few rows: the same softmax there
                row_rmse = (o.double() - emulated).pow(2).mean(-1).sqrt()
                agree = (row_rmse < 1e-2).double().mean().item()
                assert agree > 0.99, f"{dt}, d = {d}: {agree:.1%} of the rows as the emulation's"


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_and_quantized_reuse(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    exact = reference.attention(q.double(), k.double(), v.double(), window_size=(100, 20))
    emulated = reference.attention_8bit(q, k, v, dtype, window_size=(100, 20), smooth_k=dtype == torch.int8)
    x = main.quantize(q, k, v, dtype)
    o = main.flash_attention_8bit(x, window_size=(100, 20))
    assert rmse(o, exact) < 1.5 * rmse(emulated, exact) + 1e-3
    for wrong in ((101, 20), (99, 20), (100, 21), (100, 19)):  # O is nearer this window than one key off
        assert rmse(o, exact) < rmse(o, reference.attention(q.double(), k.double(), v.double(), window_size=wrong))
    assert torch.equal(o, main.flash_attention_8bit(x, window_size=(100, 20)))  # the same inputs, the same bits


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference(dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 300, 64, device="cuda", dtype=torch.float16) * 3
    x[0, 1, 5, 7] = 60.0
    signs = main.rotation_signs(64, 3, "cuda")
    for rotate in (False, True):
        q8 = main.quantize(x, x, x, dtype, rotate=rotate, smooth_k=False, seed=3)
        y = x.double() @ reference.rotation(64, signs).cuda() if rotate else x.double()
        value_range = reference.fp8_qk_max(64) if dtype != torch.int8 else None  # (q, k: the fp8 kernel's S is fp16)
        x_hat, s = reference.quantize_blocks(y, dtype, value_range=value_range)
        torch.testing.assert_close(q8.q_scale.double(), s, rtol=1e-5, atol=0)
        # values equal but for rounding ties (the kernel's transform runs in fp32): at most one step apart
        diff = (q8.q.double() - x_hat).abs() if dtype == torch.int8 else (q8.q.float().double() - x_hat).abs()
        assert (diff <= (1 if dtype == torch.int8 else x_hat.abs() / 8 + 2 ** -9)).all()
        assert (diff > 0).float().mean() < 1e-3


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_smoothing_leaves_the_padding_out_of_the_last_scale(dtype):
    """Keys with a large common offset, N = 130: the last block holds 2 keys, and its scale comes from them after
    the mean is subtracted (reference.quantize_blocks), not from the padding rows, which would then hold -mean."""
    torch.manual_seed(5)
    k = 5 + 0.1 * torch.randn(1, 2, 130, 64, device="cuda", dtype=torch.float16)
    q8 = main.quantize(k, k, k, dtype, smooth_k=True)
    value_range = reference.fp8_qk_max(64) if dtype != torch.int8 else None
    _, s = reference.quantize_blocks(k.double() - k.float().mean(2, keepdim=True).double(), dtype,
                                     value_range=value_range)
    torch.testing.assert_close(q8.k_scale.double(), s, rtol=1e-3, atol=0)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs(dtype):  # no queries, no keys, no sequences: quantize launches nothing, O is zeros
    for B, N_q, N_k in ((1, 0, 5), (1, 5, 0), (0, 5, 5)):
        q = torch.randn(B, 2, N_q, 64, device="cuda", dtype=torch.float16)
        k = torch.randn(B, 2, N_k, 64, device="cuda", dtype=torch.float16)
        o = main.flash_attention_8bit(q, k, k, dtype=dtype)
        assert o.shape == q.shape and o.dtype == q.dtype and not o.any()


@cuda
@pytest.mark.skipif(not _available(torch.float8_e4m3fn), reason="needs sm_90")
def test_transposed_v_layout():
    torch.manual_seed(2)
    v = torch.randn(2, 2, 200, 64, device="cuda", dtype=torch.bfloat16)
    x = main.quantize(v, v, v, torch.float8_e4m3fn, transpose_v=True)
    plain = main.quantize(v, v, v, torch.float8_e4m3fn, transpose_v=False)
    assert x.v.shape == (2, 2, 64, 256)
    inverse = torch.empty(16, dtype=torch.long)
    inverse[torch.tensor([reference.key_position(c) for c in range(16)])] = torch.arange(16)
    keys = (torch.arange(256).view(16, 16)[:, inverse.tolist()]).flatten().cuda()  # key at each position
    vt = plain.v.view(torch.uint8).transpose(-1, -2)  # (B, H, 64, 200) in key order
    vt = torch.nn.functional.pad(vt, (0, 56))
    assert torch.equal(x.v.view(torch.uint8), vt[..., keys])
    assert torch.equal(x.v_scale, plain.v_scale)
    assert main.quantize(v, v, v).v_transposed and not main.quantize(v, v, v, torch.int8).v_transposed  # defaults
    with pytest.raises(ValueError, match="transpose_v is for fp8"):
        main.quantize(v, v, v, torch.int8, transpose_v=True)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_compile(dtype):
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for smooth_k in (False, True):
        f = torch.compile(lambda q, k, v: main.flash_attention_8bit(q, k, v, causal=True, dtype=dtype, smooth_k=smooth_k),
                          fullgraph=True)
        o = main.flash_attention_8bit(q, k, v, causal=True, dtype=dtype, smooth_k=smooth_k)
        if not smooth_k:  # the same ops on the same inputs: the same bits
            torch.testing.assert_close(f(q, k, v), o, rtol=0, atol=0)
        else:  # K's mean is a reduction the compiler may order differently, which can move an int8 rounding
            exact = reference.attention(q.double(), k.double(), v.double(), causal=True)
            assert rmse(f(q, k, v), exact) < 1.5 * rmse(o, exact) + 1e-3


@cuda
@pytest.mark.parametrize("d", main.EIGHT_BIT_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_output_element_is_written(dtype, d):
    """O made in memory full of NaN equals O made in fresh memory (as test_numerics.py's test of the same name;
    the fp8 kernel stores O through TMA, which compute-sanitizer's initcheck does not see)."""
    from test_numerics import landed_in, nan_filled_cache
    torch.manual_seed(4)
    q = torch.randn(1, 8, 130, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 200, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fresh = main.flash_attention_8bit(q, k, v, causal=True, dtype=dtype)
    nan = nan_filled_cache(q.nbytes, k.nbytes, q.nbytes // 2, k.nbytes // 2)  # (O; the 8-bit copies)
    o = main.flash_attention_8bit(q, k, v, causal=True, dtype=dtype)
    assert landed_in(o, nan), "O was not placed in NaN memory (the test's premise)"
    assert torch.equal(o, fresh), f"O differs from fresh memory's by {(o - fresh).abs().max()}"
