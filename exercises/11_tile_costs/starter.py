"""Exercise 11: rounds of tiles, a fixed cost per tile, and the split count. Fill in the TODOs (README.md).

Units: times in milliseconds where a name ends in _ms, microseconds where it ends in _us.
"""


def rounds(tiles, slots):
    """How many rounds `tiles` thread blocks take on a GPU that holds `slots` at once (an int)."""
    # TODO 1
    raise NotImplementedError("TODO 1: rounds")


def fit_tile_cost(T_c1, ms1, T_c2, ms2, n_rounds):
    """(x_us, y_us) of t = n_rounds (x + y T_c), from two launches with T_c1 != T_c2 key blocks per tile."""
    # TODO 2
    raise NotImplementedError("TODO 2: fit_tile_cost")


def predict_ms(x_us, y_us, T_c, n_rounds):
    """The model's time of a launch, in milliseconds."""
    # TODO 3
    raise NotImplementedError("TODO 3: predict_ms")


def steady_rate(y_us, work_per_block, slots):
    """The GPU's rate once every slot streams: work per second."""
    # TODO 4
    raise NotImplementedError("TODO 4: steady_rate")


def fixed_share(x_us, y_us, T_c):
    """The fraction of one tile's time spent on its fixed cost."""
    # TODO 5
    raise NotImplementedError("TODO 5: fixed_share")


def best_splits(units, T_c, slots, fixed=2, max_splits=128):
    """The split count flash.cu's decoding launcher picks (README.md, item 6)."""
    # TODO 6
    raise NotImplementedError("TODO 6: best_splits")
