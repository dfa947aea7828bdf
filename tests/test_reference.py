"""reference.py (Algorithms 1 and 2 as loops over blocks) against dense attention and autograd, in float64."""
import pytest
import torch

import reference


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
