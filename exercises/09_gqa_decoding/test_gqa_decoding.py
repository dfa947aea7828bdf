"""Grader for exercise 09: python exercises/grade.py 09

References are dense and in float64, written here one query head at a time (query head h reads key/value head
h // G), with the bottom-right causal mask built by loops. Likely causes come from running the same dense
attention under each recognised mistake and comparing it with the answer.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import check_all, load_answer, matches, refuse_calls  # noqa: E402

import reference  # noqa: E402

ans = load_answer(__file__)
F64 = torch.float64
HEADS = [(8, 2), (8, 1), (8, 8), (32, 8), (6, 3)]                          # (H_q, H_kv)
# (B, H_q, H_kv, N_q, N_k): a group of 4, MQA, a decoding step, N_q > N_k (rows that see no key when causal),
# equal lengths
SHAPES = [(2, 8, 2, 5, 11), (1, 4, 1, 1, 37), (2, 6, 3, 9, 4), (1, 4, 4, 7, 7), (2, 8, 2, 3, 20)]


@pytest.fixture(autouse=True)
def no_reference_calls(monkeypatch):
    """The exercise is to write them: reference.py's attention, forward, mask and GQA helpers are off limits."""
    refuse_calls(monkeypatch, ans, reference, ("attention", "flash_forward", "_hidden", "_query_heads",
                                               "_sum_over_groups"), "exercise 09", "write it yourself")


def mask_by_loops(N_q, N_k, shift):
    """hidden[i][j]: key j is after query i's diagonal, j > i + shift (shift = N_k - N_q: the bottom right)."""
    return torch.tensor([[j > i + shift for j in range(N_k)] for i in range(N_q)])


def dense(Q, K, V, causal, kv_of=lambda h, G, H_kv: h // G, hidden_of=None):
    """O and L head by head. kv_of(h, G, H_kv) and hidden_of(g), the (N_q, N_k) mask of the g-th query head of a
    group (default: the bottom-right one), let the causes below replay a mistake."""
    B, H_q, N_q, d = Q.shape
    H_kv, N_k = K.shape[1], K.shape[2]
    G = H_q // H_kv
    O, L = torch.zeros_like(Q), torch.full((B, H_q, N_q), -math.inf, dtype=F64)
    bottom_right = mask_by_loops(N_q, N_k, N_k - N_q)
    hidden_of = hidden_of or (lambda g: bottom_right)
    for h in range(H_q):
        S = Q[:, h] @ K[:, kv_of(h, G, H_kv)].transpose(-1, -2) / math.sqrt(d)  # (B, N_q, N_k)
        if causal:
            S = S.masked_fill(hidden_of(h % G), -math.inf)
        for b in range(B):
            for i in range(N_q):
                if torch.isfinite(S[b, i]).any():
                    L[b, h, i] = torch.logsumexp(S[b, i], dim=-1)
                    O[b, h, i] = torch.softmax(S[b, i], dim=-1) @ V[b, kv_of(h, G, H_kv)]
    return O, L


def problem(B, H_q, H_kv, N_q, N_k, seed):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(B, H_q, N_q, 16, generator=g, dtype=F64)
    K, V = (torch.randn(B, H_kv, N_k, 16, generator=g, dtype=F64) for _ in range(2))
    return Q, K, V


def causes_of(O, Q, K, V, causal):
    """What the answer's O matches, among dense attention under the recognised mistakes."""
    if not isinstance(O, torch.Tensor) or tuple(O.shape) != tuple(Q.shape):
        return []
    H_q, H_kv, (N_q, N_k) = Q.shape[1], K.shape[1], (Q.shape[2], K.shape[2])
    found, got = [], torch.nan_to_num(O)
    if H_kv not in (1, H_q) and matches(got, dense(Q, K, V, causal, lambda h, G, n: h % n)[0], 1e-9):
        found.append("query head h reads key/value head h % H_kv (heads interleaved): the G query heads of a group are "
                     "consecutive, so it is h // G")
    top_left = lambda g: mask_by_loops(N_q, N_k, 0)  # noqa: E731
    if causal and N_q != N_k and matches(got, dense(Q, K, V, True, hidden_of=top_left)[0], 1e-9):
        found.append("the causal mask is aligned to the top left (key j visible for j <= i, as SDPA's is_causal): "
                     "FlashAttention aligns it to the bottom right, j <= i + N_k - N_q")
    if causal and N_q > N_k and torch.isnan(O).any():
        found.append("a row that sees no key is NaN (softmax over all -inf): it must be O = 0 and L = -inf")
    if causal and matches(got, dense(Q, K, V, False)[0], 1e-9):
        found.append("the causal mask is missing")
    return found


@pytest.mark.parametrize("H_q,H_kv", HEADS)
def test_kv_head(H_q, H_kv):
    G = H_q // H_kv
    got = [ans.kv_head(h, H_q, H_kv) for h in range(H_q)]
    expected = [h // G for h in range(H_q)]
    causes = []
    if got == [h % H_kv for h in range(H_q)] and got != expected:
        causes.append("heads interleaved (h % H_kv): the G query heads of a group are consecutive")
    if got == [h // H_kv for h in range(H_q)] and got != expected:
        causes.append("divided by H_kv: divide by the group size G = H_q // H_kv")
    assert got == expected, (f"kv_head for H_q={H_q}, H_kv={H_kv}: expected {expected}, got {got}"
                             + "".join("\nlikely cause:\n  " + c for c in causes))


@pytest.mark.parametrize("N_q,N_k", [(4, 10), (10, 4), (1, 37), (5, 5), (3, 3), (2, 1)])
def test_visible(N_q, N_k):
    got = ans.visible(N_q, N_k)
    expected = ~mask_by_loops(N_q, N_k, N_k - N_q)
    causes = []
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (N_q, N_k) and N_q != N_k:
        if torch.equal(got.bool(), ~mask_by_loops(N_q, N_k, 0)):
            causes.append("aligned to the top left (j <= i): the bottom right is j <= i + N_k - N_q")
        if torch.equal(got.bool(), ~mask_by_loops(N_q, N_k, N_k - N_q - 1)):
            causes.append("off by one: query i sees key i + N_k - N_q itself (the diagonal is visible)")
    check_all(f"visible({N_q}, {N_k})", [("visible", got if not isinstance(got, torch.Tensor) else got.double(),
                                          expected.double(), 0.0)], causes)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}".format(*s))
def test_attention_gqa(shape, causal):
    Q, K, V = problem(*shape, seed=sum(shape))
    O, L = ans.attention_gqa(Q, K, V, causal=causal)
    O_ref, L_ref = dense(Q, K, V, causal)
    check_all(f"attention_gqa, (B, H_q, H_kv, N_q, N_k) = {shape}, causal={causal}",
              [("O", O, O_ref, 1e-10), ("L", L, L_ref, 1e-10)], causes_of(O, Q, K, V, causal))


@pytest.mark.parametrize("H_q,H_kv", HEADS)
def test_sum_over_groups_is_the_gradient_of_shared_heads(H_q, H_kv):
    """dK of K used by G query heads: autograd through K expanded to one copy per query head, then summed."""
    g = torch.Generator().manual_seed(H_q * 10 + H_kv)
    B, N_k, d = 2, 9, 4
    K = torch.randn(B, H_kv, N_k, d, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(B, H_q, N_k, d, generator=g, dtype=F64)
    expanded = K.repeat_interleave(H_q // H_kv, dim=1)               # copy h is read by query head h
    (expanded * W).sum().backward()                                  # the loss: query head h's copy times W[:, h]
    dX = W                                                           # so each copy's gradient is W[:, h]
    got = ans.sum_over_groups(dX, H_kv)
    causes = []
    if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(K.shape):
        G = H_q // H_kv
        if H_kv not in (1, H_q) and matches(got, dX.reshape(B, G, H_kv, N_k, d).sum(1), 1e-12):
            causes.append("summed query heads h with the same h % H_kv: a group is G consecutive heads")
        if G > 1 and matches(got, K.grad / G, 1e-12):
            causes.append("averaged over the group: each query head's gradient adds to the shared head (sum)")
    check_all(f"sum_over_groups, H_q={H_q}, H_kv={H_kv}", [("dK", got, K.grad, 1e-12)], causes)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}".format(*s))
def test_pack_rows(shape):
    B, H_q, H_kv, N_q, N_k = shape
    G = H_q // H_kv
    Q = problem(*shape, seed=sum(shape) + 2)[0]
    got = ans.pack_rows(Q, H_kv)

    def stacked(head_of):  # (B, H_kv, N_q G, d): row x of block h_kv is query x // G of head head_of(h_kv, x % G)
        return torch.stack([torch.stack([Q[:, head_of(h_kv, x % G), x // G] for x in range(N_q * G)], dim=1)
                            for h_kv in range(H_kv)], dim=1)
    expected = stacked(lambda h_kv, g: h_kv * G + g)
    causes = []
    if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape):
        if G > 1 and N_q > 1 and matches(got, Q.reshape(expected.shape), 0.0):
            causes.append("head-major (a plain reshape, flash.cu's order: row x is query x % N_q): here the rows are "
                          "query-major, so trade the head and query dimensions of the (B, H_kv, G, N_q, d) view first")
        if H_kv not in (1, H_q) and matches(got, stacked(lambda h_kv, g: g * H_kv + h_kv), 0.0):
            causes.append("block h_kv holds query heads h_kv + H_kv g (heads interleaved): the G query heads of a "
                          "group are consecutive, h_kv G + g")
    check_all(f"pack_rows, (B, H_q, H_kv, N_q, N_k) = {shape}", [("packed rows", got, expected, 0.0)], causes)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}".format(*s))
def test_decode_packed(shape, causal, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decode_packed must compute on the packed rows itself, not call attention_gqa")
    monkeypatch.setattr(ans, "attention_gqa", refuse)
    pack_calls, pack_rows = [], ans.pack_rows

    def counted_pack_rows(Q, H_kv):   # head-major rows give the same O and L: see that the rows are pack_rows'
        pack_calls.append(tuple(Q.shape))
        return pack_rows(Q, H_kv)
    monkeypatch.setattr(ans, "pack_rows", counted_pack_rows)
    Q, K, V = problem(*shape, seed=sum(shape) + 1)
    O, L = ans.decode_packed(Q, K, V, causal=causal)
    O_ref, L_ref = dense(Q, K, V, causal)
    causes = causes_of(O, Q, K, V, causal)
    B, H_q, H_kv, N_q, N_k = shape
    G = H_q // H_kv
    if isinstance(O, torch.Tensor) and tuple(O.shape) == tuple(Q.shape):
        def masked_as(query_of):  # dense attention with packed row x = n G + g masked as query query_of(x)
            return dense(Q, K, V, True, hidden_of=lambda g: torch.stack(
                [torch.arange(N_k) > query_of(n * G + g) + N_k - N_q for n in range(N_q)]))[0]
        if causal and N_q > 1 and matches(torch.nan_to_num(O), masked_as(lambda x: x), 1e-9):
            causes.append("the causal mask uses the packed row x as the query: row x holds query x // G")
        if causal and N_q > 1 and G > 1 and matches(torch.nan_to_num(O), masked_as(lambda x: x % N_q), 1e-9):
            causes.append("the mask takes row x as query x % N_q, which is the head-major order (flash.cu's): here "
                          "the rows are query-major, and row x is query x // G")
        packed = O_ref.reshape(B, H_kv, G, N_q, -1).transpose(2, 3).reshape(B, H_q, N_q, -1)
        if G > 1 and N_q > 1 and matches(torch.nan_to_num(O), packed, 1e-9):
            causes.append("O is unstacked head-major (a plain reshape): the rows were stacked query-major, so undo "
                          "that order (a transpose of the query and head dimensions, then the reshape)")
    check_all(f"decode_packed, (B, H_q, H_kv, N_q, N_k) = {shape}, causal={causal}",
              [("O", O, O_ref, 1e-10), ("L", L, L_ref, 1e-10)], causes)
    assert tuple(Q.shape) in pack_calls, (
        f"decode_packed, (B, H_q, H_kv, N_q, N_k) = {shape}: O and L are right, but "
        + (f"pack_rows was called on shapes {pack_calls}, not on Q" if pack_calls else "pack_rows was never called")
        + ": attend on the query-major rows pack_rows(Q, H_kv) gives (test_pack_rows checks their order)")
