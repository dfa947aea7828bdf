"""Exercise 08: predict from a roofline. Fill in the TODOs; README.md gives the counting rules.

Units: peak_tflops in TFLOP/s (1e12 FLOP/s), bandwidth in bytes/s, times in seconds, b = bytes per
element of Q, K, V, O, S and P (2 for fp16/bf16, 4 for fp32).
"""


def attention_flops(B, H, N, d, causal=False):
    """The standard forward count: 4 B H N^2 d (two products of 2 N^2 d per head), halved when causal."""
    # TODO 1
    raise NotImplementedError("TODO 1: attention_flops")


def bound_time(flops, bytes_moved, peak_tflops, bandwidth):
    """(seconds, 'compute' or 'memory'): the roofline's lower bound on the time of one kernel, and which
    ceiling sets it (on a tie, 'compute')."""
    # TODO 2
    raise NotImplementedError("TODO 2: bound_time")


def softmax_pass(B, H, N, b, peak_tflops, bandwidth):
    """Manual attention's softmax kernel P = softmax(S): (flops, bytes, seconds, bound)."""
    # TODO 3: S is read once and P written once, N x N per head; 5 FLOPs per element.
    raise NotImplementedError("TODO 3: softmax_pass")


def fused_forward(B, H, N, d, b, peak_tflops, bandwidth, causal=False):
    """A fused FlashAttention forward: (flops, bytes, seconds, bound)."""
    # TODO 4: Q, K, V read once, O written once (b bytes each), L written once in fp32 (4 bytes a row).
    raise NotImplementedError("TODO 4: fused_forward")


def manual_forward(B, H, N, d, b, peak_tflops, bandwidth):
    """Manual attention, four kernels one after the other (non-causal): the sum of their four bound
    times, in seconds. Kernels: S = Q K^T; S = S * scale; P = softmax(S); O = P V (README.md)."""
    # TODO 5
    raise NotImplementedError("TODO 5: manual_forward")


def predicted_speedup(B, H, N, d, b, peak_tflops, bandwidth):
    """How many times faster the fused forward can be than manual attention, by the two bounds."""
    return manual_forward(B, H, N, d, b, peak_tflops, bandwidth) / fused_forward(B, H, N, d, b, peak_tflops, bandwidth)[2]
