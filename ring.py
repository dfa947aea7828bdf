"""Ring attention: one sequence spread over the ranks of a torch.distributed group (context parallelism).

    from ring import ring_attention, shard, unshard
    q, k, v = (shard(x, rank, world) for x in (q_full, k_full, v_full))   # (B, H, N / W, d): this rank's tokens
    o = ring_attention(q, k, v, causal=True)                              # this rank's rows of O; differentiable
    o_full = unshard([o_of_rank_0, o_of_rank_1, ...])                     # back in sequence order

    python ring.py                                   # checks a 2- and a 4-process ring on the CPU (gloo)
    torchrun --nproc-per-node=8 ring.py --bench      # speed on 8 GPUs (NCCL); python ring.py --bench: one GPU

Each of the W ranks holds N / W tokens of Q, K and V, and attention needs every key, so the slices K_j, V_j travel
around the ring: at step t = 0 .. W-1 rank i holds those of rank j = (i - t) mod W, attends its Q_i to them (flash.cu's
kernels on CUDA tensors, reference.py's Algorithm 1 on CPU tensors) and merges the partial O_i, L_i by L, the
identity of reference.merge (notebook 03), while the next slice is already on its way. The backward goes around
again: every block's gradients are recomputed from the final O_i and L_i, which makes them exact (Algorithm 2 needs
P_ij = exp(S_ij - L_i) and D_i = rowsum(dO_i o O_i) of the whole row); dQ_i stays, dK_j and dV_j travel with K_j,
V_j and arrive back at their owner. Notebook 12 derives each step.

Causal masks: cut the sequence into 2W chunks and give rank r chunks r and 2W-1-r (balanced=True, shard's default):
every rank then has the same work at every step. Contiguous slices (balanced=False) are the baseline: rank r has
r + 1/2 blocks of work and the ring runs at the pace of the last rank.
"""
import argparse
import math
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

import main
import reference


def _world(group):
    """(W, rank) in group (None: the default group); (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def chunks(rank, world, balanced=True):
    """The global chunks that rank holds, in the order its local sequence has them: of 2W chunks r and 2W-1-r
    (balanced), else chunk r of W."""
    return [rank, 2 * world - 1 - rank] if balanced else [rank]


def shard(x, rank, world, balanced=True, dim=2):
    """Rank's part of a full tensor x, cut along dim: the sequence of q, k, v, O (B, H, N, d) and of L (B, H, N)."""
    count = 2 * world if balanced else world
    if x.shape[dim] % count:
        raise ValueError(f"the sequence (dim {dim}, {x.shape[dim]} tokens) must split into {count} equal chunks")
    pieces = x.split(x.shape[dim] // count, dim)
    return torch.cat([pieces[c] for c in chunks(rank, world, balanced)], dim)


def unshard(parts, balanced=True, dim=2):
    """The full tensor from parts[r], rank r's part, for every rank (shard's inverse)."""
    pieces = {}
    for rank, part in enumerate(parts):
        held = chunks(rank, len(parts), balanced)
        pieces.update(zip(held, part.split(part.shape[dim] // len(held), dim)))
    return torch.cat([pieces[c] for c in sorted(pieces)], dim)


def _calls(q_chunks, k_chunks, n_c, causal):
    """One ring step as attention calls (query rows, number of leading keys, causal), from the block pairs of query
    chunk a and key chunk b in global order: a > b full, a == b causal, a < b skipped. The chunks of a slice ascend,
    so a query chunk sees a prefix of them; bottom-right causal over that prefix (n_c tokens a chunk) is full
    attention to the earlier chunks and causal on the last, exactly when the last is its diagonal a == b.
    Neighbouring query chunks that see the same prefix without a diagonal share one call."""
    if not causal:
        return [(slice(None), None, False)]  # every query sees every key
    calls = []
    for position, a in enumerate(q_chunks):
        seen = [b for b in k_chunks if b <= a]
        if not seen:
            continue
        rows, n_k, diagonal = slice(position * n_c, (position + 1) * n_c), len(seen) * n_c, seen[-1] == a
        if calls and not diagonal and calls[-1][1:] == (n_k, False) and calls[-1][0].stop == rows.start:
            rows = slice(calls.pop()[0].start, rows.stop)
        calls.append((rows, n_k, diagonal))
    return calls


def _exchange(tensors, group, tag=0):
    """Posts the sends of tensors to the next rank of the ring and the receives of as many from the previous one.
    Returns the buffers being received and the requests: wait on them before reading the buffers."""
    W, rank = _world(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, peer((rank + 1) % W), group, tag=tag + n) for n, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, t, peer((rank - 1) % W), group, tag=tag + n) for n, t in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _block_forward(Q_i, K_j, V_j, causal, scale, kernel):
    """O_ij (q's dtype) and L_ij (float32 from the kernels) of queries Q_i over keys K_j, V_j only."""
    if Q_i.is_cuda:
        return main.flash_attention(Q_i, K_j, V_j, causal=causal, softmax_scale=scale, kernel=kernel, return_lse=True)
    return reference.flash_forward(*_upcast(Q_i, K_j, V_j), causal, scale)


def _block_backward(dO_i, Q_i, K_j, V_j, O_i, L_i, causal, scale, kernel):
    """dQ_i, dK_j, dV_j from the pairs (Q_i, K_j) alone. With the final O_i and L_i, P_ij = exp(S_ij - L_i) are the
    probabilities of the whole softmax and D_i = rowsum(dO_i o O_i) is the whole row's: this block's exact share."""
    if Q_i.is_cuda:  # (with grouped-query attention the kernels already sum dK_j, dV_j over each group)
        return torch.ops.flash.backward(dO_i, None, Q_i, K_j, V_j, O_i, L_i.contiguous(), -1, 0 if causal else -1,
                                        scale, 0.0, None, kernel)
    return reference.flash_backward(*_upcast(Q_i, K_j, V_j, O_i, L_i, dO_i), causal, scale)


def _upcast(*tensors):
    """fp16 and bf16 as float32 for reference.py on the CPU (the kernels' precision); float32, float64 as they are."""
    return [x.to(torch.promote_types(x.dtype, torch.float32)) for x in tensors]


def _forward(q, k, v, causal, scale, group, kernel, balanced):
    W, i = _world(group)
    n_c = q.shape[2] // len(chunks(i, W, balanced))                      # tokens per chunk
    acc = torch.promote_types(q.dtype, torch.float32)                    # the running O_i: fp32 for fp16 and bf16
    O = torch.zeros(q.shape, dtype=acc, device=q.device)                 # (B, H_q, N, d)
    L = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)  # (B, H_q, N): no key seen yet
    K_j, V_j = k, v                                                      # (B, H_kv, N_k, d)
    for t in range(W):
        j = (i - t) % W                                                  # the rank whose K_j, V_j we hold
        if t + 1 < W:                                                    # the next slice travels while we compute
            (K_next, V_next), requests = _exchange((K_j, V_j), group)
        for rows, n_k, diagonal in _calls(chunks(i, W, balanced), chunks(j, W, balanced), n_c, causal):
            O_ij, L_ij = _block_forward(q[:, :, rows], K_j[:, :, :n_k], V_j[:, :, :n_k], diagonal, scale, kernel)
            O[:, :, rows], L[:, :, rows] = reference.merge(O[:, :, rows], L[:, :, rows], O_ij, L_ij)
        if t + 1 < W:
            for request in requests:
                request.wait()
            K_j, V_j = K_next, V_next
    return O.to(q.dtype), L


def _backward(dO, q, k, v, O, L, causal, scale, group, kernel, balanced):
    W, i = _world(group)
    n_c = q.shape[2] // len(chunks(i, W, balanced))
    acc = torch.promote_types(q.dtype, torch.float32)                    # dQ_i, dK_j, dV_j are summed in fp32
    dQ = torch.zeros(q.shape, dtype=acc, device=q.device)                # (B, H_q, N, d)
    K_j, V_j = k, v
    dK_in = dV_in = dkv_requests = None                                  # dK_j, dV_j arriving from rank i-1
    for t in range(W):
        j = (i - t) % W
        if t + 1 < W:
            (K_next, V_next), kv_requests = _exchange((K_j, V_j), group)
        dK_j = torch.zeros(k.shape, dtype=acc, device=k.device)          # (B, H_kv, N_k, d): this rank's share
        dV_j = torch.zeros_like(dK_j)
        for rows, n_k, diagonal in _calls(chunks(i, W, balanced), chunks(j, W, balanced), n_c, causal):
            dQ_ij, dK_ij, dV_ij = _block_backward(dO[:, :, rows], q[:, :, rows], K_j[:, :, :n_k], V_j[:, :, :n_k],
                                                  O[:, :, rows], L[:, :, rows], diagonal, scale, kernel)
            dQ[:, :, rows] += dQ_ij
            dK_j[:, :, :n_k] += dK_ij
            dV_j[:, :, :n_k] += dV_ij
        if t > 0:  # the shares of ranks j .. i-1, sent by rank i-1 at the end of its last step
            for request in dkv_requests:
                request.wait()
            dK_j += dK_in
            dV_j += dV_in
        if W > 1:  # on to rank i+1, which holds K_j, V_j next; after the last step each dK_j, dV_j is home
            (dK_in, dV_in), dkv_requests = _exchange((dK_j, dV_j), group, tag=2)
        if t + 1 < W:
            for request in kv_requests:
                request.wait()
            K_j, V_j = K_next, V_next
    if W > 1:
        for request in dkv_requests:
            request.wait()
        dK_j, dV_j = dK_in, dV_in                                        # the sum over every rank's queries
    return dQ.to(q.dtype), dK_j.to(k.dtype), dV_j.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, kernel, balanced):
        O, L = _forward(q, k, v, causal, scale, group, kernel, balanced)
        ctx.save_for_backward(q, k, v, O, L)  # nothing else: the backward recomputes each block
        ctx.options = causal, scale, group, kernel, balanced
        ctx.mark_non_differentiable(L)
        return O, L

    @staticmethod
    def backward(ctx, dO, dL):
        q, k, v, O, L = ctx.saved_tensors
        return *_backward(dO.contiguous(), q, k, v, O, L, *ctx.options), None, None, None, None, None


def ring_attention(q, k, v, causal=False, softmax_scale=None, group=None, kernel="auto", balanced=True,
                   return_lse=False):
    """Attention over the whole sequence, of which this rank of group (None: the default group; no group at all:
    one rank) holds q (B, H_q, N, d) and k, v (B, H_kv, N_k, d), N_k the same on every rank, H_kv dividing H_q.
    Returns this rank's rows of O (B, H_q, N, d), differentiable in q, k and v, and with return_lse also L (B, H_q, N),
    the log-sum-exp over every key (float32 from the kernels; no gradient flows through it).

    causal: over the global sequence, in which each rank holds the chunks that shard(x, rank, world, balanced) gives
    it, so N_k = N (and N even when balanced). CUDA tensors run flash.cu's kernels (kernel: as flash_attention's),
    CPU tensors reference.py (float64 works). Every rank must call it with the same shapes and options."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor (B, H, N, d), got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.shape[::3] != k.shape[::3]:
        raise ValueError(f"need q (B, H_q, N, d), k and v (B, H_kv, N_k, d) with H_kv dividing H_q, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    floats = (torch.float16, torch.bfloat16, torch.float32) + (torch.float64,) * (q.device.type == "cpu")
    if not (q.dtype == k.dtype == v.dtype and q.dtype in floats) or not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must share one dtype ({', '.join(str(t)[6:] for t in floats)} on {q.device.type}) "
                         f"and one device, got {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, {v.device}")
    main._check_kernel_name(kernel)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal: q and k must hold the same tokens, N = N_k, got N = {q.shape[2]}, "
                         f"N_k = {k.shape[2]}")
    if causal and balanced and q.shape[2] % 2:
        raise ValueError(f"causal with balanced=True: each rank's N tokens are two chunks, so N must be even, got "
                         f"N = {q.shape[2]} (or pass balanced=False)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    O, L = _RingAttention.apply(q, k.contiguous(), v.contiguous(), causal, scale, group, kernel, balanced)
    return (O, L) if return_lse else O


# ---------------------------------------------------------------------------------------------------------------
# Trying it without a cluster: launch runs a function on W processes joined by gloo (the tests and notebook 12 use it).

def launch(world, fn, *args, backend="gloo", timeout=300):
    """[fn(*args) on rank 0, ..., on rank world-1], each rank a new process (spawned) in one process group: gloo on
    the CPU, or nccl with process r on GPU r. An exception in any process is raised here with its traceback. fn must
    be importable by the new processes: a function of a module, not of a notebook."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        processes = [context.Process(target=_run, args=(r, world, init, results, backend, fn, args), daemon=True)
                     for r in range(world)]
        for p in processes:
            p.start()
        outputs, deadline = {}, time.time() + timeout
        try:
            while len(outputs) < world:
                try:
                    rank, payload, error = results.get(timeout=1)
                except queue.Empty:
                    dead = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(processes)
                            if p.exitcode not in (None, 0) and r not in outputs]
                    if dead or time.time() > deadline:
                        raise RuntimeError("ring processes failed: " + (", ".join(dead) or f"no result in {timeout} s"))
                    continue
                if error:
                    raise RuntimeError(f"rank {rank} of {world} raised:\n{error}")
                outputs[rank] = pickle.loads(payload)
        finally:  # after a failure the others may wait forever on the rank that failed: stop them
            for p in processes:
                p.join(timeout=30 if len(outputs) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outputs[r] for r in range(world)]


def _run(rank, world, init, results, backend, fn, args):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # the W processes share the CPU's cores
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        results.put((rank, pickle.dumps(fn(*args)), None))  # a copy of the data, which outlives this process
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def forward_backward(q, k, v, dO, causal=False, balanced=True, **options):
    """Run on every rank with the full q, k, v, dO (B, H, N, d): ring_attention on this rank's shard and its
    gradients for the loss sum(O o dO). Returns this rank's shards of O, L, dQ, dK, dV (unshard joins them)."""
    W, rank = _world(options.get("group"))
    q, k, v = (shard(x, rank, W, balanced).requires_grad_() for x in (q, k, v))
    O, L = ring_attention(q, k, v, causal, balanced=balanced, return_lse=True, **options)
    return [O.detach(), L, *torch.autograd.grad(O, (q, k, v), shard(dO, rank, W, balanced))]


def _check_cpu():
    """python ring.py: 2 and 4 processes against dense attention, float64, every combination of the options."""
    q, dO = (torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 40, 16, dtype=torch.float64) for _ in range(2))
    for world in (2, 4):
        for causal, balanced in ((False, True), (True, True), (True, False)):
            O, L, dq, dk, dv = (unshard(list(x), balanced) for x in zip(*launch(world, forward_backward, q, k, v, dO,
                                                                                  causal, balanced)))
            exact = main.outputs(lambda q, k, v: reference.attention(q, k, v, causal), q, k, v, dO)
            errors = [main.rel_err(x, e) for x, e in zip((O, dq, dk, dv), exact)]
            print(f"W = {world}, causal = {causal!s:5}, balanced = {balanced!s:5}: relative errors of O, dQ, dK, dV "
                  + " ".join(f"{e:.1e}" for e in errors))
            assert max(errors) < 1e-10, "the ring disagrees with dense attention"
    print("ring_attention on gloo CPU processes equals dense attention in float64")


# ---------------------------------------------------------------------------------------------------------------
# torchrun --nproc-per-node=N ring.py --bench: causal ring attention on N GPUs (NCCL) against one GPU.

ROW_FORMATS = ("{}", "{}", "{}", "{}", "{}", "{}", "{:.2f}", "{:.0f}", "{:.0f}", "{:.0%}", "{:.1f}")


def _bench(argv):
    parser = argparse.ArgumentParser(description="ring attention: time, TFLOP/s per GPU, scaling, memory")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--dtype", default="bf16", help="comma list of fp16, bf16")
    parser.add_argument("--seqlens", default="4096,8192,16384,32768,65536,131072", help="tokens per GPU")
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--layouts", default="balanced", help="comma list of balanced, contiguous")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--max-tokens", default="fwd=1048576,fwd_bwd=262144", help="largest total N per mode")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--markdown", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    W, rank = _world(None)
    say = print if rank == 0 else (lambda *a, **k: None)

    def agree(x, op):  # one number every rank agrees on: the ring's sends must pair up, and we report the slowest
        x = torch.tensor(float(x), device="cuda")
        if W > 1:
            dist.all_reduce(x, op=op)
        return x.item()

    def time_ms(fn):  # median of a number of calls that every rank makes
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)]
                  for _ in range(int(agree(min(30, max(3, 1.0 / (time.perf_counter() - t0))), dist.ReduceOp.MIN)))]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return agree(sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2], dist.ReduceOp.MAX)

    H, H_kv, d, B = args.heads, args.kv_heads or args.heads, args.d, args.batch
    caps = dict(item.split("=") for item in args.max_tokens.split(","))
    title = (f"Ring attention on {W} x {torch.cuda.get_device_name()}: causal, B = {B}, H = {H}, H_kv = {H_kv}, "
             f"d = {d}, kernel {args.kernel}, torch {torch.__version__}")
    header = ("mode", "dtype", "layout", "GPUs", "N per GPU", "N total", "ms", "TFLOP/s per GPU", "1 GPU TFLOP/s",
              "efficiency", "peak GiB per GPU")
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    say(title, *table, sep="\n")
    for dtype_name in args.dtype.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        for layout in args.layouts.split(","):
            balanced = layout == "balanced"
            torch.manual_seed(0)  # the same full problem on every rank: a check against one GPU first
            q, do = (torch.randn(B, H, 512 * W * 2, d, device="cuda", dtype=dtype) for _ in range(2))
            k, v = (torch.randn(B, H_kv, 512 * W * 2, d, device="cuda", dtype=dtype) for _ in range(2))
            ours = forward_backward(q, k, v, do, True, balanced, kernel=args.kernel)
            one = main.outputs(lambda q, k, v: main.flash_attention(q, k, v, causal=True, kernel=args.kernel),
                               q, k, v, do)
            error = max(main.rel_err(x, shard(y, rank, W, balanced).double()) for x, y in zip(ours[:1] + ours[2:], one))
            assert agree(error, dist.ReduceOp.MAX) < main.TOLERANCE[str(dtype)[6:]], f"ring != one GPU: {error:.1e}"
            for mode in args.modes.split(","):
                for n in map(int, args.seqlens.split(",")):
                    if n * W > int(caps[mode]):
                        continue
                    q, k, v, do = (torch.randn(B, h, n, d, device="cuda", dtype=dtype) for h in (H, H_kv, H_kv, H))
                    q, k, v = (x.requires_grad_(mode != "fwd") for x in (q, k, v))

                    def ring():
                        o = ring_attention(q, k, v, causal=True, kernel=args.kernel, balanced=balanced)
                        return o if mode == "fwd" else torch.autograd.grad(o, (q, k, v), do)

                    def one_gpu():
                        o = main.flash_attention(q, k, v, causal=True, kernel=args.kernel)
                        return o if mode == "fwd" else torch.autograd.grad(o, (q, k, v), do)

                    torch.cuda.reset_peak_memory_stats()
                    ms = time_ms(ring)
                    gib = agree(torch.cuda.max_memory_allocated() / 2**30, dist.ReduceOp.MAX)
                    ms_one = time_ms(one_gpu)
                    flops = 4 * B * H * d / 2 * (1.0 if mode == "fwd" else 3.5)  # per (query, key) pair, causal
                    tflops, tflops_one = flops * (n * W) ** 2 / W / ms / 1e9, flops * n**2 / ms_one / 1e9
                    row = (mode, dtype_name, layout, W, n, n * W, ms, tflops, tflops_one, tflops / tflops_one, gib)
                    table.append("| " + " | ".join(f.format(x) for f, x in zip(ROW_FORMATS, row)) + " |")
                    say(table[-1])
    if args.markdown and rank == 0:
        with open(args.markdown, "w") as f:
            f.write(f"# {title}\n\n`{' '.join(sys.argv)}`\n\nTFLOP/s per GPU: 4·B·H·N²·d/2 FLOPs over the total N "
                    "(x3.5 for forward + backward), per GPU. 1 GPU: flash_attention alone at the N of one GPU. "
                    "Efficiency: their ratio (weak scaling). Peak memory: the most any GPU allocated, inputs "
                    "included.\n\n" + "\n".join(table) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _bench(sys.argv[1:]) if "--bench" in sys.argv else _check_cpu()
