"""Masks and score modifications (flash.cu's Scores): sliding windows, ALiBi and softcap, each alone and all
together with causal, grouped-query attention and N_q != N_k, on every kernel, forward and backward; decoding
and the KV cache with them; the blocks a window removes.

Tolerance as test_kernels.py: O, dQ, dK, dV against float64 (reference.attention with the same arguments) may
err 3x as much as PyTorch's SDPA in the same dtype, plus a small floor. SDPA takes the window and ALiBi as an
explicit additive attn_mask (N_q x N_k, which the kernels never build); it has no softcap, so with a softcap
its error on the same problem without the softcap is the yardstick; or, where larger, the error of the float64
algorithm with only O rounded to the dtype (test_kernels.rounded_O_gradients). Skipped, visibly, without a CUDA
GPU.
"""
import math

import pytest
import torch

import reference
from main import flash_attention, flash_attention_with_kvcache, list_kernels, outputs, rel_err
from test_kernels import DTYPES, fused_sdpa, rounded_O_gradients, within_sdpa_error
from test_shapes import check_L

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [(k["name"], dtype) for k in list_kernels() if k["available"] for dtype in k["dtypes"]]
SPLIT_KV = [(name, dtype) for name, dtype in CASES if next(k for k in list_kernels() if k["name"] == name)["split_kv"]]


def bias(q, k, causal, window_size=(-1, -1), alibi_slopes=None, **_):
    """The window and ALiBi as SDPA's additive float mask (B or 1, H_q, N_q, N_k): -inf where hidden."""
    N_q, N_k = q.shape[2], k.shape[2]
    zeros = torch.zeros(1, q.shape[1], N_q, N_k, device=q.device, dtype=torch.float64)
    B = reference._modified(zeros, 0, 0, N_k - N_q, alibi_slopes=alibi_slopes)
    hidden = reference._hidden(0, N_q, 0, N_k, q.device, N_k - N_q, reference._window(causal, window_size))
    return B.masked_fill(hidden, -math.inf)


def sdpa(causal, scale, scores):
    def attention(q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        mask = bias(q, k, causal, **scores).to(q.dtype)
        return fused_sdpa(q, k, v, scale, attn_mask=mask).nan_to_num(0.0)
    return attention


def check(kernel, q, k, v, do, causal, scale=None, **scores):
    """O, dQ, dK, dV against float64, SDPA's error the yardstick; then L (test_shapes.check_L)."""
    exact = lambda q, k, v: reference.attention(q, k, v, causal, scale, **scores)  # noqa: E731
    ref = outputs(exact, q.double(), k.double(), v.double(), do.double())
    ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal, scale, kernel=kernel, **scores), q, k, v, do)
    no_cap = {**scores, "softcap": 0.0}
    ref_sdpa = ref if not scores.get("softcap") else outputs(
        lambda q, k, v: reference.attention(q, k, v, causal, scale, **no_cap), q.double(), k.double(), v.double(),
        do.double())
    theirs = outputs(sdpa(causal, scale, no_cap), q, k, v, do)
    rounded, L_max = rounded_O_gradients(q, k, v, do, q.dtype, causal, scale, **scores)
    where = f"kernel={kernel}, q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal}, {scores}"
    for name, x, s, r, rs, rr in zip(["O", "dQ", "dK", "dV"], ours, theirs, ref, ref_sdpa, rounded):
        within_sdpa_error(name, x, s, r, where, r_sdpa=rs, r_rounded=rr, L_max=L_max,
                          summed=q.shape[2] * q.shape[1] // k.shape[1])
    check_L(kernel, q, k, v, ours[0], causal, scale, **scores)


def slopes(*shape):
    """ALiBi's slopes for H heads: 2^(-8 h / H), h = 1..H (the BLOOM paper's), per batch if shape has 2 dims."""
    H = shape[-1]
    return (2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)).expand(*shape).contiguous()


# (causal, scores, N_q, N_k, H_q, H_kv): each step alone, then together
PROBLEMS = [
    (False, dict(window_size=(16, 8)), 200, 200, 4, 4),                    # a window on both sides
    (True, dict(window_size=(32, -1)), 150, 300, 4, 2),                    # sliding window (Mistral), a cache
    (False, dict(window_size=(-1, 5)), 130, 70, 4, 1),                     # bounded on the right only
    (False, dict(window_size=(0, 0)), 65, 65, 2, 2),                       # the diagonal alone
    (True, dict(window_size=(3, -1)), 100, 20, 2, 2),                      # N_q > N_k: rows that see no key
    (True, dict(alibi_slopes="H"), 200, 200, 4, 4),                        # ALiBi (BLOOM), per head
    (False, dict(alibi_slopes="BH"), 77, 190, 4, 2),                       # ALiBi per batch and head
    (False, dict(softcap=5.0), 200, 200, 4, 4),                            # softcap (Gemma 2)
    (True, dict(softcap=2.0), 129, 65, 4, 4),
    (True, dict(window_size=(40, -1), softcap=8.0, alibi_slopes="H"), 150, 280, 8, 2),  # all of it
    (False, dict(window_size=(50, 20), softcap=3.0, alibi_slopes="BH"), 260, 100, 4, 1),
]


@pytest.mark.parametrize("causal, scores, N_q, N_k, H_q, H_kv", PROBLEMS, ids=[str(i) for i in range(len(PROBLEMS))])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_masks_and_score_modifications(kernel, dtype, causal, scores, N_q, N_k, H_q, H_kv):
    torch.manual_seed(N_q + N_k)
    q, do = (torch.randn(2, H_q, N_q, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(2, H_kv, N_k, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    scores = dict(scores)
    if "alibi_slopes" in scores:
        scores["alibi_slopes"] = slopes(H_q) if scores["alibi_slopes"] == "H" else slopes(2, H_q) * torch.rand(2, 1, device="cuda")
    if "softcap" in scores:
        q = q * 2  # scores that reach the cap
    check(kernel, q, k, v, do, causal, **scores)


@pytest.mark.parametrize("d", [128, 256, 96])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_at_other_head_dims(kernel, dtype, d):
    """The hopper and ampere backward split columns past d = 128; d = 96 has a half-full hopper panel."""
    if d > max(k["head_dims"] for k in list_kernels() if k["name"] == kernel)[-1]:
        pytest.skip(f"kernel {kernel} has no tile of width >= {d}")
    torch.manual_seed(d)
    q, do = (torch.randn(1, 4, 170, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(1, 2, 230, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    check(kernel, q, k, v, do, True, window_size=(70, -1), softcap=6.0, alibi_slopes=slopes(4))
    check(kernel, q, k, v, do, False, window_size=(30, 90))


@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_with_scores(kernel, dtype):
    """Split-KV decoding visits only the key blocks some query's window reaches, split over blocks as ever."""
    torch.manual_seed(5)
    for B, H_q, H_kv, N_q, N_k in [(1, 8, 2, 1, 5000), (2, 32, 8, 1, 3000), (1, 4, 4, 3, 2000)]:
        q, do = (torch.randn(B, H_q, N_q, 128, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        k, v = (torch.randn(B, H_kv, N_k, 128, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        check(kernel, q, k, v, do, True, window_size=(700, -1))
        check(kernel, q * 2, k, v, do, False, softcap=4.0, alibi_slopes=slopes(B, H_q))


@pytest.mark.parametrize("N_new", [1, 7])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_kvcache_with_scores(kernel, dtype, N_new):
    """N_new tokens appended to caches of 0, 37 and 350 tokens; each sequence's window and ALiBi distances are
    aligned to its own length."""
    torch.manual_seed(N_new)
    B, H_q, H_kv, N_max, d = 3, 8, 2, 400, 64
    q = torch.randn(B, H_q, N_new, d, device="cuda", dtype=DTYPES[dtype])
    k_cache, v_cache = (torch.randn(B, H_kv, N_max, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(B, H_kv, N_new, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    lengths = [0, 37, 350]
    scores = dict(window_size=(50, -1), softcap=5.0, alibi_slopes=slopes(B, H_q))
    o = flash_attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"), k, v, kernel=kernel,
                                     **scores)
    for b, n in enumerate(lengths):
        n += N_new  # (k_cache and v_cache now hold the new tokens at n - N_new .. n - 1)
        exact = reference.attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(),
                                    v_cache[b:b + 1, :, :n].double(), True, window_size=(50, -1), softcap=5.0,
                                    alibi_slopes=scores["alibi_slopes"][b])
        err = rel_err(o[b:b + 1], exact)
        assert err < {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}[dtype], f"sequence {b}: relative error {err:.1e}"


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_blocks_outside_the_window_are_not_read(kernel, dtype):
    """With causal and window (60, -1) on N = 1536, queries from 512 on reach keys from 452 on, and keys from
    512 on are seen by queries from 512 on: NaN in the first 256 queries, keys and values must leave O, dQ, dK
    and dV from 512 on finite and as without it. A kernel that visited a block outside every window there
    would multiply its P = 0 by NaN."""
    torch.manual_seed(6)
    N = 1536
    clean = [torch.randn(1, 2, N, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(4)]
    poisoned = [x.clone() for x in clean]
    for x in poisoned[:3]:  # q, k, v; dO stays finite
        x[:, :, :256] = float("nan")
    attention = lambda q, k, v: flash_attention(q, k, v, True, kernel=kernel, window_size=(60, -1))  # noqa: E731
    for name, x, y in zip(["O", "dQ", "dK", "dV"], outputs(attention, *poisoned), outputs(attention, *clean)):
        assert torch.isfinite(x[:, :, 512:]).all(), f"{name}: a block outside every window was read"
        assert rel_err(x[:, :, 512:], y[:, :, 512:].double()) < 1e-2, f"{name} changed where no window reaches the NaN"
