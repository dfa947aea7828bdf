"""Exercise 13: which unit of an SM sets a kernel's pace (notebook 11, section 7). Fill in the five TODOs.

A step of the Hopper forward kernels is one (query tile, key block) pair: S_ij = Q_i K_j^T (B_r x B_c, summed over d)
and O_i += P_ij V_j (B_r x d, summed over B_c) on the tensor cores, and one exponential per entry of P_ij on the
SM's MUFU unit. Cycles are SM clock cycles; rates are per SM and per clock.
"""
import math

H100 = dict(sms=132, fma_per_clock={"fp16": 2048, "fp8": 4096}, ex2_per_clock=16)  # dense rates of one H100 SM


def tensor_cycles(B_r, B_c, d, fma_per_clock):
    """The fewest cycles one SM's tensor cores need for one step: both products, at fma_per_clock multiply-adds per
    clock."""
    raise NotImplementedError("TODO: the multiply-adds of both products, over the rate")


def exp_cycles(B_r, B_c, ex2_per_clock):
    """The fewest cycles the step's exponentials need: one per entry of P_ij, ex2_per_clock per clock."""
    raise NotImplementedError("TODO: the exponentials over the rate")


def cycles_per_step(time_us, clock_ghz, steps, sms):
    """The cycles one step took on one SM: a launch of time_us microseconds at clock_ghz, whose `steps` steps were
    shared evenly by `sms` SMs."""
    raise NotImplementedError("TODO: the launch's cycles on one SM, over the steps that SM ran")


def products_only_speedup(products_share, faster):
    """The whole step's speedup if the products, products_share of its time, run `faster` times as fast and nothing
    else changes or overlaps (Amdahl's law)."""
    raise NotImplementedError("TODO: Amdahl's law")


def reduction_depth(n, tree):
    """The dependent steps in the maximum of n >= 1 values taken with a two-input max: one value after another
    (tree=False, as a loop `m = max(m, x[k])` starting from x[0]), or in pairs, then pairs of pairs (tree=True)."""
    raise NotImplementedError("TODO: the depth of a chain and of a tree")
