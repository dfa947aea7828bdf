"""Grader for exercise 10: python exercises/grade.py 10

References are written here block by block and entry by entry, independently of the answer: the int8 grid with a
loop over blocks, the Hadamard matrix from its closed form H[i][j] = (-1)^popcount(i & j) / sqrt(D), attention
in float64. Likely causes come from the same references under each recognised mistake.
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


@pytest.fixture(autouse=True)
def no_reference_calls(monkeypatch):
    """The exercise is to write the quantization: reference.py's 8-bit functions are off limits."""
    refuse_calls(monkeypatch, ans, reference, ("quantize_blocks", "round_8bit", "rotation", "attention_8bit"),
                 "exercise 10", "write it yourself")


def quantize_ref(X, rows, qmax=127, rounding=torch.round, per="block"):
    """The int8 grid block by block; qmax, rounding and per ("block", "head", "row") replay mistakes."""
    B, H, N, D = X.shape
    T = math.ceil(N / rows)
    X_hat, s = torch.empty_like(X), torch.empty(B, H, T, dtype=F64)
    for t in range(T):
        block = X[:, :, t * rows:(t + 1) * rows]
        if per == "head":
            block_max = X.abs().flatten(2).amax(-1)[..., None, None]
        elif per == "row":
            block_max = block.abs().amax(-1, keepdim=True)
        else:
            block_max = block.abs().flatten(2).amax(-1)[..., None, None]
        scale = torch.where(block_max > 0, block_max / qmax, torch.ones_like(block_max))
        X_hat[:, :, t * rows:(t + 1) * rows] = rounding(block / scale)
        s[:, :, t] = scale.flatten(2)[..., 0]
    return X_hat, s


def hadamard_ref(D):
    i = torch.arange(D)
    bits = (i[:, None] & i[None, :]).tolist()
    return torch.tensor([[(-1.0) ** bin(x).count("1") for x in row] for row in bits], dtype=F64) / math.sqrt(D)


def attention_ref(Q, K, V, signs=None, smooth=False, rows=64, mistake=None):
    """What attention_int8 returns; `mistake` replays a recognised one."""
    D = Q.shape[-1]
    if smooth:
        K = K - K.mean(dim=-1 if mistake == "mean over D" else -2, keepdim=True)
        if mistake == "smooth Q":
            Q = Q - Q.mean(dim=-2, keepdim=True)
    if signs is not None:
        R = hadamard_ref(D) * signs[None, :] if mistake == "signs on columns" else signs[:, None] * hadamard_ref(D)
        Q = Q @ R
        K = K if mistake == "rotate Q only" else K @ R
        V = V @ R if mistake == "rotate V" else V
    deq = []
    for X in (Q, K, V) if mistake == "quantize V" else (Q, K):
        X_hat, s = quantize_ref(X, rows)
        deq.append(X_hat * s.repeat_interleave(rows, dim=-1)[..., :X.shape[-2], None])
    Q, K = deq[:2]
    V = deq[2] if mistake == "quantize V" else V
    S = Q @ K.transpose(-1, -2) / (1.0 if mistake == "no scale" else math.sqrt(D))
    return torch.softmax(S, dim=-1) @ V


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


QUANT_CASES = [((2, 3, 130, 16), 64), ((1, 2, 64, 8), 64), ((1, 1, 7, 4), 2), ((2, 1, 40, 8), 16)]


@pytest.mark.parametrize("shape,rows", QUANT_CASES, ids=lambda c: str(c))
def test_quantize_blocks(shape, rows):
    X = 3 * randn(*shape, seed=sum(shape) + rows)
    X[0, 0, :rows] = 0.0                                                  # a block of zeros: its scale is 1
    X[-1, -1, -1, -1] = 40.0                                              # an outlier in the last block
    got = ans.quantize_blocks(X, rows)
    X_hat, s = quantize_ref(X, rows)
    causes = []
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor):
        g = got[0]
        if torch.isnan(g).any():
            causes.append("a block of zeros gives 0 / 0 = NaN: its scale must be 1 (any value works, its X_hat is 0)")
        for label, kwargs in [("one scale per head (the whole tensor's max): an outlier then costs every block its "
                               "precision; take the max over each block of rows", dict(per="head")),
                              ("one scale per row: the kernels keep one per block of rows (one s_Q,i per query block, "
                               "folded into the softmax scale once)", dict(per="row")),
                              ("the grid's largest value is 127 (s = max / 127), not 128", dict(qmax=128)),
                              ("X / s truncated toward zero: round to the nearest integer", dict(rounding=torch.trunc)),
                              ("X / s floored: round to the nearest integer", dict(rounding=torch.floor))]:
            if g.shape == X.shape and matches(g, quantize_ref(X, rows, **kwargs)[0], 0.0):
                causes.append(label)
        if isinstance(got[1], torch.Tensor) and got[1].shape == s.shape and matches(got[1], 1 / s, 1e-12):
            causes.append("s is 127 / max, the inverse: X ~ s X_hat needs s = max / 127")
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"quantize_blocks must return (X_hat, s), got {type(got).__name__}")
    check_all(f"quantize_blocks, X {shape}, rows={rows} (T = {s.shape[-1]} blocks a head, the last "
              f"{shape[2] - (s.shape[-1] - 1) * rows} rows)", [("X_hat", got[0], X_hat, 0.0), ("s", got[1], s, 1e-14)],
              causes)


@pytest.mark.parametrize("shape,rows", QUANT_CASES, ids=lambda c: str(c))
def test_dequantize(shape, rows):
    X = randn(*shape, seed=sum(shape) * 3 + rows)
    X_hat, s = quantize_ref(X, rows)
    expected = X_hat * s.repeat_interleave(rows, dim=-1)[..., :shape[2], None]
    check_all(f"dequantize, X {shape}, rows={rows}", [("s X_hat", ans.dequantize(X_hat, s, rows), expected, 1e-14)])


@pytest.mark.parametrize("D", [1, 2, 8, 64, 128])
def test_hadamard(D):
    got = ans.hadamard(D)
    causes = []
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (D, D) and D > 1:
        if matches(got, hadamard_ref(D) * math.sqrt(D), 1e-12):
            causes.append("not divided by sqrt(D): H H^T = D I, so (Q H)(K H)^T would be D Q K^T")
        elif matches(got @ got.T, torch.eye(D, dtype=F64), 1e-12):
            causes.append("orthogonal, but not Sylvester's matrix: H_2n = [[H_n, H_n], [H_n, -H_n]]")
    check_all(f"hadamard({D})", [("H", got, hadamard_ref(D), 1e-14)], causes)


def attention_causes(O, Q, K, V, signs, smooth, rows):
    found = []
    if not isinstance(O, torch.Tensor) or O.shape != Q.shape:
        return found
    for mistake, text in [("rotate V", "V was rotated too: R cancels only in Q K^T; P V needs V as given"),
                          ("rotate Q only", "only Q was rotated: K needs the same R, so that (Q R)(K R)^T = Q K^T"),
                          ("signs on columns", "R = Hadamard diag(signs) (signs on the columns): the rotation is "
                                               "diag(signs) Hadamard, signs on the rows (signs[:, None] * H)"),
                          ("smooth Q", "Q was smoothed too: subtracting K's mean shifts a whole row of S by -q . mean, "
                                       "which the softmax cancels; Q's mean does not cancel"),
                          ("mean over D", "K's mean taken over the D channels of each key: it must be over the keys "
                                          "(dim -2), one D-vector, so that every score of a row moves by the same "
                                          "amount"),
                          ("quantize V", "V was quantized too: the int8 kernel keeps P V in 16 bits (V as given)"),
                          ("no scale", "the softmax scale 1 / sqrt(D) is missing")]:
        if (signs is not None or mistake not in ("rotate V", "rotate Q only", "signs on columns")) and \
           (smooth or mistake not in ("smooth Q", "mean over D")) and \
           matches(O, attention_ref(Q, K, V, signs, smooth, rows, mistake), 1e-10):
            found.append(text)
    return found


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("smooth", [False, True])
def test_attention_int8(rotate, smooth):
    B, H, N_q, N_k, D = 1, 2, 70, 150, 32
    Q, K, V = randn(B, H, N_q, D, seed=1), 2 + randn(B, H, N_k, D, seed=2), randn(B, H, N_k, D, seed=3)
    signs = torch.where(randn(D, seed=4) > 0, 1.0, -1.0) if rotate else None
    O = ans.attention_int8(Q, K, V, signs=signs, smooth=smooth)
    check_all(f"attention_int8, Q {tuple(Q.shape)}, K {tuple(K.shape)}, rotate={rotate}, smooth={smooth}",
              [("O", O, attention_ref(Q, K, V, signs, smooth), 1e-10)],
              attention_causes(O, Q, K, V, signs, smooth, 64))


def rmse(O, exact):
    return float(((O - exact) ** 2).mean().sqrt())


def test_the_rotation_spreads_outlier_channels():
    """Q and K with two outlier channels (25x, in every token, as real models have): the rotation spreads them over
    all D channels, so each block's max, which sets its int8 step, shrinks."""
    B, H, N, D = 1, 2, 256, 64
    Q, K, V = randn(B, H, N, D, seed=5), randn(B, H, N, D, seed=6), randn(B, H, N, D, seed=7)
    for X in (Q, K):
        X[..., [3, 40]] *= 25
    exact = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(D), dim=-1) @ V
    signs = torch.where(randn(D, seed=8) > 0, 1.0, -1.0)
    plain, rotated = rmse(ans.attention_int8(Q, K, V), exact), rmse(ans.attention_int8(Q, K, V, signs=signs), exact)
    assert rotated < plain / 2, (f"RMSE of O against float64: {plain:.2e} without the rotation, {rotated:.2e} with it; "
                                 "expected the rotation to at least halve it")


def test_smoothing_removes_a_common_offset_of_the_keys():
    """Keys that share an offset (a mean over the tokens far from zero) inflate every block's max; subtracting the mean
    changes no softmax row, and the int8 step shrinks."""
    B, H, N, D = 1, 2, 256, 64
    Q, K, V = randn(B, H, N, D, seed=9), randn(B, H, N, D, seed=10), randn(B, H, N, D, seed=11)
    K += 12 * randn(D, seed=12)                                           # the same offset vector in every key
    exact = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(D), dim=-1) @ V
    plain, smoothed = rmse(ans.attention_int8(Q, K, V), exact), rmse(ans.attention_int8(Q, K, V, smooth=True), exact)
    assert smoothed < plain / 2, (f"RMSE of O against float64: {plain:.2e} without smoothing, {smoothed:.2e} with it; "
                                  "expected smoothing to at least halve it")
