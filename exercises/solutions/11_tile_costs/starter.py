"""Exercise 11: rounds of tiles, a fixed cost per tile, and the split count. (Solution.)

Units: times in milliseconds where a name ends in _ms, microseconds where it ends in _us.
"""


def rounds(tiles, slots):
    """How many rounds `tiles` thread blocks take on a GPU that holds `slots` at once (an int)."""
    return -(-tiles // slots)  # a partly full last round takes a whole tile's time


def fit_tile_cost(T_c1, ms1, T_c2, ms2, n_rounds):
    """(x_us, y_us) of t = n_rounds (x + y T_c), from two launches with T_c1 != T_c2 key blocks per tile."""
    t1, t2 = 1000 * ms1 / n_rounds, 1000 * ms2 / n_rounds  # one round: one tile's time, in us
    y = (t2 - t1) / (T_c2 - T_c1)
    return t1 - y * T_c1, y


def predict_ms(x_us, y_us, T_c, n_rounds):
    """The model's time of a launch, in milliseconds."""
    return n_rounds * (x_us + y_us * T_c) / 1000


def steady_rate(y_us, work_per_block, slots):
    """The GPU's rate once every slot streams: work per second."""
    return slots * work_per_block / (y_us * 1e-6)


def fixed_share(x_us, y_us, T_c):
    """The fraction of one tile's time spent on its fixed cost."""
    return x_us / (x_us + y_us * T_c)


def best_splits(units, T_c, slots, fixed=2, max_splits=128):
    """The split count flash.cu's decoding launcher picks (README.md, item 6)."""
    cost = lambda S: rounds(units * S, slots) * (-(-T_c // S) + fixed)
    best = 1
    for S in range(2, min(T_c // 2, max_splits) + 1):
        if cost(S) < cost(best):
            best = S
    return best
