"""Packed batches of sequences of different lengths (flash_attention_varlen, FlashAttention's varlen layout):
against float64 (reference.attention_varlen), against the padded batch that a naive adapter would build, and
against one flash_attention call per sequence; with every mask and score modification, GQA, sequences
without queries or keys, and torch.compile. Tolerance as test_masks.py: 3x SDPA's error in the same dtype
(SDPA run per sequence), plus a small floor. Skipped, visibly, without a CUDA GPU.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import reference
from main import flash_attention, flash_attention_varlen, list_kernels, outputs, rel_err
from test_kernels import DTYPES, FLOOR, rounded_O_gradients, within_sdpa_error
from test_masks import sdpa, slopes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [(k["name"], dtype) for k in list_kernels() if k["available"] for dtype in k["dtypes"]]


def packed(lengths, H, d, dtype, device="cuda"):
    """A random packed tensor (sum(lengths), H, d) and its cu_seqlens (int32, (B + 1,))."""
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    return torch.randn(int(cu[-1]), H, d, device=device, dtype=dtype), cu


def per_sequence(attention, cu_q, cu_k):
    """attention on (1, H, N, d) views of each sequence's rows of packed q, k, v, concatenated back."""
    def run(q, k, v):
        q_, k_ = cu_q.tolist(), cu_k.tolist()
        parts = []
        for b in range(len(q_) - 1):
            q_b, k_b, v_b = (X[s:e].transpose(0, 1)[None] for X, s, e in
                             ((q, q_[b], q_[b + 1]), (k, k_[b], k_[b + 1]), (v, k_[b], k_[b + 1])))
            o_b = attention(q_b, k_b, v_b, b) if k_b.shape[2] else q_b * 0  # (no keys: O = 0)
            parts.append(o_b[0].transpose(0, 1))
        return torch.cat(parts)
    return run


def rounded_O_per_sequence(q, k, v, do, cu_q, cu_k, causal, scale, slopes_of, **scores):
    """test_kernels.rounded_O_gradients on each sequence of a packed batch, packed back: O, dQ (total_q, H_q, d),
    dK, dV (total_k, H_kv, d), zeros for a sequence without queries or keys; and the largest |L_i| of them all.
    slopes_of(b): sequence b's ALiBi."""
    found, L_max = [torch.zeros_like(t, dtype=torch.float64) for t in (q, q, k, v)], 0.0
    for b in range(len(cu_q) - 1):
        s, e, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if e == s or ek == sk:
            continue
        views = [X[a:z].transpose(0, 1)[None] for X, a, z in ((q, s, e), (k, sk, ek), (v, sk, ek), (do, s, e))]
        parts, L_b = rounded_O_gradients(*views, q.dtype, causal, scale, **{**scores, "alibi_slopes": slopes_of(b)})
        for X, part, (a, z) in zip(found, parts, ((s, e), (s, e), (sk, ek), (sk, ek))):
            X[a:z] = part[0].transpose(0, 1)
        L_max = max(L_max, L_b)
    return found, L_max


def check(kernel, lengths_q, lengths_k, H_q, H_kv, d, dtype, causal, scale=None, **scores):
    torch.manual_seed(sum(lengths_q) + 7 * sum(lengths_k))
    q, cu_q = packed(lengths_q, H_q, d, dtype)
    k, cu_k = packed(lengths_k, H_kv, d, dtype)
    v, do = torch.randn_like(k), torch.randn_like(q)
    max_q, max_k = max(lengths_q), max(lengths_k)
    slopes_of = lambda b: scores["alibi_slopes"][b] if getattr(scores.get("alibi_slopes"), "dim", int)() == 2 \
        else scores.get("alibi_slopes")  # noqa: E731
    ours = outputs(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale,
                                                          kernel=kernel, **scores), q, k, v, do)
    exact = lambda q, k, v: reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale, **scores)  # noqa: E731
    ref = outputs(exact, q.double(), k.double(), v.double(), do.double())
    no_cap = {**scores, "softcap": 0.0}
    ref_sdpa = ref if not scores.get("softcap") else outputs(
        lambda q, k, v: reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale, **no_cap),
        q.double(), k.double(), v.double(), do.double())
    theirs = outputs(per_sequence(lambda q, k, v, b: sdpa(causal, scale, {**no_cap, "alibi_slopes": slopes_of(b)})(
        q, k, v), cu_q, cu_k), q, k, v, do)
    rounded, L_max = rounded_O_per_sequence(q, k, v, do, cu_q, cu_k, causal, scale, slopes_of, **scores)
    where = f"kernel={kernel}, {dtype}, lengths q {lengths_q}, k {lengths_k}, H {H_q}/{H_kv}, causal={causal}, {scores}"
    for name, x, s, r, rs, rr in zip(["O", "dQ", "dK", "dV"], ours, theirs, ref, ref_sdpa, rounded):
        assert x.shape == r.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(r.shape)} ({where})"
        # (last_rows=False: packed tensors are (total, H, d), whose dim -2 holds the heads)
        within_sdpa_error(name, x, s, r, where, r_sdpa=rs, last_rows=False, r_rounded=rr, L_max=L_max,
                          summed=max_q * H_q // H_kv)
    # L (H_q, total_q): each sequence's own log-sum-exp, -inf where a query sees no key
    _, L = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel=kernel, return_lse=True,
                                  **scores)
    assert L.shape == (H_q, q.shape[0]) and L.dtype == torch.float32, f"L: {tuple(L.shape)} {L.dtype} ({where})"
    for b in range(len(lengths_q)):
        s, e, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if e == s:
            continue
        q_b, k_b = q[s:e].transpose(0, 1).double(), k[sk:ek].transpose(0, 1).double()
        k_b = k_b.repeat_interleave(H_q // H_kv, dim=0)
        S = q_b @ k_b.transpose(-1, -2) * (scale or 1 / math.sqrt(d))
        S = reference._modified(S, 0, 0, ek - sk - (e - s), scores.get("softcap", 0.0), slopes_of(b))
        hidden = reference._hidden(0, e - s, 0, ek - sk, q.device, ek - sk - (e - s),
                                   reference._window(causal, scores.get("window_size", (-1, -1))))
        L_exact = torch.logsumexp(S.masked_fill(hidden, -math.inf), -1)
        assert torch.equal(L[:, s:e].isinf(), L_exact.isinf()), f"L is -inf in the wrong rows of sequence {b} ({where})"
        seen = L_exact.isfinite()
        assert not seen.any() or (L[:, s:e][seen] - L_exact[seen]).abs().max() < 2e-2, f"L of sequence {b} ({where})"


# (lengths_q, lengths_k, H_q, H_kv, causal, scores): ragged sequences, sequences of one token, of no queries or
# no keys, N_q != N_k per sequence, then each mask and score modification
PROBLEMS = [
    ([5, 64, 1, 130, 77], [5, 64, 1, 130, 77], 4, 4, False, {}),
    ([5, 64, 1, 130, 77], [5, 64, 1, 130, 77], 4, 2, True, {}),
    ([3, 0, 200, 65], [40, 9, 0, 300], 4, 1, True, {}),                        # N_q != N_k, empty ones
    ([100, 17, 129], [100, 17, 129], 4, 2, True, dict(window_size=(20, -1))),  # sliding window
    ([100, 17, 129], [150, 30, 64], 4, 4, False, dict(window_size=(8, 16), softcap=4.0)),
    ([64, 190, 1], [90, 190, 33], 4, 2, True, dict(alibi_slopes="BH")),        # ALiBi per sequence
]


@pytest.mark.parametrize("lengths_q, lengths_k, H_q, H_kv, causal, scores", PROBLEMS,
                         ids=[str(i) for i in range(len(PROBLEMS))])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_varlen(kernel, dtype, lengths_q, lengths_k, H_q, H_kv, causal, scores):
    scores = dict(scores)
    if scores.get("alibi_slopes") == "BH":
        scores["alibi_slopes"] = slopes(len(lengths_q), H_q) * torch.rand(len(lengths_q), 1, device="cuda")
    check(kernel, lengths_q, lengths_k, H_q, H_kv, 64, DTYPES[dtype], causal, **scores)


@pytest.mark.parametrize("d", [40, 128])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_varlen_head_dims(kernel, dtype, d):
    """d = 40 runs on tiles of 64 columns, zero-padded; the packed builds are those python main.py makes."""
    check(kernel, [70, 1, 150], [200, 9, 150], 4, 2, d, DTYPES[dtype], True)


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_varlen_matches_one_call_per_sequence(kernel, dtype):
    """Lengths 1 .. 2048 in one packed batch: the same outputs, L and gradients as flash_attention on each
    sequence alone (the same kernel, so to rounding: dQ's atomics may add in another order)."""
    torch.manual_seed(0)
    lengths = [1, 2, 17, 64, 65, 127, 300, 1000, 2048, 3]
    dt = DTYPES[dtype]
    (q, cu), (k, _), (v, _) = packed(lengths, 8, 64, dt), packed(lengths, 2, 64, dt), packed(lengths, 2, 64, dt)
    do = torch.randn_like(q)
    O, L = flash_attention_varlen(q, k, v, cu, cu, 2048, 2048, causal=True, kernel=kernel, return_lse=True)
    ours = outputs(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 2048, 2048, causal=True, kernel=kernel),
                   q, k, v, do)
    alone = outputs(per_sequence(lambda q, k, v, b: flash_attention(q, k, v, causal=True, kernel=kernel), cu, cu),
                    q, k, v, do)
    for name, x, y in zip(["O", "dQ", "dK", "dV"], ours, alone):
        err = rel_err(x, y.double())
        assert err <= 5 * FLOOR[dt], f"{name}: {err:.1e} from one call per sequence"
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        _, L_b = flash_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                 v[s:e].transpose(0, 1)[None], causal=True, kernel=kernel, return_lse=True)
        assert torch.allclose(L[:, s:e], L_b[0], atol=1e-5, rtol=0), f"L of sequence {b} (length {e - s})"
    assert torch.equal(O, ours[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel, dtype", CASES)
def test_padded_batch(kernel, dtype, causal):
    """A batch padded to its longest sentence and masked (what an adapter without varlen does) gives, on the
    real tokens, the outputs and gradients of the packed batch. Without the mask it does not: the padding
    keys take part in every softmax."""
    torch.manual_seed(1)
    lengths, H, d, dt = [37, 200, 1, 128], 4, 64, DTYPES[dtype]
    N, B = max(lengths), len(lengths)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dt) for _ in range(4))
    real = torch.arange(N, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]  # (B, N)
    # the padded batch, float64, each query seeing its own sentence's keys (causal: up to itself)
    mask = real[:, None, None, :] & (torch.ones(N, N, device="cuda", dtype=torch.bool).tril() if causal else True)

    def padded(q, k, v, mask=mask):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.masked_fill(~real[:, None, :, None], 0.0)  # (rows of padding queries: not real tokens)
    ref = outputs(padded, q.double(), k.double(), v.double(), do.double())
    pack = lambda t: t.transpose(1, 2)[real]  # (B, H, N, d) -> (total, H, d): the real tokens  # noqa: E731
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    ours = outputs(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, N, N, causal, kernel=kernel),
                   pack(q), pack(k), pack(v), pack(do))
    theirs = outputs(padded, q, k, v, do)  # SDPA in the dtype, its error the yardstick
    for name, o, s, r in zip(["O", "dQ", "dK", "dV"], ours, theirs, ref):
        err, err_sdpa = rel_err(o, pack(r)), rel_err(pack(s), pack(r))
        assert err <= 3 * err_sdpa + FLOOR[dt], f"{name} on the real tokens: error {err:.2e}, SDPA's {err_sdpa:.2e}"
    unmasked = outputs(lambda q, k, v: padded(q, k, v, mask=None), q.double(), k.double(), v.double(), do.double())
    assert rel_err(pack(unmasked[0]), pack(ref[0])) > 0.05, "padding without a mask should change the outputs"


def test_varlen_compiles():
    """flash::varlen_forward and flash::varlen_backward inside torch.compile, fullgraph."""
    kernel, dtype = CASES[-1]
    q, cu = packed([30, 1, 90], 4, 64, DTYPES[dtype])
    k, v = torch.randn_like(q), torch.randn_like(q)
    f = torch.compile(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 90, 90, causal=True, kernel=kernel),
                      fullgraph=True)
    do = torch.randn_like(q)
    compiled = outputs(f, q, k, v, do)
    eager = outputs(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 90, 90, causal=True, kernel=kernel),
                    q, k, v, do)
    for name, x, e in zip(["O", "dQ", "dK", "dV"], compiled, eager):  # (dQ: atomics, summed in any order)
        assert rel_err(x, e.double()) < (1e-3 if name == "dQ" else 1e-6), f"{name}: compiled differs from eager"
