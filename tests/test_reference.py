"""reference.py (Algorithms 1 and 2 as loops over blocks) against dense attention and autograd, in float64."""
import math

import pytest
import torch

import main
import reference
import test_kernels  # (tests/ is on sys.path under pytest)


def random_problem(N, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, N, d, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, dO


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("N", [1, 7, 63, 64, 65, 200])
def test_forward_and_backward_match_dense(N, d, causal):
    q, k, v, do = random_problem(N, d, seed=N * 1000 + d + causal)
    scale = 0.3  # not 1/sqrt(d), so a forgotten scale shows
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_ref = reference.attention(qg, kg, vg, causal, scale)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (qg, kg, vg), do)
    S = q @ k.transpose(-1, -2) * scale
    if causal:
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    L_ref = torch.logsumexp(S, dim=-1)

    # block sizes that divide nothing here, and differ, so row and column bounds are both exercised
    o, L = reference.flash_forward(q, k, v, causal, scale, B_r=16, B_c=24)
    dq, dk, dv = reference.flash_backward(q, k, v, o, L, do, causal, scale, B_r=16, B_c=24)
    for name, x, ref in [("O", o, o_ref), ("L", L, L_ref), ("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)]:
        torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescaling_gives_the_same_O_and_L(causal):
    # Keys whose norms grow along the sequence: each row's maximum passes m_i + tau again and again, so m_i moves
    # late and often, and stays put in between
    q, k, v, _ = random_problem(200, 16, seed=3)
    k = k * torch.linspace(0.2, 4.0, 200, dtype=torch.float64)[:, None]
    tau = 8 * math.log(2)  # the Hopper forward's 8, in base-2 units
    S = q @ k.transpose(-1, -2)
    assert (S.amax(-1) > S[..., :24].amax(-1) + tau).float().mean() > 0.9  # the input does what it is for
    o, L = reference.flash_forward(q, k, v, causal, 1.0, B_r=16, B_c=24, tau=tau)
    o_ref, L_ref = reference.flash_forward(q, k, v, causal, 1.0, B_r=16, B_c=24)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(L, L_ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="tau must be >= 0"):
        reference.flash_forward(q, k, v, tau=-1.0)


def test_default_scale_is_one_over_sqrt_d():
    q, k, v, _ = random_problem(33, 16, seed=1)
    o, _ = reference.flash_forward(q, k, v)
    torch.testing.assert_close(o, reference.attention(q, k, v, softmax_scale=16 ** -0.5))


def test_causal_first_row_sees_only_first_key():
    q, k, v, _ = random_problem(10, 16, seed=2)
    o, L = reference.flash_forward(q, k, v, causal=True, B_r=4, B_c=4)
    torch.testing.assert_close(o[..., 0, :], v[..., 0, :])
    torch.testing.assert_close(L[..., 0], (q[..., 0, :] * k[..., 0, :]).sum(-1) / 4)


@pytest.mark.parametrize("split", [1, 13, 32, 47])
def test_merging_two_halves_of_the_keys_by_L_equals_the_whole(split):
    # Attention over keys 0..split-1 and over split..N-1, merged by their log-sum-exps, is attention over all
    q, k, v, _ = random_problem(48, 16, seed=split)

    def part(keys):  # O and L of attention over some of the keys only
        S = q @ k[..., keys, :].transpose(-1, -2) / 4
        return torch.softmax(S, dim=-1) @ v[..., keys, :], torch.logsumexp(S, dim=-1)

    o, L = reference.merge(*part(slice(0, split)), *part(slice(split, 48)))
    o_all, L_all = reference.flash_forward(q, k, v, B_r=16, B_c=16)
    torch.testing.assert_close(o, o_all, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(L, L_all, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H_q, H_kv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("N_q, N_k", [(1, 50), (7, 13), (13, 7), (50, 1)])
def test_unequal_lengths_and_groups_match_dense(N_q, N_k, H_q, H_kv, causal):
    g = torch.Generator().manual_seed(N_q * 100 + N_k + H_kv)
    q, do = (torch.randn(2, H_q, N_q, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, H_kv, N_k, 16, generator=g, dtype=torch.float64) for _ in range(2))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_ref = reference.attention(qg, kg, vg, causal)
    grads_ref = torch.autograd.grad(o_ref, (qg, kg, vg), do)
    # dense L: bottom-right causal, query i sees keys j <= i + N_k - N_q; a row that sees none has L = -inf
    S = q @ k.repeat_interleave(H_q // H_kv, dim=1).transpose(-1, -2) / 4
    if causal:
        S = S.masked_fill(torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q).logical_not(), float("-inf"))
    L_ref = torch.logsumexp(S, dim=-1)

    o, L = reference.flash_forward(q, k, v, causal, B_r=4, B_c=6)
    grads = reference.flash_backward(q, k, v, o, L, do, causal, B_r=4, B_c=6)
    assert torch.equal(L.isinf(), L_ref.isinf()) and (not causal or N_q <= N_k or L.isinf().any())
    assert (o[L.isinf()] == 0).all(), "a query that sees no key must get O = 0"
    for name, x, ref in [("O", o, o_ref), ("L", L, L_ref), *zip(["dQ", "dK", "dV"], grads, grads_ref)]:
        assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(ref.shape)}"
        torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("splits", [1, 2, 5, 40])
def test_split_kv_equals_one_pass(splits):
    # 40 splits of 12 key blocks: most splits are empty, and their L = -inf parts must weigh nothing
    g = torch.Generator().manual_seed(splits)
    q = torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 70, 16, generator=g, dtype=torch.float64) for _ in range(2))
    for causal in (False, True):
        o, L = reference.flash_decode(q, k, v, causal, splits=splits, B_c=6)
        o_ref, L_ref = reference.flash_forward(q, k, v, causal, B_c=6)
        torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(L, L_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_is_block_diagonal_attention(causal):
    """A packed batch is one attention over all its tokens with a block-diagonal mask: query and key in the
    same sequence (and, causal, the key at most at the query's bottom-right position in it)."""
    torch.manual_seed(3)
    lengths_q, lengths_k = [3, 1, 7, 5], [4, 6, 7, 2]
    cu_q, cu_k = (torch.tensor([0, *n]).cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    Q = torch.randn(sum(lengths_q), 4, 8, dtype=torch.float64)
    K, V = (torch.randn(sum(lengths_k), 2, 8, dtype=torch.float64) for _ in range(2))
    seq_q = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths_q))  # each token's sequence
    seq_k = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths_k))
    pos_q = torch.arange(len(seq_q)) - cu_q[seq_q] + (cu_k[seq_q + 1] - cu_k[seq_q]) - (cu_q[seq_q + 1] - cu_q[seq_q])
    pos_k = torch.arange(len(seq_k)) - cu_k[seq_k]
    seen = (seq_q[:, None] == seq_k[None, :]) & (~torch.tensor(causal) | (pos_k[None, :] <= pos_q[:, None]))
    S = torch.einsum("qhd,khd->hqk", Q, K.repeat_interleave(2, dim=1)) / math.sqrt(8)
    P = torch.softmax(S.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    expected = torch.einsum("hqk,khd->qhd", P, V.repeat_interleave(2, dim=1))
    O = reference.attention_varlen(Q, K, V, cu_q, cu_k, causal)
    assert torch.allclose(O, expected, atol=1e-12)


def attention_by_definition(q, k, v, scale, causal, window, softcap, slopes):
    """O and L from the rules as flash_attention's docstring states them, one score at a time in float64 (built
    without reference.py's helpers, which the kernels' tests share): query i of N_q sees key j of N_k when
    i + N_k - N_q - left <= j <= i + N_k - N_q + right, a side of -1 being no bound and causal making right 0; the
    score is scale q_i . k_j, then c tanh(score / c) with a softcap c > 0, then minus slope_h |i + N_k - N_q - j|
    with ALiBi (slopes (H_q,) or (B, H_q)); query head h reads key/value head h // (H_q / H_kv); a query that sees
    no key gets O = 0 and L = -inf."""
    B, H_q, N_q, d = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    left, right = window[0], 0 if causal else window[1]
    O, L = [], []
    for b in range(B):
        for h in range(H_q):
            g = h // (H_q // H_kv)
            slope = None if slopes is None else float(slopes[b, h] if slopes.dim() == 2 else slopes[h])
            for i in range(N_q):
                diagonal = i + N_k - N_q
                seen = [j for j in range(N_k)
                        if (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)]
                if not seen:
                    O.append(q.new_zeros(d))
                    L.append(q.new_tensor(-math.inf))
                    continue
                scores = []
                for j in seen:
                    s = scale * (q[b, h, i] @ k[b, g, j])
                    if softcap > 0:
                        s = softcap * torch.tanh(s / softcap)
                    if slope is not None:
                        s = s - slope * abs(diagonal - j)
                    scores.append(s)
                scores = torch.stack(scores)
                weights = torch.exp(scores - scores.max())
                L.append(scores.max() + torch.log(weights.sum()))
                O.append(sum(w * v[b, g, j] for w, j in zip(weights, seen)) / weights.sum())
    return torch.stack(O).view(B, H_q, N_q, d), torch.stack(L).view(B, H_q, N_q)


@pytest.mark.parametrize("N_q, N_k", [(1, 11), (9, 9), (9, 4), (6, 13)])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 3)), (True, (3, -1)),
                                            (False, (0, 0)), (False, (-1, 1)), (False, (4, -1))])
def test_masks_and_score_modifications_follow_their_definitions(N_q, N_k, causal, window):
    """reference.attention and flash_forward, and flash_backward against autograd through the definition, with a
    window, a softcap and ALiBi (per head, and per sequence and head), on unequal lengths and grouped heads."""
    g = torch.Generator().manual_seed(N_q * 100 + N_k + 7 * window[0] + causal)
    q, do = (torch.randn(2, 4, N_q, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, N_k, 8, generator=g, dtype=torch.float64) for _ in range(2))
    for softcap, slopes in [(0.0, None), (1.5, torch.rand(4, generator=g, dtype=torch.float64)),
                            (0.0, torch.rand(2, 4, generator=g, dtype=torch.float64))]:
        scores = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        O_def, L_def = attention_by_definition(qg, kg, vg, 0.7, causal, window, softcap, slopes)
        grads_def = torch.autograd.grad(O_def, (qg, kg, vg), do)
        O_dense = reference.attention(q, k, v, causal, 0.7, **scores)
        O, L = reference.flash_forward(q, k, v, causal, 0.7, B_r=4, B_c=3, **scores)
        grads = reference.flash_backward(q, k, v, O, L, do, causal, 0.7, B_r=4, B_c=3, **scores)
        where = f"causal={causal}, window={window}, softcap={softcap}, ALiBi {slopes is not None}"
        assert torch.equal(L.isinf(), L_def.isinf()), f"rows that see no key differ ({where})"
        for name, x, ref in [("O, dense", O_dense, O_def), ("O", O, O_def), ("L", L, L_def),
                             *zip(["dQ", "dK", "dV"], grads, grads_def)]:
            torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name} ({where}): {m}")


def test_the_gpu_tests_catch_a_wrong_last_tile():
    """test_kernels.within_sdpa_error, the GPU tests' check, on a made-up result: float64's O rounded to fp16, whose
    last 64 of 4096 causal rows each see one key too many (a mask's mistake at a tile's edge). Its whole tensor errs
    6.7e-4 where SDPA's fp16 result errs 2.6e-4: under the bound of 3x. Its last 64 rows err 1.3e-2, 46x SDPA's
    there. On the CPU, with SDPA's CPU fp16 result as the yardstick."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4096, 64, dtype=torch.float16) for _ in range(3))
    exact = reference.attention(q.double(), k.double(), v.double(), causal=True)
    one_too_many = reference.attention(q.double(), k.double(), v.double(), causal=False, window_size=(-1, 1))
    wrong = torch.cat([exact[..., :-64, :], one_too_many[..., -64:, :]], dim=2).half()
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    test_kernels.within_sdpa_error("O", exact.half(), theirs, exact, "right")
    whole = main.rel_err(wrong, exact) <= 3 * main.rel_err(theirs, exact) + test_kernels.FLOOR[torch.float16]
    assert whole, "the whole tensor's error alone already catches this case: choose a subtler one"
    with pytest.raises(AssertionError, match="O, last 64 rows: relative error"):
        test_kernels.within_sdpa_error("O", wrong, theirs, exact, "one key too many")
