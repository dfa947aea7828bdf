"""Exercise 17: a TMA box of whole rows (notebook 09, section 7, "One copy a tile"). Fill in the four TODOs.

A decoding block copies K_j, a tile of ROWS = 64 keys by d fp16 columns (a row is 2 d bytes, in memory one after the
other), into shared memory by TMA with the 128-byte swizzle. Under that swizzle a box's innermost dimension holds at
most 128 bytes, 64 fp16 values: a panel. There are two ways to copy the tile:
- panels: one box of (64 rows, 64 columns) per 64-column panel, ceil(d / 64) copies, panel c at byte c * ROWS * 128
  of the tile (the last panel half empty at d = 96 or 160: TMA fills the columns past d with zeros);
- whole rows (d a multiple of 64): the same memory described as (N, d / 64, 64), the panels of a row a dimension of
  their own, and one box of (64 rows, d / 64 panels, 64 columns). TMA stores a box's elements innermost first, so the
  tile holds row after row, each row its d / 64 panels.
Shared memory is counted in 128-byte lines. The swizzle stores 16-byte piece c (0..7) of line l at piece c ^ (l % 8)
of that line.
"""
ROWS, LINE, PIECE = 64, 128, 16  # keys in a tile; bytes in a line and in a piece (8 fp16)


def copies_per_tile(d, whole_rows):
    """TMA copies (boxes) that bring one tile. Whole rows need d to be a multiple of 64: raise ValueError otherwise."""
    if whole_rows and d % 64:
        raise ValueError(f"whole rows need d to be a multiple of 64, not {d}")
    return 1 if whole_rows else -(-d // 64)


def line(row, p, d, whole_rows):
    """The 128-byte line of the tile that holds 16-byte piece p (columns 8p .. 8p + 7) of key `row`."""
    panel = p // 8
    return row * (d // 64) + panel if whole_rows else panel * ROWS + row


def offset(row, p, d, whole_rows):
    """The byte of the tile where that piece starts, swizzled."""
    l = line(row, p, d, whole_rows)
    return l * LINE + ((p % 8) ^ (l % 8)) * PIECE


def ldmatrix_conflict(d, whole_rows):
    """ldmatrix reads piece p of 8 consecutive rows r0 .. r0 + 7 (r0 a multiple of 8) in one pass when the 8 pieces
    sit in 8 different groups of 4 banks; a piece's group is its offset % 128 // 16. The read takes as many passes as
    the most of those rows in one group. Return the most, over every piece p < d / 8 and every r0."""
    worst = 1
    for r0 in range(0, ROWS, 8):
        for p in range(d // 8):
            groups = [offset(r0 + r, p, d, whole_rows) % LINE // PIECE for r in range(8)]
            worst = max(worst, max(groups.count(g) for g in groups))
    return worst
