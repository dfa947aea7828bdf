"""Exercise 14: how many stages hide a copy (notebook 08, sections 4 and 5: the hopper forward's mbarrier ring and
its schedule). Fill in the four TODOs.

The model. The consumers' loop issues S_i,j+1 = Q_i K_j+1^T together with P_ij V_j ("issue j", at time a_j). The
products of one issue take T on the tensor cores, S_i,j+1 first: it is done at a_j + T/2, P_ij V_j at a_j + T, and
the next issue comes no sooner (a_j+1 >= a_j + T). K_j and V_j sit in stage j % stages. One producer thread copies
K_0, V_0, K_1, V_1, ... in that order, each as soon as its memory is free; a copy lands `latency` after it starts.
With one pair of mbarriers a stage is free once P V of the block in it is done; with K_j and V_j apart (split),
K_j's half once S_ij is done, V_j's once P_ij V_j is. Issue j needs K_j+1 and V_j landed.
"""
import math

SMEM_LIMIT = 232448  # bytes of shared memory one thread block may use on sm_90 (227 KB)


def periods(stages, split):
    """How many issues a copy has, in the steady state: the copy of block n + stages starts right after the
    products of some issue m (when they free its memory), and the issue that needs it is issue m + periods.
    stages >= 2."""
    raise NotImplementedError("TODO: the issues between the start of a copy and the issue that needs it")


def period(T, latency, stages, split):
    """The steady-state time between issues: the products take T, and a copy that starts T after issue m (when the
    products of that issue free its memory) must land by issue m + periods(stages, split)."""
    raise NotImplementedError("TODO: the steady-state time between issues")


def fewest_stages(T, latency, split):
    """The fewest stages (at least 2) at which the copies never hold the issues back: period(...) == T."""
    raise NotImplementedError("TODO: the least stages at which the period is T")


def stages_that_fit(d, B_c, B_r=128, limit=SMEM_LIMIT):
    """The most stages of K_j and V_j (B_c rows each) that fit beside Q_i (B_r rows) in `limit` bytes, with
    fwd_hopper's layout: 16-bit rows in panels of 64 columns (128 bytes a row per panel, ceil(d / 64) panels),
    four 8-byte mbarriers a stage and one for Q_i, and 1024 bytes of slack to align the tiles. 0 if none fits."""
    raise NotImplementedError("TODO: the most stages that fit beside Q_i")
