"""Every kernel under NVIDIA compute-sanitizer, forward and backward, on small ragged shapes.

    python tests/sanitize.py                              # all four tools
    python tests/sanitize.py --tools memcheck,racecheck   # some of them
    python tests/sanitize.py --quick                      # N = 130 only
    python tests/sanitize.py --kernels hopper,hopper_fp8  # some kernels (names as in list_kernels, main.EIGHT_BIT)

The tools: memcheck (out-of-bounds and misaligned accesses, hardware exceptions), racecheck (shared-memory
hazards: a missing __syncthreads), synccheck (barriers not every thread reaches) and initcheck (reads of
global memory nothing wrote; not of the kernels that write through TMA, whose stores it does not see:
WRITE_BY_TMA). Needs a CUDA GPU and compute-sanitizer, which comes with the CUDA toolkit.

The script builds flash.cu first, without a sanitizer, then runs itself once per tool with --case: every
available kernel, dtype and tile width (head dim), forward and autograd backward: at d = 64, B = 1, H = 2,
N in (1, 37, 130) (one row; one ragged block; several blocks and a ragged last one), causal and not (causal
on transposed views, read through their strides), and unequal lengths with grouped-query attention (SHAPES);
at the other tile widths, a ragged causal GQA shape and a split-KV decoding one. At every tile width of the split-KV
kernels, decoding against a KV cache of ragged lengths with NaN past them (run_kvcache). At d = 64 also every mask and
score modification at once (window, softcap, ALiBi), and a packed batch (flash_attention_varlen) whose
sequences have no queries, no keys, one token or ragged blocks, each also with dropout and the deterministic
backward (the -DDROPOUT=1 and -DDETERMINISTIC=1 builds). Then quantize and the 8-bit kernels (run_8bit).
Racecheck, the slow one, uses N = 130 only. It prints one line per tool, the output tail of any tool that reported something, and exits
1 if any did. (pytest collects test_*.py only, so this file is not a test.)
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import main  # noqa: E402  (the repository root is not a package)

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
LENGTHS = "1,37,130"
SHAPES = [(1, 1100, 8, 2), (37, 130, 4, 2), (130, 37, 4, 1)]  # (N_q, N_k, H_q, H_kv)
# Only our kernels (flash_fwd_*, flash_bwd_*, flash_decode, ...) are instrumented, not PyTorch's. Not for initcheck: a write by
# a kernel it does not instrument would count as missing (the inputs, which PyTorch's kernels write).
ONLY_OURS = ["--kernel-name", "kns=flash_"]
OPTIONS = {"memcheck": ONLY_OURS + ["--padding", "64"],  # a gap after each allocation, so overruns hit no tensor
           "racecheck": ONLY_OURS, "synccheck": ONLY_OURS, "initcheck": []}
# initcheck does not count TMA stores (cp.async.bulk.tensor) as writes: every read of what these kernels write
# that way (O; dK, dV) is reported, by the kernel or PyTorch operation that reads it. On an H200 (compute-sanitizer
# 2025.3.1), a torch.clone of O (1, 2, 130, 128) made by `hopper` gave 2080 reports, one per 32-byte sector, where
# the same clone after `ampere` gave none; the tests compare every element of these outputs with float64. So
# initcheck leaves them out (their split-KV decoding, which stores with st.global, included).
WRITE_BY_TMA = ("hopper", "hopper_fp8")


def problems(lengths, d):
    """(N_q, N_k, H_q, H_kv, causal): at d = 64, equal lengths N, causal and not, then unequal lengths with
    grouped-query attention, N_q < N_k (at N_q = 1 the split-KV kernels split 1100 keys four ways) and N_q > N_k
    (causal: the first queries see no key); at every other tile width, one ragged shape of each kind."""
    if d != 64:
        return [(max(lengths), max(lengths), 2, 1, True), (1, 1100, 8, 2, False)]
    return [(N, N, 2, 2, causal) for N in lengths for causal in (False, True)] + \
        [(N_q, N_k, H_q, H_kv, causal) for (N_q, N_k, H_q, H_kv) in SHAPES for causal in (False, True)]


def run_cases(lengths, kernels):
    """Forward and backward of every available kernel in `kernels`, dtype and head dim on each problem."""
    cases, covered = 0, []
    for kn in main.list_kernels():
        if not kn["available"] or kn["name"] not in kernels:
            continue
        for dtype in kn["dtypes"]:
            for d in kn["head_dims"]:
                for N_q, N_k, H_q, H_kv, causal in problems(lengths, d):
                    # causal: (B, N, H, d) storage seen through .transpose(1, 2), read in place
                    def make(H, N):
                        x = torch.randn((1, N, H, d) if causal else (1, H, N, d), device="cuda",
                                        dtype=getattr(torch, dtype))
                        return x.transpose(1, 2) if causal else x
                    q, do, k, v = make(H_q, N_q), make(H_q, N_q), make(H_kv, N_k), make(H_kv, N_k)
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    o = main.flash_attention(q, k, v, causal=causal, kernel=kn["name"])
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    assert all(torch.isfinite(t).all() for t in (o, *grads)), \
                        f"non-finite output: {kn['name']} {dtype} d={d} N_q={N_q} N_k={N_k} causal={causal}"
                    cases += 1
                if kn["split_kv"]:
                    cases += run_kvcache(kn["name"], getattr(torch, dtype), d)
                if d == 64:
                    cases += run_masks_and_varlen(kn["name"], getattr(torch, dtype))
            covered.append(f"{kn['name']} {dtype} d={','.join(map(str, kn['head_dims']))}")
    cases += run_8bit(covered, kernels)
    torch.cuda.synchronize()
    print(f"cases: {cases} ({'; '.join(covered)})")  # the line the parent reads


def run_masks_and_varlen(kernel, dtype):
    """A window, a softcap and ALiBi together on a ragged GQA shape, and a packed batch with them: the cases
    that read and skip blocks by the mask, and that read past a sequence's rows into the next one's."""
    def grads(f, *xs):
        xs = [x.requires_grad_() for x in xs]
        o = f(*xs)
        grads = torch.autograd.grad(o, xs, torch.randn_like(o))
        assert all(torch.isfinite(t).all() for t in (o, *grads)), f"non-finite output: {kernel} {dtype} masks/varlen"
    slopes = torch.rand(4, device="cuda")
    scores = dict(window_size=(20, 5), softcap=5.0, alibi_slopes=slopes)
    q, k, v = (torch.randn(1, H, N, 64, device="cuda", dtype=dtype) for H, N in ((4, 130), (2, 37), (2, 37)))
    dropout = dict(dropout_p=0.2, dropout_seed=1, deterministic=True)
    for extra in ({}, dropout):
        grads(lambda q, k, v: main.flash_attention(q, k, v, causal=True, kernel=kernel, **scores, **extra), q, k, v)
    lengths_q, lengths_k = [1, 37, 0, 130, 5], [37, 1, 5, 130, 0]
    cu_q, cu_k = (torch.tensor([0, *n], device="cuda").cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    q, k, v = (torch.randn(int(cu[-1]), H, 64, device="cuda", dtype=dtype) for H, cu in ((4, cu_q), (2, cu_k), (2, cu_k)))
    for causal, extra in ((False, {}), (True, scores), (True, dict(scores, **dropout))):
        grads(lambda q, k, v: main.flash_attention_varlen(q, k, v, cu_q, cu_k, 130, 130, causal, kernel=kernel,
                                                          **extra), q, k, v)
    return 5


def run_kvcache(kernel, dtype, d):
    """Decoding against caches of ragged lengths, each cut inside a key block, with NaN past each length (rows
    the split-KV kernels copy in with the last block and must not let reach O) and a new token appended."""
    lengths, N_max = [0, 17, 100], 130
    k_cache, v_cache = (torch.full((3, 2, N_max, d), float("nan"), device="cuda", dtype=dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        k_cache[b, :, :n], v_cache[b, :, :n] = (torch.randn(2, n, d, device="cuda") for _ in range(2))
    q = torch.randn(3, 8, 1, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(3, 2, 1, d, device="cuda", dtype=dtype) for _ in range(2))
    o = main.flash_attention_with_kvcache(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"), k, v,
                                         kernel=kernel)
    assert torch.isfinite(o).all(), f"non-finite output: {kernel} {dtype} d={d} KV cache"
    return 1


def run_8bit(covered, kernels):
    """quantize and the 8-bit kernels (those this GPU runs) at both tile widths, V as stored and transposed, on
    ragged GQA shapes with N_q != N_k, causal and not, one with the rotation and smoothing."""
    cases, arch = 0, main._arch()
    for dtype in [torch.float8_e4m3fn] * (arch == 90 and main._builds_sm90a()) + [torch.int8] * (arch >= 80):
        if main.EIGHT_BIT[dtype] not in kernels:
            continue
        for d in main.EIGHT_BIT_HEAD_DIMS:
            for (N_q, N_k, H_q, H_kv), causal in ((SHAPES[1], True), (SHAPES[2], False), (SHAPES[0], True)):
                q = torch.randn(1, H_q, N_q, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(1, H_kv, N_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                for transpose_v in (False, True) if dtype == torch.float8_e4m3fn else (False,):
                    o = main.flash_attention_8bit(q, k, v, causal=causal, dtype=dtype, transpose_v=transpose_v,
                                                  rotate=causal, smooth_k=causal)
                    assert torch.isfinite(o).all(), f"non-finite output: {dtype} d={d} N_q={N_q} N_k={N_k}"
                    cases += 1
        covered.append(f"{main.EIGHT_BIT[dtype]} d={','.join(map(str, main.EIGHT_BIT_HEAD_DIMS))}")
    return cases


def find_sanitizer():
    from torch.utils.cpp_extension import CUDA_HOME
    path = shutil.which("compute-sanitizer") or os.path.join(CUDA_HOME or "", "bin", "compute-sanitizer")
    if not os.path.isfile(path):
        sys.exit("compute-sanitizer not found: put the CUDA toolkit's bin/ on PATH or set CUDA_HOME")
    return path


def sanitize(sanitizer, tool, lengths, kernels):
    """Runs --case under one tool. Returns the output, the case line ("cases: ...", None if the cases did not
    all run) and the number of errors the tool reported (None if it printed no summary)."""
    command = [sanitizer, "--tool", tool, "--error-exitcode", "1", *OPTIONS[tool],
               sys.executable, os.path.abspath(__file__), "--kernels", ",".join(kernels), "--case", lengths]
    # One cudaMalloc per tensor instead of PyTorch's cached blocks: an overrun then leaves its allocation
    # (memcheck sees it) and a new tensor is fresh memory (initcheck sees reads of what nothing wrote).
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    output = result.stdout + result.stderr
    cases = re.search(r"^cases: .*$", output, re.M)
    # "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    errors = [int(n) for n in re.findall(r"SUMMARY: .*?(\d+) errors?", output)]
    if result.returncode != 0 and not any(errors):
        cases = None  # the run itself failed: its output says why
    return output, cases.group(0) if cases else None, sum(errors) if errors else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ", ".join(TOOLS))
    parser.add_argument("--quick", action="store_true", help="N = 130 only")
    parser.add_argument("--case", metavar="LENGTHS", nargs="?", const=LENGTHS,
                        help=f"only run the kernels, on these N (default {LENGTHS}): what each tool watches")
    everything = [k["name"] for k in main.list_kernels()] + list(main.EIGHT_BIT.values())
    parser.add_argument("--kernels", default=",".join(everything), help="comma-separated subset of " +
                        ", ".join(everything) + " (default: all that this GPU runs)")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if set(kernels) - set(everything):
        sys.exit(f"unknown kernel in {args.kernels}; choose from {', '.join(everything)}")
    if not torch.cuda.is_available():
        sys.exit("tests/sanitize.py needs a CUDA GPU")
    if args.case:
        run_cases([int(n) for n in args.case.split(",")], kernels)
        sys.exit(0)

    tools = args.tools.split(",")
    if set(tools) - set(TOOLS):
        sys.exit(f"unknown tool in {args.tools}; choose from {', '.join(TOOLS)}")
    sanitizer = find_sanitizer()
    available = [k["name"] for k in main.list_kernels() if k["available"] and k["name"] in kernels]  # built once,
    # outside the sanitizer
    main.build(available, sorted({d for k in main.list_kernels() for d in k["head_dims"]}), (64,))
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'tool':<10} {'errors':>6} {'seconds':>7}  kernels covered")
    failed = []
    for tool in tools:
        start = time.time()
        watched = [k for k in kernels if tool != "initcheck" or k not in WRITE_BY_TMA]
        if len(watched) < len(kernels):
            print(f"({tool} leaves out {', '.join(sorted(set(kernels) - set(watched)))}: see WRITE_BY_TMA)")
        if not watched:
            continue
        output, cases, errors = sanitize(sanitizer, tool, "130" if args.quick or tool == "racecheck" else LENGTHS,
                                         watched)
        print(f"{tool:<10} {'?' if errors is None else errors:>6} {time.time() - start:>7.0f}  "
              f"{cases or 'the run failed'}", flush=True)
        if errors != 0 or cases is None:
            failed.append(tool)
            print(f"--- {tool}: the last lines of its output ---\n{output[-6000:]}\n---", flush=True)
    if failed:
        sys.exit(f"compute-sanitizer reported problems under {', '.join(failed)}")
    print(f"No errors under {', '.join(tools)}.")
