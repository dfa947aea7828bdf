"""Exercise 05: the fragment layout of mma.sync.aligned.m16n8k16 (fp16/bf16 in, fp32 out). Fill in the TODOs.

    D (16 x 8, fp32) += A (16 x 16, row-major) * B (16 x 8, column-major)      one warp, 32 lanes

Each lane holds 4 registers of A, 2 of B (two 16-bit values per 32-bit register: `half` 0 is the low
16 bits, half 1 the high 16 bits) and 4 registers of D (one fp32 value each). The rules are in the PTX
ISA ("Matrix Fragments for mma.m16n8k16 with floating point type") and notebook 06; write them as functions. Rows and
columns count from 0; for B, row is k (0..15) and column is n (0..7).
"""


def a_frag(lane, reg, half):
    """(row, col) of A held by `lane` (0..31) in register `reg` (0..3), 16-bit half `half` (0 or 1)."""
    # TODO 1
    raise NotImplementedError("TODO 1: a_frag")


def b_frag(lane, reg, half):
    """(k, n) of B held by `lane` in register `reg` (0..1), half `half`."""
    # TODO 2
    raise NotImplementedError("TODO 2: b_frag")


def d_frag(lane, reg):
    """(row, col) of the accumulator C/D held by `lane` in register `reg` (0..3)."""
    # TODO 3
    raise NotImplementedError("TODO 3: d_frag")


def a_owner(row, col):
    """The inverse of a_frag: (lane, reg, half) that holds A[row][col]. Useful when you must know which
    thread to ask for an element, for example when writing P_ij to shared memory by hand."""
    # TODO 4: without searching over all lanes.
    raise NotImplementedError("TODO 4: a_owner")
