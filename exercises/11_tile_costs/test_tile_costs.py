"""Grader for exercise 11: python exercises/grade.py 11"""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import close, load_answer  # noqa: E402

ans = load_answer(__file__)

# Two H100 runs, in ms: the forward (notebook 08, section 5; bf16, d = 128, H = 16, B = 16384 / N: 2048 tiles of
# B_r = 128, 16 rounds, key blocks of 128) and decoding (notebook 09, section 7; fp16, B = 32, H_kv = 32, one split,
# 8 rounds, key blocks of 64). The first two lengths are fitted, the third predicted.
RUNS = {
    "forward": dict(rounds=16, block=128, lengths=(4096, 16384, 1024),
                    ms={"hopper": {1024: 0.2737, 4096: 0.9447, 16384: 3.6043},
                        "cuDNN": {1024: 0.2284, 4096: 0.9055, 16384: 3.5596}}),
    "decode": dict(rounds=8, block=64, lengths=(4096, 32768, 131072),
                   ms={"ours": {4096: 0.71744, 32768: 5.50832, 131072: 22.02264},
                       "SDPA": {4096: 0.70835, 32768: 5.58592, 131072: 22.12749}}),
}
FLOP_PER_BLOCK = 4 * 128 * 128 * 128


def ceil_div(a, b):
    return -(-a // b)


def reference_fit(T_c1, ms1, T_c2, ms2, n):
    t1, t2 = 1000 * ms1 / n, 1000 * ms2 / n
    y = (t2 - t1) / (T_c2 - T_c1)
    return t1 - y * T_c1, y


def reference_splits(units, T_c, slots, fixed=2, max_splits=128, tie_larger=False, floor_rounds=False, upto=None):
    waves = (lambda a: a // slots) if floor_rounds else (lambda a: ceil_div(a, slots))
    cost = lambda S: waves(units * S) * (ceil_div(T_c, S) + fixed)
    best = 1
    for S in range(2, (upto if upto is not None else min(T_c // 2, max_splits)) + 1):
        if cost(S) < cost(best) or (tie_larger and cost(S) == cost(best)):
            best = S
    return best


def test_rounds():
    cases = [(2048, 132), (132, 132), (133, 132), (1, 132), (1024, 132), (0, 132), (512, 264)]
    for tiles, slots in cases:
        got, expected = ans.rounds(tiles, slots), ceil_div(tiles, slots)
        if got == expected and isinstance(got, int):
            continue
        hints = []
        if got == tiles // slots:
            hints.append("rounded down: a partly full last round still takes a whole tile's time")
        if isinstance(got, float):
            hints.append("a float: tiles / slots is the number of full rounds' worth of work, not of rounds")
        raise AssertionError(f"rounds({tiles}, {slots}): expected {expected}, got {got!r}. " + " ".join(hints))


def launches(run):
    """(system, the arguments of fit_tile_cost, T_c of the third length, its measured ms) for each system of a run."""
    r = RUNS[run]
    first, second, third = r["lengths"]
    for system, ms in r["ms"].items():
        yield system, (first // r["block"], ms[first], second // r["block"], ms[second], r["rounds"]), \
            third // r["block"], ms[third]


@pytest.mark.parametrize("run", RUNS)
def test_fit_on_the_measured_runs(run):
    for system, args, _, _ in launches(run):
        n_rounds = args[4]
        x, y = reference_fit(*args)
        got = ans.fit_tile_cost(*args)
        if isinstance(got, tuple) and len(got) == 2 and close(got[0], x) and close(got[1], y):
            continue
        hints = []
        if isinstance(got, tuple) and len(got) == 2:
            gx, gy = got
            if close(gx, y) and close(gy, x):
                hints.append("x and y swapped: return (x_us, y_us)")
            if close(gx, x * n_rounds) and close(gy, y * n_rounds):
                hints.append(f"not divided by the {n_rounds} rounds: x and y are one tile's costs")
            if close(gx, x / 1000) and close(gy, y / 1000):
                hints.append("in milliseconds: x and y are wanted in microseconds")
            if close(gy, 1000 * args[3] / n_rounds / args[2]):
                hints.append("y from one launch alone (t / T_c) counts the fixed cost into y: use the difference")
        raise AssertionError(f"{run}, {system}: fit_tile_cost{args}: expected (x, y) = ({x:.4f}, {y:.4f}) us, "
                             f"got {got!r}. " + " ".join(hints))


@pytest.mark.parametrize("run", RUNS)
def test_prediction_of_the_third_length(run):
    for system, args, T_c, measured in launches(run):
        n_rounds = args[4]
        x, y = reference_fit(*args)
        expected = n_rounds * (x + y * T_c) / 1000
        got = ans.predict_ms(x, y, T_c, n_rounds)
        hints = []
        if close(got, expected / n_rounds):
            hints.append("one round only: multiply by the rounds")
        if close(got, expected * 1000):
            hints.append("in microseconds: predict_ms returns milliseconds")
        assert close(got, expected), (f"{run}, {system}: predict_ms({x:.4f}, {y:.4f}, {T_c}, {n_rounds}): expected "
                                      f"{expected:.6f} ms, got {got!r}. " + " ".join(hints))
        assert abs(expected / measured - 1) < 0.06  # and the model agrees with the third length within 6 %


def test_steady_rate():
    for y, work, slots in [(1.732, FLOP_PER_BLOCK, 132), (1.337, 2 * 64 * 128 * 2, 132), (2.0, 1e6, 108)]:
        expected, got = slots * work / (y * 1e-6), ans.steady_rate(y, work, slots)
        hints = []
        if close(got, work / (y * 1e-6)):
            hints.append("one SM's rate: every one of the slots streams at once")
        if close(got, slots * work / y):
            hints.append("per microsecond: the rate is per second")
        assert close(got, expected), f"steady_rate({y}, {work:g}, {slots}): expected {expected:.6g}, got {got!r}. " + \
            " ".join(hints)
    x, y = reference_fit(*next(launches("forward"))[1])  # our forward's
    assert 630e12 < ans.steady_rate(y, FLOP_PER_BLOCK, 132) < 645e12  # FlashAttention-3's 638-648 TFLOP/s


def test_fixed_share():
    for x, y, T_c in [(3.6, 1.732, 32), (1.3, 1.728, 32), (4.1, 1.337, 64), (4.1, 1.337, 2048)]:
        expected, got = x / (x + y * T_c), ans.fixed_share(x, y, T_c)
        hints = []
        if close(got, x / (y * T_c)):
            hints.append("a ratio to the streaming time: the share is of the whole tile's time x + y T_c")
        if close(got, 1 - expected):
            hints.append("the streaming share: the fixed one is x / (x + y T_c)")
        assert close(got, expected), f"fixed_share({x}, {y}, {T_c}): expected {expected:.6f}, got {got!r}. " + \
            " ".join(hints)


def test_best_splits_matches_the_launcher():
    rng = random.Random(11)
    shapes = [(8, 64, 132), (1024, 64, 132), (1024, 2048, 132), (256, 64, 132), (32, 512, 132), (1, 2, 132),
              (1, 3, 132), (5, 1, 132), (64, 64, 132)]
    shapes += [(rng.randint(1, 2048), rng.randint(1, 4096), rng.choice([108, 132, 264])) for _ in range(600)]
    for units, T_c, slots in shapes:
        expected, got = reference_splits(units, T_c, slots), ans.best_splits(units, T_c, slots)
        if got == expected:
            continue
        hints = []
        if got == reference_splits(units, T_c, slots, tie_larger=True):
            hints.append("on a tie the launcher keeps the smaller split count (a strict <)")
        if got == reference_splits(units, T_c, slots, floor_rounds=True):
            hints.append("rounds rounded down: a partly full last round costs a whole round")
        if got == reference_splits(units, T_c, slots, upto=min(T_c, 128)):
            hints.append("splits up to T_c: each part keeps two key blocks at least (S <= T_c // 2)")
        if got == reference_splits(units, T_c, slots, fixed=0):
            hints.append("the fixed cost of a part is left out: use the `fixed` argument")
        raise AssertionError(f"best_splits({units}, {T_c}, {slots}): expected {expected}, got {got!r}. " +
                             " ".join(hints))
    assert ans.best_splits(8, 64, 132, fixed=5) == reference_splits(8, 64, 132, fixed=5), "`fixed` is not used"
