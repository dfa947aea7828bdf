"""Exercise 10: 8-bit inputs for attention: int8 with one scale per block of rows, a random-sign Hadamard rotation,
and K smoothed by its mean over the keys. Fill in the four TODOs; README.md says what each one is for.

X is (B, H, N, D), float64. int8 is simulated: values on the integer grid -127 .. 127, kept as float64, which is
what the int8 kernel's tensor cores multiply exactly (int32 sums).
"""
import math

import torch


def quantize_blocks(X, rows=64):
    """(X_hat, s): X_hat (B, H, N, D) on the int8 grid, s (B, H, T), T = ceil(N / rows). Block t of a head is its rows
    t * rows .. t * rows + rows - 1 (the last block may be shorter); s = max |X| over the block / 127 (1 for a block of
    zeros) and X_hat = X / s rounded to the nearest integer, so that X ~ s X_hat block by block."""
    # TODO 1
    B, H, N, D = X.shape
    T = math.ceil(N / rows)
    blocks = torch.nn.functional.pad(X, (0, 0, 0, T * rows - N)).reshape(B, H, T, rows, D)
    amax = blocks.abs().amax(dim=(-2, -1))                                # (B, H, T)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    X_hat = torch.round(blocks / s[..., None, None]).reshape(B, H, T * rows, D)[:, :, :N]
    return X_hat, s


def dequantize(X_hat, s, rows=64):
    """s X_hat, block by block: (B, H, N, D)."""
    # TODO 2
    N = X_hat.shape[-2]
    return X_hat * s.repeat_interleave(rows, dim=-1)[..., :N, None]


def hadamard(D):
    """The (D, D) Hadamard matrix divided by sqrt(D), so orthogonal; D a power of 2. Sylvester's construction:
    H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]."""
    # TODO 3
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], dim=1), torch.cat([H, -H], dim=1)])
    return H / math.sqrt(D)


def attention_int8(Q, K, V, signs=None, smooth=False, rows=64):
    """O (B, H, N_q, D) of attention with Q and K through int8 (scale 1 / sqrt(D), no mask): K minus its mean over the
    keys if smooth; then, if signs (D,) of +-1 is given, Q and K both times R = diag(signs) hadamard(D); then Q and K
    each quantized and dequantized by blocks of `rows` rows; S = Q K^T / sqrt(D), its softmax P, and O = P V with V
    as given (the int8 kernel keeps P V in 16 bits)."""
    # TODO 4
    if smooth:
        K = K - K.mean(dim=-2, keepdim=True)
    if signs is not None:
        R = torch.diag(signs.to(torch.float64)) @ hadamard(Q.shape[-1])
        Q, K = Q @ R, K @ R
    Q, K = (dequantize(*quantize_blocks(X, rows), rows) for X in (Q, K))
    return torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1]), dim=-1) @ V
