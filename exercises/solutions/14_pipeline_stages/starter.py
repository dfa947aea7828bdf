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
    if split:
        # K_n+s starts after V_n+s-1 (one thread, in order), which starts when P_n-1 V_n-1, issued at n - 1, is done
        # (later than S_n frees K_n's half): issue n + s - 1 needs it. V_n+s starts when P_n V_n (issue n) is done:
        # issue n + s needs it.
        return stages
    # the whole stage frees when P_n V_n (issue n) is done, and issue n + stages - 1 needs K_n+stages: two stages
    # are in use while an issue's products run
    return stages - 1


def period(T, latency, stages, split):
    """The steady-state time between issues: the products take T, and a copy that starts T after issue m (when the
    products of that issue free its memory) must land by issue m + periods(stages, split)."""
    return max(T, (T + latency) / periods(stages, split))


def fewest_stages(T, latency, split):
    """The fewest stages (at least 2) at which the copies never hold the issues back: period(...) == T."""
    return max(2, math.ceil((T + latency) / T) + (0 if split else 1))


def stages_that_fit(d, B_c, B_r=128, limit=SMEM_LIMIT):
    """The most stages of K_j and V_j (B_c rows each) that fit beside Q_i (B_r rows) in `limit` bytes, with
    fwd_hopper's layout: 16-bit rows in panels of 64 columns (128 bytes a row per panel, ceil(d / 64) panels),
    four 8-byte mbarriers a stage and one for Q_i, and 1024 bytes of slack to align the tiles. 0 if none fits."""
    panels = math.ceil(d / 64)
    stages = 0
    while (B_r + 2 * (stages + 1) * B_c) * 128 * panels + 8 * (1 + 4 * (stages + 1)) + 1024 <= limit:
        stages += 1
    return stages
