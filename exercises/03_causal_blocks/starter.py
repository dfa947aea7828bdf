"""Exercise 03: causal block skipping. Fill in the TODOs.

With the causal mask, query r sees key c only when c <= r. The N x N score matrix is cut into blocks:
query block i holds rows i*B_r .. min((i+1)*B_r, N) - 1, key block j holds keys j*B_c .. min((j+1)*B_c, N) - 1
(indices from 0; the last block of each kind may be shorter). Only real rows and keys (< N) count.
A block pair (i, j) is
    "skip"     every (r, c) in it is masked: the kernel need not load K_j, V_j for Q_i at all;
    "partial"  some are masked and some are not: the kernel computes S_ij and applies the mask;
    "full"     none is masked: the kernel computes S_ij and needs no mask.
"""
import math


def block_kind(i, j, N, B_r, B_c):
    """'skip', 'partial' or 'full' for query block i and key block j under the causal mask."""
    # TODO 1: the first and last real row of block i, the first and last real key of block j, and compare.
    raise NotImplementedError("TODO 1: block_kind")


def classify_blocks(N, B_r, B_c):
    """{'skip': {(i, j), ...}, 'partial': {...}, 'full': {...}} over all T_r x T_c block pairs."""
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    kinds = {"skip": set(), "partial": set(), "full": set()}
    for i in range(T_r):
        for j in range(T_c):
            kinds[block_kind(i, j, N, B_r, B_c)].add((i, j))
    return kinds


def last_key_block(i, N, B_r, B_c):
    """The forward's loop bound: the largest j such that (i, j) is not skipped (the forward kernel,
    one thread block per query block i, loops j = 0 .. last_key_block(i))."""
    # TODO 2: one line of integer arithmetic (no loop).
    raise NotImplementedError("TODO 2: last_key_block")


def first_query_block(j, N, B_r, B_c):
    """The backward's loop start: the smallest i such that (i, j) is not skipped (the backward kernel,
    one thread block per key block j, loops i = first_query_block(j) .. T_r - 1)."""
    # TODO 3: one line of integer arithmetic (no loop).
    raise NotImplementedError("TODO 3: first_query_block")


def skipped_fraction(N, B_r, B_c):
    """The fraction of block pairs the causal kernels skip (tends to 1/2 as N grows)."""
    kinds = classify_blocks(N, B_r, B_c)
    return len(kinds["skip"]) / sum(len(v) for v in kinds.values())
