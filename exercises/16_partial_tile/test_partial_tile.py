"""Grader for exercise 16: python exercises/grade.py 16

The tiles are the hopper forward's at d <= 64 and the fp8 forward's (B_r = 192: three consumers of 64 rows, B_c =
128) and the hopper forward's at d = 128 (B_r = 128); Mask::first_row in flash.cu moves them. Notebook 08 (section 5)
counts the same blocks and measured what the move gained on an H200.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)


def expect(call, got, expected, hints):
    if got == expected and not isinstance(got, bool):
        return
    said = [h for h, wrong in hints if wrong is not None and got == wrong]
    raise AssertionError(f"{call}: expected {expected}, got {got!r}. " + " ".join(said))


def test_first_row():
    for i, N, B_r, causal in [(0, 4096, 192, True), (21, 4096, 192, True), (0, 4096, 192, False), (21, 4096, 192, False),
                              (0, 2500, 192, True), (13, 2500, 192, True), (0, 1025, 192, True), (0, 1000, 128, True),
                              (2, 300, 128, True), (0, 4096, 128, True), (5, 16384, 192, True)]:
        extra = -(-N // B_r) * B_r - N
        shift = extra // 64 * 64 if causal else 0
        expect(f"first_row({i}, {N}, {B_r}, causal={causal})", ans.first_row(i, N, B_r, causal), i * B_r - shift,
               [("Move the tiles by whole 64-row slabs, not by the exact surplus: a consumer's slab must be all padding "
                 "or all rows.", i * B_r - extra if causal and extra % 64 else None),
                ("Without a mask every tile reads every key block: there is nothing to gain, the tiles start at row 0.",
                 i * B_r - extra // 64 * 64 if not causal and extra >= 64 else None),
                ("Up, not down: the partial tile should be tile 0, so the tiles start before row 0.",
                 i * B_r + shift if shift else None)])


def test_key_blocks_read():
    for row0, B_r, N, B_c, causal in [(-128, 192, 4096, 128, True), (3904, 192, 4096, 128, True),
                                      (4032, 192, 4096, 128, True), (0, 192, 4096, 128, False),
                                      (0, 64, 100, 128, True), (64, 64, 200, 128, True), (128, 64, 200, 128, True),
                                      (-64, 128, 300, 128, True), (192, 128, 300, 128, True), (0, 192, 1, 128, True)]:
        last = min(N, row0 + B_r) - 1
        expected = last // B_c + 1 if causal else -(-N // B_c)
        expect(f"key_blocks_read({row0}, {B_r}, {N}, {B_c}, causal={causal})",
               ans.key_blocks_read(row0, B_r, N, B_c, causal), expected,
               [("Rows at or past N do not exist: the last tile from row 0 reads up to key N - 1, not row0 + B_r - 1.",
                 (row0 + B_r - 1) // B_c + 1 if causal and row0 + B_r > N else None),
                ("Count the block that holds the last key too: key k is in block k // B_c, and blocks 0 .. k // B_c are "
                 "k // B_c + 1 blocks.", last // B_c if causal else None),
                ("Under a causal mask a tile reads only the blocks up to its last row's key.",
                 -(-N // B_c) if causal else None)])


def test_consumer_blocks():
    for N, B_r, B_c, causal, expected in [(4096, 192, 128, True, 1089), (4096, 192, 128, False, 2112),
                                          (16384, 192, 128, True, 16641), (4096, 128, 128, True, 1056),
                                          (2500, 192, 128, True, 441), (1000, 128, 128, True, 72)]:
        consumers = B_r // 64
        expect(f"consumer_blocks({N}, {B_r}, {B_c}, causal={causal})", ans.consumer_blocks(N, B_r, B_c, causal),
               expected,
               [("Every one of a tile's B_r / 64 consumers runs the tile's key blocks: multiply by them.",
                 expected // consumers if consumers > 1 else None),
                ("Under a causal mask use first_row: the tiles are moved.",
                 sum(consumers * ((min(N, (i + 1) * B_r) - 1) // B_c + 1) for i in range(-(-N // B_r)))
                 if causal and (-(-N // B_r) * B_r - N) >= 64 else None)])


def test_blocks_saved():
    for N, B_r, expected in [(4096, 192, 1152 / 1089), (16384, 192, 16896 / 16641), (4096, 128, 1.0),
                             (2500, 192, 480 / 441), (1025, 192, 99 / 90)]:
        got = ans.blocks_saved(N, B_r, 128)
        assert isinstance(got, float) or isinstance(got, int), f"blocks_saved({N}, {B_r}, 128) should be a number"
        if abs(got - 1 / expected) < 1e-9 and expected != 1.0:
            raise AssertionError(f"blocks_saved({N}, {B_r}, 128): expected {expected:.4f}, got {got:.4f}: the blocks "
                                 "from row 0 over the blocks moved, not the other way (a speedup above 1)")
        assert abs(got - expected) < 1e-9, f"blocks_saved({N}, {B_r}, 128): expected {expected:.4f}, got {got!r}"


def test_against_the_kernel():
    """The model against the hopper forward on an H200 (bf16, d = 64, B * N = 16384, H = 32, causal; the kernel with
    and without Mask::first_row, two runs each): notebook 08, section 5."""
    measured = {4096: (1.049, 1.056), 16384: (1.018, 1.046)}
    for N, (low, high) in measured.items():
        predicted = ans.blocks_saved(N, 192, 128)
        assert low - 0.01 <= predicted <= high + 0.01, \
            f"N = {N}: the model predicts {predicted:.3f}x, the kernel measured {low}-{high}x"
    assert ans.blocks_saved(4096, 128, 128) == 1.0, "B_r = 128 at N = 4096: no partial tile, nothing moves"
