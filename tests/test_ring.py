"""ring.py: ring attention over W processes equals attention in one process.

CPU: for each world size W = 1..4, one spawn of W processes joined by gloo runs every case (causal on and off,
balanced and contiguous chunks, grouped-query attention, chunks of 5 and 13 tokens, two scales) in float64 with
reference.py's loops, and sends its shards back; here they are put together and compared with dense attention and
autograd (random dO): O, L, dQ, dK, dV to 1e-10. A process that raises fails the test (ring.launch raises).
GPU (skipped, visibly, without one): the kernels at W = 1 against float64, with test_kernels.py's rule (at most
3x the error of PyTorch's SDPA in the same dtype); with two GPUs, a 2-process NCCL ring the same way.
"""
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

import main
import reference
import ring

B, H_q, d = 2, 4, 8
# (causal, balanced, H_kv, tokens per chunk): every combination; H_kv = 2 is grouped-query attention
CASES = [(causal, balanced, H_kv, n_c) for causal in (False, True) for balanced in (True, False)
         for H_kv in (4, 2) for n_c in (5, 13)]
NAMES = ("O", "L", "dQ", "dK", "dV")


def scale_of(H_kv):
    return 0.3 if H_kv == 2 else None  # a scale that is not 1/sqrt(d) in half the cases, so a lost one shows


def full_inputs(world, balanced, H_kv, n_c, seed, dtype=torch.float64, heads=H_q, dim=d):
    """The whole sequence's q, k, v, dO (B, H, N, d), N = n_c tokens per chunk times the chunks."""
    N = n_c * (2 * world if balanced else world)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dO = (torch.randn(B, h, N, dim, generator=g, dtype=torch.float64) for h in (heads, H_kv, H_kv, heads))
    return [x.to(dtype) for x in (q, k, v, dO)]


def dense(q, k, v, dO, causal, scale):
    """[O, L, dQ, dK, dV] of single-process attention: reference.attention and autograd, L from the whole matrix."""
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
    O = reference.attention(q_, k_, v_, causal, scale)
    S = q @ reference._query_heads(k, q).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)   # (B, H_q, N, N)
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).triu(1), -math.inf)
    return [O.detach(), torch.logsumexp(S, dim=-1), *torch.autograd.grad(O, (q_, k_, v_), dO)]


def run_cases(world, cases, dtype=torch.float64, device="cpu", heads=H_q, dim=d):
    """On every rank of the ring: its shards of [O, L, dQ, dK, dV] for each case (returned to the CPU)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for seed, (causal, balanced, H_kv, n_c) in enumerate(cases):
        parts = [ring.shard(x, rank, world, balanced).to(device)
                 for x in full_inputs(world, balanced, H_kv, n_c, seed, dtype, heads, dim)]
        q, k, v = (x.requires_grad_() for x in parts[:3])
        O, L = ring.ring_attention(q, k, v, causal=causal, softmax_scale=scale_of(H_kv), balanced=balanced,
                                   return_lse=True)
        results.append([x.cpu() for x in (O.detach(), L, *torch.autograd.grad(O, (q, k, v), parts[3]))])
    return results


def gathered(results, case, balanced):
    """[O, L, dQ, dK, dV] over the whole sequence from every rank's shards of one case."""
    return [ring.unshard([shards[case][n] for shards in results], balanced) for n in range(len(NAMES))]


WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def rings():
    """{W: ring.launch for a ring of W, done}: the four rings at once (their processes start in parallel); each test
    takes its own ring's result, or its exception."""
    with ThreadPoolExecutor(len(WORLDS)) as pool:
        return {world: pool.submit(ring.launch, world, run_cases, world, CASES) for world in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_ring_equals_single_process_attention(rings, world):
    results = rings[world].result()  # results[rank][case]: that rank's shards
    for case, (causal, balanced, H_kv, n_c) in enumerate(CASES):
        want = dense(*full_inputs(world, balanced, H_kv, n_c, case), causal, scale_of(H_kv))
        for name, got, exact in zip(NAMES, gathered(results, case, balanced), want):
            assert_close(got, exact, rtol=1e-10, atol=1e-10, msg=lambda m: (
                f"{name}, W={world}, causal={causal}, balanced={balanced}, H_kv={H_kv}, chunk={n_c}: {m}"))


def test_one_rank_without_torch_distributed():
    """No process group at all is a ring of one; the forward saves q, k, v, O and L and nothing else."""
    assert not dist.is_initialized()
    for case in (CASES[0], CASES[-1]):
        causal, balanced, H_kv, n_c = case
        got = run_cases(1, [case])[0]
        for name, x, exact in zip(NAMES, got, dense(*full_inputs(1, balanced, H_kv, n_c, 0), causal, scale_of(H_kv))):
            assert_close(x, exact, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}, causal={causal}: {m}")
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    O = ring.ring_attention(q, k, v, causal=True)
    assert [tuple(t.shape) for t in O.grad_fn.saved_tensors] == [(1, 2, 6, 4)] * 4 + [(1, 2, 6)]


def test_bad_inputs_are_refused_with_what_was_given():
    x = torch.randn(1, 2, 6, 4)
    for (q, k, v, options), words in [
            ((x.long(), x.long(), x.long(), {}), "must share one dtype"),  # not floating point
            ((x.double(), x, x, {}), "got torch.float64, torch.float32, torch.float32"),
            ((x, x, x, {"kernel": "bogus"}), "unknown kernel 'bogus'"),
            ((x, x[:, :, :4], x[:, :, :4], {"causal": True}), "N = N_k, got N = 6, N_k = 4"),
            ((x[:, :, :5], x[:, :, :5], x[:, :, :5], {"causal": True}), "N must be even, got N = 5")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            ring.ring_attention(q, k, v, **options)
    ring.ring_attention(x[:, :, :5], x[:, :, :5], x[:, :, :5], causal=True, balanced=False)  # one chunk a rank


def test_shard_unshard_and_the_work_per_rank():
    x = torch.arange(2 * 3 * 24 * 2).view(2, 3, 24, 2)
    for world in (1, 2, 3, 4):
        for balanced in (True, False):
            parts = [ring.shard(x, r, world, balanced) for r in range(world)]
            assert torch.equal(ring.unshard(parts, balanced), x)
            assert torch.equal(ring.unshard([p[..., 0] for p in parts], balanced, dim=2), x[..., 0])  # L's layout
    # balanced: rank r holds chunks r and 2W-1-r of 2W
    assert ring.shard(torch.arange(8).view(1, 1, 8), 1, 2, dim=2).flatten().tolist() == [2, 3, 4, 5]
    assert ring.shard(torch.arange(8).view(1, 1, 8), 0, 2, dim=2).flatten().tolist() == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="equal chunks"):
        ring.shard(torch.zeros(1, 1, 10, 1), 0, 3)

    def work(rank, world, balanced):  # (query, key) pairs rank computes at each step (N = 16W), from ring._calls
        q_chunks = ring.chunks(rank, world, balanced)
        n_c = 16 // len(q_chunks)
        return [sum((rows.stop - rows.start) * (n_k - ((n_c - 1) / 2 if diagonal else 0)) for rows, n_k, diagonal
                    in ring._calls(q_chunks, ring.chunks((rank - t) % world, world, balanced), n_c, True))
                for t in range(world)]

    for world in (2, 3, 4, 8):
        N = 16 * world
        balanced = [work(r, world, True) for r in range(world)]
        assert all(w == balanced[0] for w in balanced)                             # the same at every step
        assert len(set(balanced[0][1:])) == 1                                      # and every step but the first
        contiguous = [sum(work(r, world, False)) for r in range(world)]
        assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]  # rank W-1 does the most
        assert sum(map(sum, balanced)) == sum(contiguous) == N * (N + 1) / 2       # the causal pairs, once each


def raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.recv(torch.zeros(1), src=1)  # rank 0 would wait forever: launch must stop it


def test_a_failing_rank_fails_the_launch():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 raised.*ValueError: rank 1 fails on purpose"):
        ring.launch(2, raise_on_rank_1, timeout=60)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernels of flash.cu in the ring, against float64, as tests/test_kernels.py measures them.

FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def sdpa(causal, scale):
    def attention(q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return attention


def check_against_float64(ours, q, k, v, dO, causal, scale, where):
    """ours: [O, L, dQ, dK, dV]. Each may err at most 3x as much as SDPA in the same dtype (L: 1e-4, float32)."""
    exact = dense(*(x.double() for x in (q, k, v, dO)), causal, scale)
    theirs = dict(zip(("O", "dQ", "dK", "dV"), main.outputs(sdpa(causal, scale), q, k, v, dO)))
    for name, x, r in zip(NAMES, ours, exact):
        assert torch.isfinite(x).all(), f"{name} has non-finite values ({where})"
        err = main.rel_err(x, r)
        if name == "L":
            assert x.dtype == torch.float32 and err < 1e-4, f"L: relative error {err:.1e} ({where})"
            continue
        err_sdpa = main.rel_err(theirs[name], r)
        assert x.dtype == q.dtype and err <= 3 * err_sdpa + FLOOR[q.dtype], \
            f"{name}: relative error {err:.2e} vs SDPA's {err_sdpa:.2e} ({where})"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels of flash.cu)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal, balanced", [(False, True), (True, True), (True, False)])
def test_kernels_in_a_ring_of_one_gpu(dtype, causal, balanced):
    for H_kv, n_c in ((4, 137), (2, 5)):  # chunks that are no multiple of the kernels' tiles; GQA
        case = (causal, balanced, H_kv, n_c)
        q, k, v, dO = full_inputs(1, balanced, H_kv, n_c, 0, dtype, dim=64)
        ours = [x.cuda() for x in run_cases(1, [case], dtype, "cuda", dim=64)[0]]
        check_against_float64(ours, *(x.cuda() for x in (q, k, v, dO)), causal, scale_of(H_kv), f"{case}, {dtype}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (an NCCL ring)")
def test_nccl_ring_of_two_gpus():
    cases = [(True, True, 2, 200), (True, False, 4, 131), (False, True, 4, 64)]
    results = ring.launch(2, run_cases, 2, cases, torch.bfloat16, "cuda", H_q, 64, backend="nccl")
    for case, (causal, balanced, H_kv, n_c) in enumerate(cases):
        q, k, v, dO = (x.cuda() for x in full_inputs(2, balanced, H_kv, n_c, case, torch.bfloat16, dim=64))
        ours = [x.cuda() for x in gathered(results, case, balanced)]
        check_against_float64(ours, q, k, v, dO, causal, scale_of(H_kv), f"NCCL, {cases[case]}")
