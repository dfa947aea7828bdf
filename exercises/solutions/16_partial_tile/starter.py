"""Exercise 16: where a head's partial query tile goes (notebook 08, section 5, "The partial tile first"). Fill in
the four TODOs.

One head has N queries and N keys (N_q = N_k), split into query tiles of B_r rows and key blocks of B_c keys. A tile
is run by B_r / 64 consumer warpgroups, each owning 64 of its rows, and every consumer runs every key block its tile
reads. Under a causal mask query r sees keys 0 .. r, so a tile reads the key blocks up to the one that holds its last
row's key. When N is not a multiple of B_r, one tile is partial.
"""
SLAB = 64  # the rows of one consumer warpgroup


def first_row(i, N, B_r, causal):
    """The first row of query tile i (0 <= i < ceil(N / B_r)). Without a mask the tiles start at row 0. Under a causal
    mask they are moved up by as many whole SLABs as fit in the rows the tiles have too many, ceil(N / B_r) * B_r - N,
    so that the partial tile is tile 0 (its rows before row 0 are padding)."""
    extra = -(-N // B_r) * B_r - N
    return i * B_r - (extra // SLAB * SLAB if causal else 0)


def key_blocks_read(row0, B_r, N, B_c, causal):
    """How many key blocks the tile of rows row0 .. row0 + B_r - 1 reads: all ceil(N / B_c) without a mask; under a
    causal mask the blocks 0 .. the one holding key min(N, row0 + B_r) - 1 (rows at or past N do not exist)."""
    if not causal:
        return -(-N // B_c)
    return (min(N, row0 + B_r) - 1) // B_c + 1


def consumer_blocks(N, B_r, B_c, causal):
    """The key blocks all consumers of one head run: over the tiles, B_r / SLAB consumers times the blocks their tile
    reads (padding and rows past N included: a consumer runs its tile's blocks whatever rows it has)."""
    return sum(B_r // SLAB * key_blocks_read(first_row(i, N, B_r, causal), B_r, N, B_c, causal)
               for i in range(-(-N // B_r)))


def blocks_saved(N, B_r, B_c):
    """How many times fewer consumer blocks a causal head runs with its tiles moved (first_row) than with its tiles
    from row 0: the speedup this model predicts."""
    from_row_0 = sum(B_r // SLAB * key_blocks_read(i * B_r, B_r, N, B_c, True) for i in range(-(-N // B_r)))
    return from_row_0 / consumer_blocks(N, B_r, B_c, True)
