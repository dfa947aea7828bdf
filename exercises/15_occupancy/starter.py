"""Exercise 15: how many blocks share an SM, and what __launch_bounds__ asks of ptxas (notebook 04, notebook 07
section 4, notebook 08 section 5). Fill in the five TODOs.

An SM holds a block only if it has room for all of it at once: registers for every thread, the block's shared
memory, and a place among the SM's threads and blocks. Registers are allocated per warp: each thread's count
rounded up to a multiple of 8, times 32 threads. Shared memory per block is at most smem_per_block, and each block
also takes `reserved` bytes of the SM's smem_per_sm for the system.
"""
KB = 1024
GPUS = {  # per SM; smem_per_block: the most one block may ask for
    "V100": dict(register_file=65536, smem_per_sm=96 * KB, smem_per_block=96 * KB, reserved=0, max_threads=2048,
                 max_blocks=32),
    "T4": dict(register_file=65536, smem_per_sm=64 * KB, smem_per_block=64 * KB, reserved=0, max_threads=1024,
               max_blocks=16),
    "A100": dict(register_file=65536, smem_per_sm=164 * KB, smem_per_block=163 * KB, reserved=1 * KB,
                 max_threads=2048, max_blocks=32),
    "H100": dict(register_file=65536, smem_per_sm=228 * KB, smem_per_block=227 * KB, reserved=1 * KB,
                 max_threads=2048, max_blocks=32),
}


def registers_per_warp(regs_per_thread):
    """The registers a warp is given for a kernel that uses regs_per_thread (1 to 255) per thread."""
    raise NotImplementedError("TODO: round up to a multiple of 8, for 32 threads")


def blocks_by_registers(regs_per_thread, threads, gpu):
    """How many blocks of `threads` threads the SM's register file holds at once."""
    raise NotImplementedError("TODO: the register file over what one block's warps take")


def blocks_by_shared_memory(smem_bytes, gpu):
    """How many blocks asking for smem_bytes of shared memory the SM holds at once (0 if not even one; on these GPUs
    that is exactly when a block asks for more than smem_per_block); max_blocks if the blocks take none at all (no
    shared memory and nothing reserved)."""
    raise NotImplementedError("TODO: the SM's shared memory over a block's, with its reserved bytes")


def blocks_per_sm(regs_per_thread, threads, smem_bytes, gpu):
    """How many blocks the SM holds at once: the least of what its registers, its shared memory, its threads and
    its count of blocks allow."""
    raise NotImplementedError("TODO: the least of the four limits")


def register_cap(threads, min_blocks, gpu):
    """The most registers per thread ptxas may give a kernel declared __launch_bounds__(threads, min_blocks): the
    largest count with which min_blocks blocks still fit in the register file, a multiple of 8 (the allocation's
    step) but never above 255, the most a thread can address."""
    raise NotImplementedError("TODO: the inverse of blocks_by_registers")
