"""Random problems instead of a fixed grid: shapes, causal, softmax_scale, windows, softcap and ALiBi drawn from
a seeded generator.

GPU (skipped, visibly, without a CUDA GPU): every available kernel and dtype on FLASH_FUZZ_CASES random
problems (default 10 each), forward, L and all three gradients against float64 with test_kernels.py's rule
(at most 3x SDPA's error in the same dtype, plus a small floor); half of them have N_q != N_k, and H_kv
divides H_q; half have a tile's head dim, half any d from 8 to the kernel's widest tile; half have a window, a
softcap or ALiBi (test_masks.check). The same for the other entry points: flash_attention_with_kvcache (random
caches, lengths per sequence from 0 to full, new tokens appended or not), flash_attention_varlen (random packed
batches, test_varlen.check) and flash_attention_8bit (fp8 and int8 against the same quantization in float64,
test_8bit's rule). CPU: reference.py's block loops with random block sizes B_r, B_c against dense attention and
autograd in float64 (3 * FLASH_FUZZ_CASES problems).

    FLASH_FUZZ_CASES=500 python -m pytest tests/test_fuzz.py     # the full run
    FLASH_FUZZ_SEED=7 python -m pytest tests/test_fuzz.py        # other problems (default seed: 0)

Problems depend only on the seed, the test and the case index, so a failure reruns exactly; each test
checks all its cases and lists every failing one with its seed, index and parameters.
"""
import os
import random

import pytest
import torch

import main
import reference
from main import flash_attention_8bit, flash_attention_with_kvcache, list_kernels, tile_dim
from test_kernels import DTYPES, within_sdpa_error  # pytest puts tests/ on sys.path (rootdir conftest, no package)
from test_shapes import assert_L, check
import test_8bit
import test_masks
import test_varlen

SEED = int(os.environ.get("FLASH_FUZZ_SEED", "0"))
CASES = int(os.environ.get("FLASH_FUZZ_CASES", "10"))
AVAILABLE = {k["name"]: k for k in list_kernels() if k["available"]}


def draw_length(rng):
    """N in 1..600, mostly short and ragged: N = 1, a tile edge (a multiple of 32, +-1) or any length."""
    kind = rng.random()
    if kind < 0.1:
        return 1
    if kind < 0.4:
        return 32 * rng.randint(1, 18) + rng.choice([-1, 0, 1])
    if kind < 0.7:
        return rng.randint(2, 100)
    return rng.randint(101, 600)


def draw_scale(rng, d):
    """None (1/sqrt(d)) or any scale up to 1.0, at every d: up to 16 times 1/sqrt(d) at d = 256, where the softmax is
    so peaked that rounding O to fp16/bf16 (in D_i) sets the error of dQ and dK; the yardstick is SDPA's fused
    backward, which rounds O the same way (test_kernels.fused_sdpa)."""
    return None if rng.random() < 0.5 else round(rng.uniform(0.02, 1.0), 3)


def draw_scores(rng, N_q, N_k, H_q, B, device):
    """Half the time none; else a window (each side unbounded or up to the longer length), a softcap, ALiBi
    slopes per head or per batch and head, each with some probability."""
    if rng.random() < 0.5:
        return {}
    side = lambda: -1 if rng.random() < 0.3 else rng.randint(0, max(N_q, N_k))  # noqa: E731
    scores = {"window_size": (side(), side())}
    if rng.random() < 0.4:
        scores["softcap"] = round(rng.uniform(0.5, 20.0), 2)
    if rng.random() < 0.4:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        scores["alibi_slopes"] = torch.rand((B, H_q) if rng.random() < 0.5 else (H_q,), generator=g).to(device)
    return scores


def draw_head_dim(rng, kernel, tiles=None):
    """Half the time one of the kernel's tile widths, else any d up to its widest (padded to the next tile width);
    tiles: only head dims whose tile width is one of these, in the kernel and in its backward's (volta's and turing's
    is fp32's, whose tiles differ)."""
    widest, backward = max(AVAILABLE[kernel]["head_dims"]), AVAILABLE[kernel]["backward_kernel"]
    dims = [d for d in range(8, widest + 1)
            if tiles is None or {tile_dim(kernel, d), tile_dim(backward, d)} <= set(tiles)]
    widths = [d for d in AVAILABLE[kernel]["head_dims"] if d in dims]
    return rng.choice(widths) if rng.random() < 0.5 else rng.choice(dims)


def run_cases(key, draw, factor=1):
    """factor * FLASH_FUZZ_CASES random cases from a generator seeded by FLASH_FUZZ_SEED and key: draw(rng) draws one
    and returns its description and a function that checks it, raising AssertionError (or RuntimeError: a failed
    launch) where it fails. Every case runs, then every failing one is listed with what reruns it."""
    rng = random.Random(f"{SEED}-{key}")
    failures, last = [], 0
    for index in range(factor * CASES):
        description, check_case = draw(rng)
        try:
            check_case()
        except (AssertionError, RuntimeError) as error:  # keep checking the rest
            failures.append(f"case {index}: {description}: {error}")
            last = index
    if failures:
        test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]  # the test as pytest names it, " (call)" cut
        raise AssertionError(
            f"{len(failures)} of {factor * CASES} random cases failed. Rerun them (with the cases before them):\n"
            f"  FLASH_FUZZ_SEED={SEED} FLASH_FUZZ_CASES={-(-(last + 1) // factor)} python -m pytest '{test}'\n"
            + "\n".join(failures))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
every_kernel = pytest.mark.parametrize("kernel, dtype", [(name, dtype) for name, k in AVAILABLE.items()
                                                         for dtype in k["dtypes"]])


@gpu
@every_kernel
def test_kernel_on_random_problems(kernel, dtype):
    def draw(rng):
        B, H_kv, group, N_q = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 1, 2, 4]), draw_length(rng)
        N_k = N_q if rng.random() < 0.5 else draw_length(rng)
        d = draw_head_dim(rng, kernel)
        causal, scale = rng.random() < 0.5, draw_scale(rng, d)
        inputs_seed = rng.randrange(2**31)
        g = torch.Generator(device="cuda").manual_seed(inputs_seed)
        q, do = (torch.randn(B, H_kv * group, N_q, d, device="cuda", dtype=DTYPES[dtype], generator=g) for _ in range(2))
        k, v = (torch.randn(B, H_kv, N_k, d, device="cuda", dtype=DTYPES[dtype], generator=g) for _ in range(2))
        scores = draw_scores(rng, N_q, N_k, H_kv * group, B, "cuda")
        description = (f"kernel={kernel} dtype={dtype} q {tuple(q.shape)} k, v {tuple(k.shape)} causal={causal} "
                       f"softmax_scale={scale} {scores} q, dO, k, v = torch.randn(..., "
                       f"generator=torch.Generator('cuda').manual_seed({inputs_seed}))")
        if scores:
            return description, lambda: test_masks.check(kernel, q, k, v, do, causal, scale, **scores)
        return description, lambda: check(kernel, q, k, v, do, causal, scale)
    run_cases(f"{kernel}-{dtype}", draw)


@gpu
@every_kernel
def test_kvcache_on_random_problems(kernel, dtype):
    """flash_attention_with_kvcache on random caches: each sequence's length from 0 to full, N_new new tokens
    appended (1 to 40, on both sides of SPLIT_KV_MAX_QUERIES, where decoding gives way to the forward) or queries
    alone, GQA, any head dim, causal or not, windows, softcap and ALiBi. Per sequence: the append lands at its
    length and nowhere else, O against float64 over its own keys (SDPA's error the yardstick), L and its -inf rows."""
    def draw(rng):
        B, H_kv, group = rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 2, 4, 8])
        N_new = rng.choice([0, 1, 1, rng.randint(2, 16), rng.randint(17, 40)])
        N_q = N_new or rng.choice([1, rng.randint(2, 20)])
        N_max = N_new + draw_length(rng)
        lengths = [rng.choice([0, N_max - N_new, rng.randint(0, N_max - N_new)]) for _ in range(B)]
        same = rng.random() < 0.2  # cache_seqlens as one int
        lengths = lengths[:1] * B if same else lengths
        d = draw_head_dim(rng, kernel)
        causal, scale = rng.random() < 0.7, draw_scale(rng, d)
        scores = draw_scores(rng, N_q, N_max, H_kv * group, B, "cuda")
        inputs_seed = rng.randrange(2**31)
        g = torch.Generator(device="cuda").manual_seed(inputs_seed)
        make = lambda *shape: torch.randn(*shape, d, device="cuda", dtype=DTYPES[dtype], generator=g)  # noqa: E731
        q, k_cache, v_cache = make(B, H_kv * group, N_q), make(B, H_kv, N_max), make(B, H_kv, N_max)
        k, v = (make(B, H_kv, N_new), make(B, H_kv, N_new)) if N_new else (None, None)
        description = (f"kernel={kernel} dtype={dtype} q {tuple(q.shape)} caches {tuple(k_cache.shape)} N_new={N_new} "
                       f"cache_seqlens={lengths[0] if same else lengths} causal={causal} softmax_scale={scale} "
                       f"{scores} inputs seed {inputs_seed}")

        def check_case():
            before = k_cache.clone(), v_cache.clone()
            seqlens = lengths[0] if same else torch.tensor(lengths, device="cuda")
            o, L = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k, v=v, causal=causal,
                                                softmax_scale=scale, kernel=kernel, return_lse=True, **scores)
            for b, n in enumerate(lengths):
                for name, cache, new, old in (("k", k_cache, k, before[0]), ("v", v_cache, v, before[1])):
                    rest = torch.cat([cache[b, :, :n], cache[b, :, n + N_new:]], 1)
                    assert torch.equal(rest, torch.cat([old[b, :, :n], old[b, :, n + N_new:]], 1)), \
                        f"sequence {b}: {name}_cache changed outside the appended rows"
                    assert N_new == 0 or torch.equal(cache[b, :, n:n + N_new], new[b]), \
                        f"sequence {b}: {name} is not at the sequence's length"
                slopes = scores.get("alibi_slopes")  # (B, H_q): sequence b's row
                seq = {**scores, "alibi_slopes": slopes[b]} if slopes is not None and slopes.dim() == 2 else scores
                q_b, K_b, V_b = q[b:b + 1], k_cache[b:b + 1, :, :n + N_new], v_cache[b:b + 1, :, :n + N_new]
                assert_L(L[b:b + 1], o[b:b + 1], q_b, K_b, causal, scale, f"sequence {b}", **seq)
                if L[b].isinf().all():  # (no query sees a key: O = 0, asserted)
                    continue
                exact = reference.attention(q_b.double(), K_b.double(), V_b.double(), causal, scale, **seq)
                no_cap = {**seq, "softcap": 0.0}
                exact_no_cap = exact if not seq.get("softcap") else reference.attention(
                    q_b.double(), K_b.double(), V_b.double(), causal, scale, **no_cap)
                theirs = test_masks.sdpa(causal, scale, no_cap)(q_b, K_b, V_b)
                rounded = exact.to(o.dtype).double() if seq.get("softcap") else None  # (test_kernels.rounded_O_gradients)
                within_sdpa_error("O", o[b:b + 1], theirs, exact, f"sequence {b}", r_sdpa=exact_no_cap,
                                  last_rows=False, r_rounded=rounded)
        return description, check_case
    run_cases(f"kvcache-{kernel}-{dtype}", draw)


@gpu
@every_kernel
def test_varlen_on_random_problems(kernel, dtype):
    """flash_attention_varlen on random packed batches: 1 to 5 sequences of random lengths, some without queries
    or keys, N_q != N_k per sequence half the time, GQA, head dims on the tile widths 64 and 128 (the packed builds
    python main.py makes), masks and score modifications; forward, L and gradients (test_varlen.check)."""
    def draw(rng):
        B, H_kv, group = rng.randint(1, 5), rng.randint(1, 3), rng.choice([1, 1, 2, 4])
        draw_lengths = lambda: [0 if rng.random() < 0.1 else draw_length(rng) for _ in range(B)]  # noqa: E731
        lengths_q = draw_lengths()
        lengths_k = lengths_q if rng.random() < 0.5 else draw_lengths()
        lengths_q[0], lengths_k[-1] = max(lengths_q[0], 1), max(lengths_k[-1], 1)  # (no rows at all: test_varlen's)
        d = draw_head_dim(rng, kernel, tiles=(64, 128))
        causal, scale = rng.random() < 0.5, draw_scale(rng, d)
        scores = draw_scores(rng, max(lengths_q), max(lengths_k), H_kv * group, B, "cuda")
        description = (f"kernel={kernel} dtype={dtype} lengths q {lengths_q} k {lengths_k} H {H_kv * group}/{H_kv} "
                       f"d={d} causal={causal} softmax_scale={scale} {scores}")
        return description, lambda: test_varlen.check(kernel, lengths_q, lengths_k, H_kv * group, H_kv, d,
                                                      DTYPES[dtype], causal, scale, **scores)
    run_cases(f"varlen-{kernel}-{dtype}", draw)


@pytest.mark.parametrize("dtype", test_8bit.DTYPES, ids=["fp8", "int8"])
def test_8bit_on_random_problems(dtype):
    """flash_attention_8bit on random problems: GQA, N_q != N_k, any head dim up to 256 (padded to 64, 128 or 256),
    causal or not, windows, softmax_scale, the rotation, fp8's V^T from quantize or made in the kernel. Its error
    against float64 must stay within 1.5x that of the same quantization computed in float64, plus 1e-3
    (test_8bit.test_against_float64's rule)."""
    def draw(rng):
        B, H_kv, group, N_q = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 1, 2, 4]), draw_length(rng)
        N_k = N_q if rng.random() < 0.5 else draw_length(rng)
        d = rng.choice(main.EIGHT_BIT_HEAD_DIMS) if rng.random() < 0.5 else rng.randint(8, 256)
        causal, scale, rotate = rng.random() < 0.5, draw_scale(rng, d), rng.random() < 0.5
        window = draw_scores(rng, N_q, N_k, 1, 1, "cpu").get("window_size", (-1, -1))
        transpose_v = rng.random() < 0.5 if dtype == torch.float8_e4m3fn else None
        inputs_seed, half = rng.randrange(2**31), rng.choice([torch.float16, torch.bfloat16])
        g = torch.Generator(device="cuda").manual_seed(inputs_seed)
        q = torch.randn(B, H_kv * group, N_q, d, device="cuda", dtype=half, generator=g)
        k, v = (torch.randn(B, H_kv, N_k, d, device="cuda", dtype=half, generator=g) for _ in range(2))
        description = (f"dtype={dtype} q {tuple(q.shape)} {half} k, v {tuple(k.shape)} causal={causal} "
                       f"softmax_scale={scale} window_size={window} rotate={rotate} transpose_v={transpose_v} "
                       f"inputs seed {inputs_seed}")

        def check_case():
            exact = reference.attention(q.double(), k.double(), v.double(), causal, scale, window_size=window)
            D = min(D for D in main.EIGHT_BIT_HEAD_DIMS if D >= d)
            pad = lambda x: torch.nn.functional.pad(x.double(), (0, D - d))  # noqa: E731
            signs = main.rotation_signs(D, 0, "cuda") if rotate else None
            emulated = reference.attention_8bit(pad(q), pad(k), pad(v), dtype, causal, scale or d ** -0.5, window,
                                                signs, smooth_k=dtype == torch.int8)[..., :d]
            o = flash_attention_8bit(q, k, v, causal, scale, window, dtype, rotate, transpose_v=transpose_v)
            assert o.shape == q.shape and o.dtype == q.dtype, f"O: {tuple(o.shape)} {o.dtype}"
            err, bound = test_8bit.rmse(o, exact), 1.5 * test_8bit.rmse(emulated, exact) + 1e-3
            assert err < bound, f"rmse {err:.2e}, the quantization's own {bound:.2e}"
        return description, check_case
    run_cases(f"8bit-{dtype}", draw)


def test_reference_with_random_block_sizes():
    """Algorithms 1 and 2 must give dense attention's O and gradients for any B_r, B_c, not only tile-sized
    ones: ragged last blocks, B_r != B_c, blocks of one row and blocks longer than N. Within 1e-10 per element,
    absolute and relative, as test_reference.py: a relative error of the whole tensor would fail where the exact
    gradient is zero (one key: dQ = dK = 0) and both sides hold float64 rounding of order 1e-14."""
    def draw(rng):
        B, H_kv, group, d = rng.randint(1, 2), rng.randint(1, 2), rng.choice([1, 2, 3]), rng.randint(1, 64)
        N_q, N_k = rng.randint(1, 150), rng.randint(1, 150)
        B_r, B_c, causal, scale = rng.randint(1, 70), rng.randint(1, 70), rng.random() < 0.5, draw_scale(rng, 64)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        q, do = (torch.randn(B, H_kv * group, N_q, d, dtype=torch.float64, generator=g) for _ in range(2))
        k, v = (torch.randn(B, H_kv, N_k, d, dtype=torch.float64, generator=g) for _ in range(2))
        scores = draw_scores(rng, N_q, N_k, H_kv * group, B, "cpu")

        def check_case():
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            o_ref = reference.attention(qg, kg, vg, causal, scale, **scores)
            expected = [o_ref, *torch.autograd.grad(o_ref, (qg, kg, vg), do)]
            o, L = reference.flash_forward(q, k, v, causal, scale, B_r=B_r, B_c=B_c, **scores)
            found = [o, *reference.flash_backward(q, k, v, o, L, do, causal, scale, B_r=B_r, B_c=B_c, **scores)]
            pairs = dict(zip(["O", "dQ", "dK", "dV"], zip(found, expected)))
            assert all(torch.allclose(x, r, rtol=1e-10, atol=1e-10) for x, r in pairs.values()), \
                "largest errors " + ", ".join(f"{name} {(x - r).abs().max():.1e}" for name, (x, r) in pairs.items())
        return (f"q {tuple(q.shape)} k {tuple(k.shape)} B_r={B_r} B_c={B_c} causal={causal} softmax_scale={scale} "
                f"{scores}"), check_case
    run_cases("reference", draw, factor=3)
