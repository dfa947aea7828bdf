"""Unequal lengths, grouped-query attention, decoding (split-KV) and the KV-cache entry point, on every kernel.

q (B, H_q, N_q, d) against k, v (B, H_kv, N_k, d): N_q != N_k both ways, N_q = 1, ragged lengths, H_q / H_kv in
{1, 4, 8}, causal aligned to the bottom right (query i sees keys j <= i + N_k - N_q), gradients included.
Errors follow test_kernels.py's rule: at most 3x the error of PyTorch's SDPA in the same dtype (given the
same bottom-right mask and the keys and values repeated per query head), plus a small floor. Skipped,
visibly, without a CUDA GPU.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from main import SPLIT_KV_MAX_QUERIES, flash_attention, flash_attention_with_kvcache, list_kernels, rel_err
import test_kernels  # tests/ is on sys.path under pytest
from test_kernels import DTYPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [(k["name"], dtype) for k in list_kernels() if k["available"] for dtype in k["dtypes"]]
SPLIT_KV = [(name, dtype) for name, dtype in CASES if next(k for k in list_kernels() if k["name"] == name)["split_kv"]]


def o_tolerance(dtype):
    """The bound on rel_err(O, float64) of the decoding and KV-cache tests: bf16 keeps 8 bits of mantissa."""
    return {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}[dtype]


def launched(fn):
    """The names of the CUDA kernels fn() launches (test_kernels.launches)."""
    return [name for name, _ in test_kernels.launches(fn)]


def ran(names, kernel_name):
    return any(f"{kernel_name}<" in name for name in names)  # ("flash_decode<" is not "flash_decode_hopper<")


def check(kernel, q, k, v, do, causal, scale=None):
    """test_kernels.check (O and the three gradients against float64, SDPA's error the yardstick), then L."""
    check_L(kernel, q, k, v, test_kernels.check(kernel, q, k, v, do, causal, scale)[0], causal, scale)


def check_L(kernel, q, k, v, o, causal, scale=None, **scores):
    """L from flash_attention against float64 (assert_L). scores: window_size, alibi_slopes, softcap, as
    flash_attention's."""
    _, L = flash_attention(q, k, v, causal, scale, kernel=kernel, return_lse=True, **scores)
    assert_L(L, o, q, k, causal, scale, f"kernel={kernel}, q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal}, "
             f"{scores}", **scores)


def assert_L(L, o, q, k, causal, scale, where, **scores):
    """L: the natural-log row log-sum-exp of the (modified, masked) scores, -inf exactly where a query sees no
    key, where O is 0. q (B, H_q, N_q, d), k (B, H_kv, N_k, d), L (B, H_q, N_q), o O."""
    N_q, N_k = q.shape[2], k.shape[2]
    S = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) \
        * (scale or 1 / math.sqrt(q.shape[-1]))
    S = reference._modified(S, 0, 0, N_k - N_q, scores.get("softcap", 0.0), scores.get("alibi_slopes"))
    window = reference._window(causal, scores.get("window_size", (-1, -1)))
    L_exact = torch.logsumexp(S.masked_fill(reference._hidden(0, N_q, 0, N_k, q.device, N_k - N_q, window), -math.inf), -1)
    assert torch.equal(L.isinf(), L_exact.isinf()), f"L is -inf in the wrong rows ({where})"
    seen = L_exact.isfinite()
    assert not seen.any() or (L[seen] - L_exact[seen]).abs().max() < (2e-2 if scores else 1e-2), \
        f"L: error {(L[seen] - L_exact[seen]).abs().max():.1e} ({where})"
    assert (o[~seen] == 0).all(), f"O is not 0 where a query sees no key ({where})"


# N_q < N_k (a KV cache; decoding at N_q = 1 and 16), N_q > N_k (causal: the first N_q - N_k queries see no
# key), ragged everywhere
LENGTHS = [(1, 1), (1, 300), (16, 1000), (7, 200), (200, 7), (65, 129), (129, 65)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H_kv", [8, 2, 1])
@pytest.mark.parametrize("N_q, N_k", LENGTHS)
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_unequal_lengths_and_groups(kernel, dtype, N_q, N_k, H_kv, causal):
    torch.manual_seed(N_q * 1000 + N_k + H_kv)
    q, do = (torch.randn(2, 8, N_q, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(2, H_kv, N_k, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    check(kernel, q, k, v, do, causal)


@pytest.mark.parametrize("d", [64, 128, 32, 80, 160, 256])
@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_splits_the_keys(kernel, dtype, d):
    """One query per head against long caches: B * H_kv blocks are few, so the keys are split over many
    (up to T_c / 4 = 78 splits at N_k = 5000), then merged by L; GQA packs a group's heads into the rows. And
    320 tiles, more than the GPU holds at once (in waves)."""
    torch.manual_seed(d)
    for B, H_q, H_kv, N_q, N_k in [(1, 8, 1, 1, 5000), (1, 32, 8, 1, 5000), (3, 4, 4, 1, 4099), (1, 8, 2, 3, 2000),
                                   (2, 32, 1, 1, 777), (40, 16, 8, 1, 1000)]:
        q, do = (torch.randn(B, H_q, N_q, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        k, v = (torch.randn(B, H_kv, N_k, d, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        for causal in (False, True):
            check(kernel, q, k, v, do, causal)


@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_runs_the_split_kernel(kernel, dtype, monkeypatch):
    """Which kernel decodes is what makes decoding fast, and results alone do not show it: N_q <=
    SPLIT_KV_MAX_QUERIES runs the split-KV kernel, a query more the forward kernel; and on a GPU that gives a
    block 99 KB (FLASH_SMEM_LIMIT), where two stages of the split-KV kernel do not fit (ampere, d = 256), the
    forward kernel, with a KV cache one sequence at a time."""
    split, forward = {"ampere": "flash_decode", "hopper": "flash_decode_hopper"}[kernel], f"flash_fwd_{kernel}"
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=DTYPES[dtype])  # noqa: E731
    for N_q, expected in ((1, split), (SPLIT_KV_MAX_QUERIES, split), (SPLIT_KV_MAX_QUERIES + 1, forward)):
        q, k, v = make(2, 8, N_q, 64), make(2, 2, 3000, 64), make(2, 2, 3000, 64)
        names = launched(lambda: flash_attention(q, k, v, kernel=kernel))
        assert ran(names, expected) and not ran(names, split if expected == forward else forward), \
            f"N_q = {N_q}: launched {names}"
    if kernel != "ampere" or 256 not in next(k for k in list_kernels() if k["name"] == kernel)["head_dims"]:
        return
    monkeypatch.setenv("FLASH_SMEM_LIMIT", str(99 * 1024))
    q, k_cache, v_cache, k, v = cache_problem(kernel, dtype, N_new=1, d=256)
    seqlens = torch.tensor([0, 17, 250], device="cuda", dtype=torch.int32)
    for call in (lambda: flash_attention(q, k_cache, v_cache, kernel=kernel),
                 lambda: flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k, v=v, kernel=kernel)):
        names = launched(call)
        assert ran(names, forward) and not ran(names, split), f"99 KB, d = 256: launched {names}"
    o = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens + 1, kernel=kernel)  # (k, v appended above)
    for b, n in enumerate(seqlens.tolist()):
        exact = reference.attention(*(x[b:b + 1, :, :n + 1].double() for x in (q, k_cache, v_cache)), causal=True)
        assert rel_err(o[b:b + 1], exact) < o_tolerance(dtype), f"99 KB, sequence {b}: {rel_err(o[b:b + 1], exact):.1e}"


def test_a_malformed_smem_limit_is_refused(monkeypatch):
    q = torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.float16)
    monkeypatch.setenv("FLASH_SMEM_LIMIT", "99KB")
    with pytest.raises(ValueError, match="FLASH_SMEM_LIMIT must be a number of bytes, such as 101376; got '99KB'"):
        flash_attention(q, q, q)


@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_tickets_are_ready_for_the_next_call(kernel, dtype):
    """The splits of a tile take tickets from a buffer kept between calls, which the last split sets back to
    zero: calls after calls, of other shapes (more tiles, other split counts) and on another stream all merge
    (a ticket left nonzero would leave that tile's O unmerged)."""
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, 64, device="cuda", dtype=DTYPES[dtype])  # noqa: E731
    problems = [(make(1, 8, 1), make(1, 1, 5000), make(1, 1, 5000)),
                (make(2, 32, 1), make(2, 8, 3000), make(2, 8, 3000)), (make(1, 4, 2), make(1, 4, 700), make(1, 4, 700))]
    first = [flash_attention(q, k, v, kernel=kernel) for q, k, v in problems]
    for (q, k, v), o in zip(problems, first):
        exact = reference.attention(q.double(), k.double(), v.double(), causal=False)
        assert rel_err(o, exact) < o_tolerance(dtype), f"{tuple(k.shape)}: O is wrong"
    for (q, k, v), o in zip(problems * 2, first * 2):  # (the merge adds the splits in one order: equal bits)
        assert torch.equal(flash_attention(q, k, v, kernel=kernel), o), f"{tuple(k.shape)}: a later call differs"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = [flash_attention(q, k, v, kernel=kernel) for q, k, v in problems]
    torch.cuda.current_stream().wait_stream(stream)
    assert all(torch.equal(a, b) for a, b in zip(side, first)), "a call on another stream differs"


@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_ragged_caches_of_many_sequences(kernel, dtype):
    """Many sequences of random lengths (0 to N_max) in one cache: each tile's splits divide its own sequence's
    keys, so a short sequence's splits are short or empty (L = -inf parts), across 48 * 4 = 192 tiles."""
    torch.manual_seed(1)
    B, H_q, H_kv, N_max = 48, 16, 4, 3000
    q = torch.randn(B, H_q, 1, 64, device="cuda", dtype=DTYPES[dtype])
    k_cache, v_cache = (torch.randn(B, H_kv, N_max, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    seqlens = torch.randint(0, N_max + 1, (B,), device="cuda", dtype=torch.int32)
    seqlens[:3] = torch.tensor([0, 1, N_max])
    o, L = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, kernel=kernel, return_lse=True)
    for b, n in enumerate(seqlens.tolist()):
        if n == 0:  # no key: O = 0 and L = -inf, as FlashAttention
            assert torch.equal(o[b], torch.zeros_like(o[b])) and bool((L[b] == -math.inf).all()), "an empty cache"
            continue
        exact = reference.attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(),
                                    v_cache[b:b + 1, :, :n].double(), causal=True)
        assert rel_err(o[b:b + 1], exact) < o_tolerance(dtype), \
            f"sequence {b} ({n} keys): error {rel_err(o[b:b + 1], exact):.1e}"


def cache_problem(kernel, dtype, B=3, H_q=8, H_kv=2, N_max=300, N_new=1, d=64):
    g = torch.Generator(device="cuda").manual_seed(N_new)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=DTYPES[dtype], generator=g)  # noqa: E731
    return make(B, H_q, N_new, d), make(B, H_kv, N_max, d), make(B, H_kv, N_max, d), make(B, H_kv, N_new, d), \
        make(B, H_kv, N_new, d)


@pytest.mark.parametrize("N_new", [1, 5, 40])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_kvcache_appends_and_attends_per_sequence(kernel, dtype, N_new):
    """Ragged caches (0, 17 and 250 tokens): the new keys and values land at each sequence's own position, and
    each sequence attends over its own prefix, bottom-right causal."""
    q, k_cache, v_cache, k, v = cache_problem(kernel, dtype, N_new=N_new)
    before = k_cache.clone()
    seqlens = torch.tensor([0, 17, 250], device="cuda", dtype=torch.int32)
    o, L = flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k, v=v, kernel=kernel, return_lse=True)
    for b, n in enumerate(seqlens.tolist()):
        assert torch.equal(k_cache[b, :, n:n + N_new], k[b]) and torch.equal(v_cache[b, :, n:n + N_new], v[b])
        assert torch.equal(k_cache[b, :, :n], before[b, :, :n]) and torch.equal(k_cache[b, :, n + N_new:],
                                                                                before[b, :, n + N_new:])
        exact = reference.attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :n + N_new].double(),
                                    v_cache[b:b + 1, :, :n + N_new].double(), causal=True)
        assert rel_err(o[b:b + 1], exact) < o_tolerance(dtype), f"sequence {b}: error {rel_err(o[b:b + 1], exact):.1e}"
        assert torch.isfinite(L[b]).all()
    assert torch.equal(seqlens.cpu(), torch.tensor([0, 17, 250], dtype=torch.int32)), "cache_seqlens was changed"


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("N_q", [1, 16])
@pytest.mark.parametrize("kernel, dtype", SPLIT_KV)
def test_decoding_ignores_what_a_cache_holds_past_its_length(kernel, dtype, N_q, d):
    """A cache's rows past a sequence's length hold anything, here NaN. The split-KV kernels copy whole key blocks
    (the hopper one by TMA, bounded by N_max alone), so the last block of a sequence brings some of those rows in:
    their scores are masked, and their V rows must not reach O either, since P = 0 times NaN is NaN. d = 96 copies
    64-column panels, 64 and 128 whole rows."""
    torch.manual_seed(d + N_q)
    B, H_q, H_kv, N_max = 4, 8, 2, 300
    lengths = [17, 65, 100, 299]  # the last key block (64 keys) cut after 17, 1, 36 and 43 keys
    q = torch.randn(B, H_q, N_q, d, device="cuda", dtype=DTYPES[dtype])
    k_cache, v_cache = (torch.full((B, H_kv, N_max, d), math.nan, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    for b, n in enumerate(lengths):
        k_cache[b, :, :n], v_cache[b, :, :n] = (torch.randn(H_kv, n, d, device="cuda") for _ in range(2))
    o, L = flash_attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"), kernel=kernel,
                                        return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(L).all(), "a row past a sequence's length reached O or L"
    for b, n in enumerate(lengths):
        exact = reference.attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(),
                                    v_cache[b:b + 1, :, :n].double(), causal=True)
        assert rel_err(o[b:b + 1], exact) < o_tolerance(dtype), f"sequence {b}: error {rel_err(o[b:b + 1], exact):.1e}"


def test_kvcache_bad_inputs():
    q, k_cache, v_cache, k, v = cache_problem("auto", "float16", N_new=4)
    for args, kwargs, words in [((3,), dict(k=k), "give both k and v"),
                                ((298,), dict(k=k, v=v), "cache_seqlens + N_new must lie in"),
                                ((torch.zeros(2, dtype=torch.int32, device="cuda"),), {}, "integer tensor of shape (3,)"),
                                ((1.5,), {}, "cache_seqlens must be an int"),
                                ((0,), dict(k=k[:, :1], v=v[:, :1]), "k, v must be (B, H_kv, N_new, d)")]:
        with pytest.raises((ValueError, TypeError)) as info:
            flash_attention_with_kvcache(q, k_cache, v_cache, *args, **kwargs)
        assert words in str(info.value)


class TinyGPT(nn.Module):
    """A nanoGPT-style decoder with grouped-query attention (8 query heads, 2 key/value heads, d = 64), whose
    attention is either SDPA over the whole prefix or flash_attention_with_kvcache over a cache."""

    def __init__(self, vocab=97, width=512, H_q=8, H_kv=2, layers=2, N_max=64):
        super().__init__()
        self.H_q, self.H_kv, self.d = H_q, H_kv, width // H_q
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(N_max, width)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            norm1=nn.LayerNorm(width), qkv=nn.Linear(width, (H_q + 2 * H_kv) * self.d), proj=nn.Linear(width, width),
            norm2=nn.LayerNorm(width), mlp=nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                         nn.Linear(4 * width, width)))) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens, start=0, caches=None, kernel="auto"):
        """Logits for tokens (B, T) at positions start .. start + T - 1. caches: one (k_cache, v_cache) per
        layer, holding the first `start` positions, or None for SDPA over tokens alone."""
        B, T = tokens.shape
        x = self.embed(tokens) + self.position(torch.arange(start, start + T, device=tokens.device))
        for layer, block in enumerate(self.blocks):
            q, k, v = block["qkv"](block["norm1"](x)).split([self.H_q * self.d, self.H_kv * self.d,
                                                             self.H_kv * self.d], dim=-1)
            q, k, v = (t.view(B, T, -1, self.d).transpose(1, 2) for t in (q, k, v))
            if caches is None:
                k, v = (t.repeat_interleave(self.H_q // self.H_kv, dim=1) for t in (k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = flash_attention_with_kvcache(q, *caches[layer], start, k=k, v=v, kernel=kernel)
            x = x + block["proj"](y.transpose(1, 2).reshape(B, T, -1))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(self.norm(x))


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_generation_with_kvcache_matches_sdpa(kernel, dtype):
    """32 greedy tokens: SDPA recomputing attention over the whole prefix at every step, and the cache: the
    prompt prefilled into it, then one token at a time. The logits of every step agree (the cache fed SDPA's
    tokens), and so do the tokens generated, wherever the rounding of the dtype cannot swap the top two."""
    torch.manual_seed(0)
    model = TinyGPT().to("cuda", DTYPES[dtype]).eval()
    prompt = torch.randint(0, 97, (2, 9), device="cuda")
    with torch.no_grad():
        tokens, sdpa_logits = prompt, []
        for _ in range(32):  # SDPA: the whole prefix every step
            sdpa_logits.append(model(tokens)[:, -1].float())
            tokens = torch.cat([tokens, sdpa_logits[-1].argmax(-1, keepdim=True)], dim=1)
        caches = [[torch.zeros(2, 2, 64, 64, device="cuda", dtype=DTYPES[dtype]) for _ in range(2)] for _ in range(2)]
        cache_logits = [model(prompt, 0, caches, kernel)[:, -1].float()]  # prefill
        for n in range(9, 40):  # then SDPA's tokens, one at a time
            cache_logits.append(model(tokens[:, n:n + 1], n, caches, kernel)[:, -1].float())
    tolerance = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2}[dtype]
    for step, (ours, theirs) in enumerate(zip(cache_logits, sdpa_logits)):
        assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max(), \
            f"step {step}: logits differ by {(ours - theirs).abs().max():.2e}"
        top2 = theirs.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tolerance * theirs.abs().max()  # a margin rounding cannot flip
        assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear]), f"step {step}: another token"
    if dtype != "bfloat16":  # fp16 and fp32 round finely enough to generate the very same 32 tokens
        generated = prompt
        caches = [[torch.zeros_like(c) for c in layer] for layer in caches]
        with torch.no_grad():
            logits = model(prompt, 0, caches, kernel)[:, -1]
            for n in range(9, 41):
                generated = torch.cat([generated, logits.argmax(-1, keepdim=True)], dim=1)
                if n < 40:
                    logits = model(generated[:, -1:], n, caches, kernel)[:, -1]
        assert torch.equal(generated, tokens), f"generated {generated[:, 9:].tolist()}, SDPA {tokens[:, 9:].tolist()}"
