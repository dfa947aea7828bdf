"""Exercise 03: which block pairs a sliding-window (local) causal kernel computes. Fill in the TODOs.

Sliding-window causal attention (as in Mistral or Longformer's local attention): query r sees key c only
when r - W < c <= r, the W most recent keys including its own. W >= N is ordinary causal attention.
The N x N score matrix is cut into blocks: query block i holds rows i*B_r .. min((i+1)*B_r, N) - 1, key
block j holds keys j*B_c .. min((j+1)*B_c, N) - 1 (indices from 0; the last block of each kind may be
shorter). Only real rows and keys (< N) count. A block pair (i, j) is
    "skip"     every (r, c) in it is masked: the kernel need not load K_j, V_j for Q_i at all;
    "partial"  some are masked and some are not: the kernel computes S_ij and applies the mask;
    "full"     none is masked: the kernel computes S_ij and needs no mask.
"""
import math


def block_kind(i, j, N, B_r, B_c, W):
    """'skip', 'partial' or 'full' for query block i and key block j under the window W."""
    # TODO 1: the first and last real row of block i, the first and last real key of block j, and compare.
    raise NotImplementedError("TODO 1: block_kind")


def classify_blocks(N, B_r, B_c, W):
    """{'skip': {(i, j), ...}, 'partial': {...}, 'full': {...}} over all T_r x T_c block pairs."""
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    kinds = {"skip": set(), "partial": set(), "full": set()}
    for i in range(T_r):
        for j in range(T_c):
            kinds[block_kind(i, j, N, B_r, B_c, W)].add((i, j))
    return kinds


def key_block_range(i, N, B_r, B_c, W):
    """The forward's loop bounds (first_j, last_j): the forward kernel, one thread block per query block
    i, computes key blocks first_j .. last_j and skips the others (the non-skipped ones are contiguous)."""
    # TODO 2: two lines of integer arithmetic (no loop over blocks).
    raise NotImplementedError("TODO 2: key_block_range")


def query_block_range(j, N, B_r, B_c, W):
    """The backward's loop bounds (first_i, last_i): the backward kernel, one thread block per key block
    j, computes query blocks first_i .. last_i and skips the others."""
    # TODO 3: two lines of integer arithmetic (no loop over blocks).
    raise NotImplementedError("TODO 3: query_block_range")


def computed_fraction(N, B_r, B_c, W):
    """The fraction of block pairs the kernels compute (not skipped)."""
    kinds = classify_blocks(N, B_r, B_c, W)
    return 1 - len(kinds["skip"]) / sum(len(v) for v in kinds.values())
