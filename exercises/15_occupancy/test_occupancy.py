"""Grader for exercise 15: python exercises/grade.py 15

The kernels' registers and shared memory are those ptxas reports for flash.cu on sm_90a (CI prints them) and those
the launchers in flash.cu ask for; notebook 07 (section 4) and notebook 08 (section 5) measured what they cost.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import load_answer  # noqa: E402

ans = load_answer(__file__)

KB = 1024
# flash_fwd_fp32's shared memory (its launcher fwd_fp32): 4 * (B_r (d + 4) + B_c max(d + 4, B_r + 4) + B_c d)
FP32_FWD_SMEM = {64: 4 * (64 * 68 + 64 * 68 + 64 * 64), 128: 4 * (64 * 132 + 32 * 132 + 32 * 128)}
# FwdTiles<d, NWG, B_c = 128, STAGES = 3>::bytes: Q_i, three stages of K_j and V_j, the mbarriers, 1 KB of slack
HOPPER_FWD_SMEM = {(64, 1): 8192 + 6 * 16384 + 104 + 1024, (128, 2): 32768 + 6 * 32768 + 104 + 1024}


def expect(call, got, expected, hints):
    if got == expected and not isinstance(got, bool):
        return
    said = [h for h, wrong in hints if got == wrong]
    raise AssertionError(f"{call}: expected {expected}, got {got!r}. " + " ".join(said))


def test_registers_per_warp():
    for regs in (1, 8, 24, 128, 166, 168, 169, 232, 255):
        expected = -(-regs // 8) * 8 * 32
        expect(f"registers_per_warp({regs})", ans.registers_per_warp(regs), expected,
               [("Rounded to a multiple of 8 per thread first: registers are handed out in steps of 8 a thread "
                 "(256 a warp).", regs * 32),
                ("That is one thread's share: a warp has 32 threads.", -(-regs // 8) * 8),
                ("Rounded down, not up: a thread that needs 169 registers cannot use 168.", regs // 8 * 8 * 32)])


def test_blocks_by_registers():
    for regs, threads, gpu, expected in [(166, 128, "H100", 3), (168, 128, "H100", 3), (169, 128, "H100", 2),
                                         (128, 128, "H100", 4), (196, 128, "H100", 2), (128, 256, "H100", 2),
                                         (168, 384, "H100", 1), (255, 128, "A100", 2), (41, 100, "T4", 10)]:
        expect(f"blocks_by_registers({regs}, {threads}, {gpu!r})", ans.blocks_by_registers(regs, threads, gpu),
               expected,
               [("Round each thread's registers up to a multiple of 8 (registers_per_warp).", 65536 // (regs * threads)),
                ("Count whole warps: a block of 100 threads takes 4 warps.", 65536 // (threads * -(-regs // 8) * 8)
                 if threads % 32 else None)])


def test_blocks_by_shared_memory():
    cases = [(FP32_FWD_SMEM[64], "H100", 4), (FP32_FWD_SMEM[128], "H100", 3), (FP32_FWD_SMEM[64], "A100", 3),
             (FP32_FWD_SMEM[128], "A100", 2), (FP32_FWD_SMEM[64], "T4", 1), (FP32_FWD_SMEM[128], "T4", 0),
             (HOPPER_FWD_SMEM[64, 1], "H100", 2), (HOPPER_FWD_SMEM[128, 2], "H100", 1),
             (HOPPER_FWD_SMEM[128, 2], "A100", 0), (57 * KB, "H100", 3), (0, "V100", None)]
    for smem, gpu, expected in cases:
        got = ans.blocks_by_shared_memory(smem, gpu)
        if expected is None:  # no shared memory at all: not the limit
            assert got == 32 and not isinstance(got, bool), f"blocks_by_shared_memory(0, 'V100'): expected 32, the " \
                f"SM's max_blocks (blocks that take no shared memory are not limited by it), got {got!r}"
            continue
        expect(f"blocks_by_shared_memory({smem}, {gpu!r})", got, expected,
               [("Each block also takes the SM's reserved bytes (1 KB on an A100 or H100).",
                 {"H100": 228 * KB, "A100": 164 * KB}.get(gpu, 0) // smem if gpu in ("H100", "A100") else None)])


def test_blocks_per_sm():
    for regs, threads, smem, gpu, expected, why in [
            (128, 128, FP32_FWD_SMEM[64], "H100", 4, "the fp32 forward at d = 64 as it was: registers and shared memory"),
            (166, 128, FP32_FWD_SMEM[64], "H100", 3, "the fp32 forward at d = 64 now: registers"),
            (196, 128, FP32_FWD_SMEM[128], "H100", 2, "the fp32 forward at d = 128 before its bounds: registers"),
            (166, 128, FP32_FWD_SMEM[64], "T4", 1, "the same on a T4: shared memory"),
            (128, 256, HOPPER_FWD_SMEM[64, 1], "H100", 2, "the hopper forward with one consumer"),
            (168, 384, HOPPER_FWD_SMEM[128, 2], "H100", 1, "the hopper forward with two consumers"),
            (32, 256, 0, "T4", 4, "a small kernel on a T4: threads"),
            (16, 32, 0, "H100", 32, "a tiny kernel: the SM's count of blocks")]:
        expect(f"blocks_per_sm({regs}, {threads}, {smem}, {gpu!r}) ({why})", ans.blocks_per_sm(regs, threads, smem, gpu),
               expected, [])


def test_register_cap():
    for threads, blocks, expected in [(128, 3, 168), (256, 2, 128), (384, 1, 168), (512, 1, 128), (128, 4, 128),
                                      (128, 2, 255), (128, 1, 255), (100, 5, 96)]:
        warps = -(-threads // 32)
        expect(f"register_cap({threads}, {blocks}, 'H100')", ans.register_cap(threads, blocks, "H100"), expected,
               [("Capped at 255: a thread addresses at most 255 registers.", 65536 // (blocks * warps * 32 * 8) * 8),
                ("Rounded down to a multiple of 8: the allocation's step.", min(255, 65536 // (blocks * threads))),
                ("Count whole warps of 32 threads.", min(255, 65536 // (blocks * threads * 8) * 8) if threads % 32
                 else None)])


def test_the_repository_kernels():
    """What the kernels in flash.cu declare, and what ptxas gave them on sm_90a."""
    # flash_fwd_fp32: __launch_bounds__(128, d <= 160 ? 3 : 1); ptxas: 166 registers at d = 64
    cap = ans.register_cap(128, 3, "H100")
    assert cap >= 166 and ans.blocks_per_sm(166, 128, FP32_FWD_SMEM[64], "H100") == 3, \
        "the fp32 forward at d = 64: 166 registers fit under __launch_bounds__(128, 3), 3 blocks an SM"
    # four blocks would need the kernel in 128 registers: ptxas then spilled 124 bytes (notebook 07, section 4)
    assert ans.register_cap(128, 4, "H100") < 166 <= cap, "four blocks of 128 threads leave 128 registers a thread"
    # flash_fwd_hopper with one consumer: __launch_bounds__(256, 2); its producer gives all but 24 of its 128 back
    # (setmaxnreg.dec), and the consumer takes them (setmaxnreg.inc to 232): the block still fits half the file
    launch = ans.register_cap(256, 2, "H100")
    assert launch == 128 and 128 * 24 + 128 * 232 <= ans.GPUS["H100"]["register_file"] // 2, \
        "the one-consumer hopper block: 128 registers at launch, then 24 (producer) and 232 (consumer)"
    assert ans.blocks_per_sm(launch, 256, HOPPER_FWD_SMEM[64, 1], "H100") == 2, "two one-consumer blocks an SM"
