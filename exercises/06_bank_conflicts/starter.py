"""Exercise 06: shared-memory bank conflicts, counted. Fill in the TODOs.

The model (NVIDIA GPUs since Maxwell; notebook 06, section 7):
  - shared memory has 32 banks of 4 bytes: byte address a is in bank (a // 4) % 32;
  - a warp-wide access of `width` bytes per thread (4, 8 or 16) is served in phases of 128 bytes:
    width 4: one phase of all 32 threads; width 8: two phases of 16 threads (0-15, 16-31);
    width 16: four phases of 8 threads (0-7, 8-15, ...). ldmatrix reads each 8 x 8 matrix (8 rows of
    16 bytes, one address per row) as one phase of 8 addresses of width 16;
  - in a phase, each thread touches width // 4 consecutive 4-byte words starting at its address. A bank
    serves one word per cycle; several threads reading the same word are served together (broadcast).
    The phase takes as many cycles as the largest number of *distinct* words that one bank must supply;
  - the conflict degree of the access is that number for its worst phase: 1 means conflict-free.
Addresses are byte addresses, one per thread in thread order (a list of up to 32 ints), aligned to width.
"""


def bank(address):
    """The bank (0..31) of a byte address."""
    # TODO 1
    raise NotImplementedError("TODO 1: bank")


def conflict_degree(addresses, width=4):
    """The conflict degree of one access, by the model above."""
    # TODO 2: split into phases of 128 // width threads; per phase, per bank, count distinct words.
    raise NotImplementedError("TODO 2: conflict_degree")


def ldmatrix_row_addresses(row_stride_halfs, col_halfs=0):
    """The 8 byte addresses ldmatrix gets for one 8 x 8 matrix of a row-major fp16 tile that starts at
    address 0: rows 0..7, starting at column col_halfs; rows are row_stride_halfs 16-bit values apart."""
    # TODO 3
    raise NotImplementedError("TODO 3: ldmatrix_row_addresses")


def float4_column_addresses(ld_floats, k=0):
    """thread_tile_XYt in flash.cu: the 16 threads tx = 0..15 of a half-warp each read a float4 (16 bytes) of
    B[(tx + 16*n) * ld + k] (n = 0 here) from a row-major fp32 tile at address 0 with row stride ld."""
    # TODO 4
    raise NotImplementedError("TODO 4: float4_column_addresses")


def smallest_padding(row_stride_halfs):
    """The smallest padding p >= 0 in 16-bit values, a multiple of 8 (ldmatrix rows must stay 16-byte
    aligned), such that ldmatrix on a tile with row stride row_stride_halfs + p is conflict-free."""
    # TODO 5: use your functions above.
    raise NotImplementedError("TODO 5: smallest_padding")
