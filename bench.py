"""Benchmark our FlashAttention kernels against manual attention and PyTorch SDPA; write docs/benchmarks.md.

    python bench.py --quick                  # N=1024,4096, d=64, fp16+fp32: well under a minute once built
    python bench.py                          # full sweep: N=512..16384, d=64,128, 3 dtypes, 3 modes, causal or not
    python bench.py --kernels manual,fp32,sdpa-flash --seqlens 2048,65536 --d 64 --causal on --modes fwd
    python bench.py --batch 4 --heads 16 --layout contiguous,transposed   # fixed B and H; also nanoGPT's layout
    python bench.py --deterministic --modes bwd,fwd_bwd --kernels ampere,hopper   # dQ without atomics
    python bench.py --plot-from docs/benchmarks/results.json --markdown docs/benchmarks.md   # no GPU needed
    python bench.py --decode --out docs/benchmarks --markdown docs/benchmarks.md   # N_q = 1 against a KV cache
    python bench.py --plot-from docs/benchmarks/decode.json --markdown docs/benchmarks.md  # its section, no GPU
    python bench.py --model --kernels sdpa,sdpa-flash,sdpa-cudnn,hopper --out docs/benchmarks \
        --markdown docs/benchmarks.md          # a compiled nanoGPT-style training step, attention by each system

The pages in docs/ were made as their metadata records: a run per page, or runs of one session in processes of
their own (one per dtype and head dim: a crash or an OOM then loses one process), joined with --merge. The main
page, for instance:
    python bench.py --dtype fp16 --d 64 --seqlens 1024,4096,16384 --modes fwd,fwd_bwd --out /tmp/bench/fp16_64
    ...                                      # the same for fp16, bf16, fp32 x d = 64, 128, and bf16 at 32, 96, 256
    python bench.py --merge /tmp/bench/*/results.json --out docs/benchmarks --markdown docs/benchmarks.md
and the others:
    python bench.py --window 1024 --seqlens 4096,16384 --d 128 --dtype bf16 --causal on --modes fwd,fwd_bwd \
        --kernels manual,ampere,hopper,sdpa,sdpa-flash,sdpa-cudnn,sdpa-efficient \
        --out docs/benchmarks/window --markdown docs/benchmarks-window.md   # a sliding window against full rows
    python bench.py --dropout 0.1 --seqlens 2048,4096,16384 --d 64,128 --dtype fp16 --modes fwd,fwd_bwd \
        --kernels hopper,sdpa,sdpa-flash --out docs/benchmarks/dropout \
        --markdown docs/benchmarks-dropout.md  # attention dropout, in the kernels
    python bench.py --kernels hopper,ampere,sdpa-flash,sdpa-cudnn,fp8,fp8-vt,fp8-kernel,fp8-vt-kernel,int8,int8-kernel \
        --modes fwd --dtype bf16 --d 64 --seqlens 1024,4096,16384 --out /tmp/8bit/d64   # and --d 128, --d 256, then
    python bench.py --merge /tmp/8bit/*/results.json --out docs/benchmarks/8bit \
        --markdown docs/benchmarks-8bit.md     # 8-bit attention against the 16-bit kernels
    python bench.py --kernels hopper,sdpa,sdpa-flash,sdpa-cudnn --dtype fp16,bf16 --d 64,128 --seqlens 1024,4096,16384 \
        --modes fwd,fwd_bwd --out /tmp/cudnn/a   # and --d 256 --out /tmp/cudnn/b, then
    python bench.py --merge /tmp/cudnn/*/results.json --out docs/benchmarks/cudnn \
        --markdown docs/benchmarks-cudnn.md    # the hopper kernels against cuDNN

--window W gives every query the W keys before it (and, unless causal, the W after it): flash_attention's
window_size=(W, W), or (W, 0) when causal; SDPA and manual attention get the same mask as an N x N attn_mask, which is
what they take. TFLOP/s then counts the (query, key) pairs the window keeps. Manual attention's causal mask, and every
N x N mask, is made once per problem, outside the timed calls, as a model keeps it in a buffer.

--dropout P drops each entry of P with probability P in every system: ours in the kernels (checked against the
reference with the same mask, flash_attention's dropout_seed = 0), SDPA and manual attention with their own
random masks (so their rows are timed but not checked). --deterministic runs our backward without atomics.

--decode times one query per sequence (decoding a token) against K, V caches of N_k keys, H_q = 32, d = 128,
forward only: our split-KV kernels, SDPA and manual attention, in GB/s and % of the GPU's memory bandwidth. It
writes decode.json and replaces only the section "Decoding" of the markdown page.

--model times a whole training step of a GPT (nanoGPT's GPT-2 small with 6 layers: width 768, 12 heads of d = 64,
T = 1024, B = 16, bf16 autocast, fused AdamW) compiled by torch.compile, with each system as its attention: the
speed a user sees in training, where attention is a fraction of the step. Every system starts from the same
weights and trains on the same batch: their losses must agree (MODEL_LOSS_TOLERANCE). It writes model.json and
replaces only the section "Inside a model" of the markdown page.

Each system is checked against a float32 reference before it is timed. Row status: ok, OOM, unsupported (an SDPA
backend refused, or a kernel has no backward for the dtype), MISMATCH (not timed), ERROR. Exit status 2 if a row
is MISMATCH or ERROR, 1 without a GPU. --out (default bench_results/) gets results.json or decode.json (a table:
pandas.DataFrame(json.load(f)["rows"])) and the figures; --plot-from draws the figures beside its file.
"""
import argparse, contextlib, datetime, functools, gc, itertools, json  # noqa: E401
import math, os, re, shlex, statistics, sys, time, warnings  # noqa: E401
from collections import Counter
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import reference
from main import (EIGHT_BIT_HEAD_DIMS, build, flash_attention, flash_attention_8bit, list_kernels, quantize, tile_dim,
                  time_ms)

# FlashAttention's own benchmark shapes: tokens (B*N) and model width (H*d) stay fixed as N and d grow.
TOKENS, WIDTH = 16384, 2048
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Forward is two matmuls (Q K^T, P V); backward five (S recomputed, dV, dP, dQ, dK): 2.5x, and 3.5x for both.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
# contiguous: q, k, v made as (B, H, N, d). transposed: made as (B, N, H, d) and viewed as (B, H, N, d), as
# nanoGPT splits heads; our kernels read such views in place, and whatever a system copies is timed.
LAYOUTS = ("contiguous", "transposed")
SDPA = {"sdpa": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
        "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-math": "MATH"}  # system: the only backend it may use
# Largest error allowed (see max_error). PyTorch's fused kernels reached 1e-2 (fp16) and 2e-1 (bf16, dq of
# causal N=65536) on an H200; bf16 gets 8x for 3 fewer mantissa bits. A real bug (a wrong row) gives 0.5 and more.
TOLERANCE = {"fp16": 5e-2, "bf16": 4e-1, "fp32": 1e-3}
# 8-bit attention (flash_attention_8bit), forward only, fp16/bf16 in and out: system: (dtype, transpose_v, timed).
# "fp8" times quantize() and the kernel, as a call on fp16/bf16 tensors runs; "fp8-kernel" the kernel alone, on
# inputs quantized once (a KV cache kept in 8 bits); "-vt": V quantized transposed (flash_attention_8bit's default
# for fp8), so that the kernel need not; without it the kernel transposes V_j.
EIGHT_BIT = {"fp8": (torch.float8_e4m3fn, False, "all"), "fp8-kernel": (torch.float8_e4m3fn, False, "kernel"),
             "fp8-vt": (torch.float8_e4m3fn, True, "all"), "fp8-vt-kernel": (torch.float8_e4m3fn, True, "kernel"),
             "int8": (torch.int8, False, "all"), "int8-kernel": (torch.int8, False, "kernel")}
EIGHT_BIT_TOLERANCE = 0.4  # their rounding reached 0.18 of a row's scale (fp8, d = 64); a wrong layout gives about 1
# Dense peak TFLOP/s from NVIDIA's data sheets (tensor cores with fp32 sums; CUDA cores for fp32, TF32 off). A key's
# words must each be a whole word of the GPU's name ("A100 80GB" matches "NVIDIA A100-SXM4-80GB"); the first key
# that matches wins, so specific names come first ("A10" is not "A100", "A10G").
PEAK_TFLOPS = [("H100 PCIe", {"fp16": 756.5, "bf16": 756.5, "fp32": 51.0}),
               ("H100 NVL", {"fp16": 835.5, "bf16": 835.5, "fp32": 60.0}),
               ("H100", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
               ("H200 NVL", {"fp16": 835.5, "bf16": 835.5, "fp32": 60.0}),
               ("H200", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
               ("A100", {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5}), ("V100", {"fp16": 125.0, "fp32": 15.7}),
               ("T4", {"fp16": 65.0, "fp32": 8.1}), ("RTX 4090", {"fp16": 165.2, "bf16": 165.2, "fp32": 82.6}),
               ("L4", {"fp16": 121.0, "bf16": 121.0, "fp32": 30.3}),
               ("A10", {"fp16": 125.0, "bf16": 125.0, "fp32": 31.2})]
# Peak memory (HBM) bandwidth in TB/s from the same data sheets, keys matched as PEAK_TFLOPS's.
PEAK_TBPS = [("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("H200 NVL", 4.8), ("H200", 4.8),
             ("A100 80GB", 2.0), ("A100 40GB", 1.555)]
QUICK = "--seqlens 1024,4096 --d 64 --dtype fp16,fp32 --modes fwd,fwd_bwd --causal off --warmup 5 --rep 20".split()
# The fields of a row, and how the terminal and the markdown page show them: (field, header, width, format).
COLUMNS = [("dtype", "dtype", 5, "{}"), ("d", "d", 3, "{}"), ("causal", "causal", 6, "{}"), ("mode", "mode", 7, "{}"),
           ("seqlen", "N", 5, "{}"), ("batch", "B", 3, "{}"), ("heads", "H", 3, "{}"), ("layout", "layout", 10, "{}"),
           ("system", "system", 14, "{}"), ("status", "status", 11, "{}"), ("ms", "ms", 9, "{:.3f}"),
           ("tflops", "TFLOP/s", 7, "{:.1f}"), ("pct_peak", "%peak", 5, "{:.1f}"), ("speedup", "speedup", 7, "{:.2f}x"),
           ("vs_sdpa", "vs SDPA", 7, "{:.2f}x"), ("memory_mib", "MiB", 7, "{:.0f}"),
           ("memory_saving", "mem saving", 10, "{:.1f}x"), ("max_error", "max err", 7, "{:.0e}")]
ROW_FIELDS = [field for field, *_ in COLUMNS] + ["note"]  # and EXTRA_FIELDS, those given
EXTRA_FIELDS = ["window", "dropout", "deterministic"]
GROUP_FIELDS = ("mode", "dtype", "d", "causal")  # one figure and one markdown table each
# Decoding: one new token per sequence (N_q = 1) against a K, V cache of N_k keys in H_kv heads; shapes of an 8B
# model (H_q = 32, d = 128; H_kv = 8 is its grouped-query attention). SDPA is the unit; manual expands K and V.
DECODE_HEADS, DECODE_HEAD_DIM = 32, 128
DECODE_SDPA = ["sdpa", "sdpa-flash", "sdpa-cudnn"]
DECODE_TITLE = "## Decoding (N_q = 1, split-KV)"  # the markdown page's section that --decode owns
DECODE_COLUMNS = [("dtype", "dtype", 5, "{}"), ("batch", "B", 3, "{}"), ("heads", "H_q", 3, "{}"),
                  ("kv_heads", "H_kv", 4, "{}"), ("seqlen_k", "N_k", 6, "{}"), ("system", "system", 10, "{}"),
                  ("status", "status", 11, "{}"), ("ms", "ms", 9, "{:.4f}"), ("gbps", "GB/s", 6, "{:.0f}"),
                  ("pct_hbm", "%HBM", 5, "{:.1f}"), ("vs_sdpa", "vs SDPA", 7, "{:.3f}x"),
                  ("host_us", "host µs", 7, "{:.1f}"), ("max_error", "max err", 7, "{:.0e}")]
DECODE_ROW_FIELDS = [field for field, *_ in DECODE_COLUMNS] + ["note"]
# Inside a model: nanoGPT's GPT-2 small (width 768, 12 heads of d = 64, GPT-2's vocabulary padded to 50304) with 6
# layers, at T = 1024 and B = 16, as FlashAttention-3's and nanoGPT's training runs hold it; our kernels run causal.
MODEL = {"layers": 6, "width": 768, "heads": 12, "seqlen": 1024, "batch": 16, "vocab": 50304}
MODEL_TITLE = "## Inside a model (a compiled nanoGPT-style training step)"  # the section that --model owns
MODEL_STEPS = (5, 20)  # warm-up steps (torch.compile compiles in the first), then timed steps
# Largest relative difference of a system's losses from the first system's, first step and last: the same bf16
# step in other kernels differs by rounding (about 1e-3 of a loss near 11); a wrong gradient shows after 25 steps.
MODEL_LOSS_TOLERANCE = 2e-2
MODEL_COLUMNS = [("system", "system", 10, "{}"), ("status", "status", 11, "{}"), ("ms", "ms/step", 7, "{:.2f}"),
                 ("tokens_per_s", "tokens/s", 8, "{:.0f}"), ("vs_sdpa", "vs SDPA", 7, "{:.2f}x"),
                 ("memory_gib", "GiB", 5, "{:.1f}"), ("first_loss", "loss 1", 6, "{:.4f}"),
                 ("last_loss", f"loss {sum(MODEL_STEPS)}", 7, "{:.4f}")]
MODEL_ROW_FIELDS = [field for field, *_ in MODEL_COLUMNS] + ["note"]
SECTIONS = (DECODE_TITLE, MODEL_TITLE)  # sections of the page that their own sweeps write


def attention_flops(batch, heads, seqlen, head_dim, causal, mode, window=None):
    """FLOPs of one call: forward is 2 matmuls of 2*N*N*d each; causal skips half. With a window of W keys on
    each side, only the pairs it keeps: query r sees keys max(0, r - W) .. min(N - 1, r + W) (r + 0 causal)."""
    if window is None:
        return 4 * batch * heads * seqlen**2 * head_dim / (2 if causal else 1) * MODE_FLOP_FACTOR[mode]
    pairs = sum(min(seqlen - 1, r + (0 if causal else window)) - max(0, r - window) + 1 for r in range(seqlen))
    return 4 * batch * heads * pairs * head_dim * MODE_FLOP_FACTOR[mode]


def window_of(causal, window):
    """flash_attention's window for --window W: (W, W), or (W, 0) when causal; (-1, -1) without one."""
    return (-1, -1) if window is None else (window, 0 if causal else window)


def lookup(table, gpu_name):
    """The value of the first key of a (key, value) table whose words are all whole words of the GPU's name."""
    matches = (value for key, value in table
               if all(re.search(rf"\b{re.escape(word)}\b", gpu_name) for word in key.split()))
    return next(matches, None)


def peak_tflops(gpu_name, dtype_name):
    """Dense peak TFLOP/s of a GPU for a dtype, or None when not in our table."""
    return (lookup(PEAK_TFLOPS, gpu_name) or {}).get(dtype_name)


def peak_bandwidth(gpu_name):
    """Peak memory bandwidth of a GPU in TB/s, or None when not in our table."""
    return lookup(PEAK_TBPS, gpu_name)


def decode_bytes(row):
    """Bytes one decoding step moves at least: K and V read once, q read and o written, all in the dtype."""
    keys_values = 2 * row["batch"] * row["kv_heads"] * row["seqlen_k"]
    return DTYPES[row["dtype"]].itemsize * DECODE_HEAD_DIM * (keys_values + 2 * row["batch"] * row["heads"])


def comma_list(item_type=str, choices=None):
    """argparse type for "a,b,c" lists, checked against choices."""
    def parse(text):
        items = [item_type(item.strip()) for item in text.split(",") if item.strip()]
        if not items or any(choices is not None and item not in choices for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices or ['values'])}")
        return items
    return parse


def parse_args(argv):
    systems = ["manual", *(kernel["name"] for kernel in list_kernels()), *SDPA]  # in run order: manual is the unit
    eight_bit = list(EIGHT_BIT)  # (only when named: forward only, fp16/bf16)
    split_kv = [kernel["name"] for kernel in list_kernels() if kernel["split_kv"]]  # ours that decode
    decode_systems = [*split_kv, *DECODE_SDPA, "manual"]  # manual last: it needs the most memory
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Examples: the top of bench.py.")
    add = parser.add_argument
    add("--quick", action="store_true", help=" ".join(QUICK) + " (flags given win)")
    add("--kernels", type=comma_list(str, systems + eight_bit), metavar="LIST",
        help="default: all of " + ",".join(systems) + "; also " + ",".join(eight_bit) + " (8-bit, see EIGHT_BIT)")
    add("--dtype", type=comma_list(str, DTYPES), metavar="LIST", help="default: fp16,bf16,fp32 (--decode: fp16,bf16)")
    add("--causal", choices=["on", "off", "both"], default="both", help="default: %(default)s")
    add("--d", type=comma_list(int), metavar="LIST", default="64,128", help="head dims (default: %(default)s)")
    add("--modes", type=comma_list(str, MODE_FLOP_FACTOR), default="fwd,bwd,fwd_bwd", help="default: %(default)s")
    add("--layout", type=comma_list(str, LAYOUTS), metavar="LIST", default="contiguous", help="contiguous (q, k, v "
        "made as (B, H, N, d)), transposed (made as (B, N, H, d), then .transpose(1, 2)); default: %(default)s")
    add("--seqlens", type=comma_list(int), default="512,1024,2048,4096,8192,16384",
        help="sequence lengths N (default: %(default)s)")
    add("--batch", type=int, help="fixed batch size (default: 16384 // N)")
    add("--heads", type=int, help="fixed number of heads (default: 2048 // d)")
    add("--window", type=int, metavar="W", help="a sliding window: each query sees W keys before it and, unless "
        "causal, W after (default: none)")
    add("--dropout", type=float, default=0.0, metavar="P", help="dropout probability of P (default: none)")
    add("--deterministic", action="store_true", help="our backward without atomics (deterministic=True)")
    add("--warmup", type=float, default=25.0, help="warm-up per measurement in ms (default: %(default)s)")
    add("--rep", type=float, default=100.0, help="measuring time per measurement in ms (default: %(default)s)")
    add("--out", type=Path, help="folder for results.json (decode.json, model.json) and the figures (default: "
        "bench_results)")
    add("--markdown", type=Path, metavar="FILE", help="also write a markdown page (docs/benchmarks.md); with "
        "--decode or --model, only its own section")
    add("--plot-from", type=Path, metavar="FILE", help="redraw a saved results.json, decode.json or model.json "
        "instead of running (no GPU)")
    add("--merge", type=Path, nargs="+", metavar="FILE", help="join the results.json of several runs on one GPU "
        "into --out's, then draw them as --plot-from (no GPU): a later file's row replaces an earlier one of the "
        "same problem and system, and keeps its ratios, so rerun whole groups")
    add("--decode", action="store_true", help=f"the decoding sweep instead: N_q = 1, H_q = {DECODE_HEADS}, "
        f"d = {DECODE_HEAD_DIM}, forward; systems: {','.join(decode_systems)} (ours where they run the dtype); "
        "the flags above from --causal to --deterministic do not apply")
    add("--decode-batch", type=comma_list(int), metavar="LIST", default="1,8,32", help="batch sizes B (default: "
        "%(default)s)")
    add("--decode-seqlens", type=comma_list(int), metavar="LIST", default="4096,32768,131072",
        help="cache lengths N_k (default: %(default)s)")
    add("--model", action="store_true", help="a compiled nanoGPT-style training step instead (MODEL), one per "
        "system: ours that take bf16 and SDPA's backends; the flags above from --dtype to --rep do not apply")
    add("--decode-kv-heads", type=comma_list(int), metavar="LIST", default="32,8", help=f"K, V heads H_kv, "
        f"divisors of H_q = {DECODE_HEADS} (default: %(default)s)")
    add("--decode-rounds", type=int, default=3, metavar="R", help="timings of each decoding row, taking turns over "
        "the systems; the row shows their median (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.quick:
        args = parser.parse_args(QUICK + argv)  # flags given come after the preset's, so they win
    args.causal = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    args.dtype = args.dtype or (["fp16", "bf16"] if args.decode else ["fp16", "bf16", "fp32"])
    given = [flag for flag, on in (("--window", args.window is not None), ("--dropout", args.dropout),
                                   ("--deterministic", args.deterministic)) if on]
    for sweep in ("--decode", "--model"):
        if getattr(args, sweep[2:]) and given:
            parser.error(f"{sweep} times its own fixed workload: {', '.join(given)} does not apply to it")
    if sum(map(bool, (args.decode, args.model, args.merge, args.plot_from))) > 1:
        parser.error("one of --decode, --model, --merge and --plot-from at a time")
    if args.decode:
        if any(DECODE_HEADS % heads for heads in args.decode_kv_heads):
            parser.error(f"--decode-kv-heads: each must divide H_q = {DECODE_HEADS}")
        if set(args.kernels or []) - set(decode_systems):
            parser.error(f"--decode runs only {','.join(decode_systems)}")
        if args.decode_rounds < 1:
            parser.error(f"--decode-rounds: at least 1, not {args.decode_rounds}")
        systems = decode_systems
    if args.model:
        model_systems = [*SDPA, *(kernel["name"] for kernel in list_kernels() if "bfloat16" in kernel["dtypes"])]
        model_systems.remove("sdpa-math")  # the N x N matrix of every layer: it runs, but says nothing here
        if set(args.kernels or []) - set(model_systems):
            parser.error(f"--model runs only {','.join(model_systems)}")
        systems = model_systems
    args.systems = [system for system in systems + eight_bit * (not args.decode and not args.model)
                    if (args.kernels is None and system not in eight_bit) or system in (args.kernels or [])]
    return args


def reference_outputs(q, k, v, do, causal, scale, window=(-1, -1), dropout=0.0, max_block_elements=2**27):
    """[O], or [O, dQ, dK, dV] when do is given, in float32 by reference.py's Algorithms 1 and 2: with blocks
    as large as keep one S_ij under max_block_elements, it is fast and exists where manual attention runs out.
    dropout: with the mask of dropout_seed = 0, as our systems run it."""
    q, k, v = (t.float() for t in (q, k, v))
    block = max(16, 2 ** int(math.log2((max_block_elements / (q.shape[0] * q.shape[1])) ** 0.5)))
    options = dict(window_size=window, dropout_p=dropout, dropout_seed=0)
    O, L = reference.flash_forward(q, k, v, causal, scale, B_r=block, B_c=block, **options)
    if do is None:
        return [O]
    return [O, *reference.flash_backward(q, k, v, O, L, do.float(), causal, scale, B_r=block, B_c=block, **options)]


def max_error(results, references):
    """Largest error over all tensors, each element measured against its row's scale.

    The unit is the row's largest |value| plus the tensor's RMS. Rows of causal attention differ in size by
    orders of magnitude: against the tensor's largest value a wrong late row would vanish, and against its
    own size rounding noise in an entry near zero would look huge. NaN stays NaN.
    """
    errors = []
    for x, ref in zip(results, references):
        unit = ref.abs().amax(dim=-1, keepdim=True) + ref.square().mean().sqrt()
        errors.append(((x.float() - ref).abs() / unit).max())
    return torch.stack(errors).max().item()


def attention_fn(system, causal, scale, window=(-1, -1), dropout=0.0, deterministic=False):
    """f(q, k, v) -> output for one system. A window goes to SDPA as a boolean N x N attn_mask; dropout to manual
    attention as torch's dropout of P. The masks are made on the first call (the check), outside the timed ones,
    as a model keeps its mask in a buffer (nanoGPT's causal `bias`)."""
    @functools.cache
    def visible(N_q, N_k, device):  # (N_q, N_k): True where a query sees a key (bottom right, as flash_attention)
        return ~reference._hidden(0, N_q, 0, N_k, device, N_k - N_q, reference._window(causal, window))
    masked = causal or window != (-1, -1)
    if system == "manual":  # nanoGPT's attention without flash: S, mask, softmax, dropout, P V
        def manual(q, k, v):
            if k.shape[1] < q.shape[1]:  # grouped-query attention (decoding): each key/value head per query head
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            S = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (None: 1/sqrt(d))
            P = torch.softmax(torch.where(visible(*S.shape[-2:], S.device), S, -math.inf) if masked else S, dim=-1)
            return (torch.nn.functional.dropout(P, dropout) if dropout else P) @ v
        return manual
    if system in SDPA and window != (-1, -1):
        def sdpa_windowed(q, k, v):
            mask = visible(q.shape[2], k.shape[2], q.device)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    dropout_p=dropout)
        return sdpa_windowed
    if system in EIGHT_BIT:
        dtype, transpose_v, timed = EIGHT_BIT[system]
        quantized = {}  # "kernel": the inputs quantized on the first call (the check), reused by the timed calls

        def eight_bit(q, k, v):
            if timed == "all":
                return flash_attention_8bit(q, k, v, causal, scale, window, dtype=dtype, transpose_v=transpose_v)
            if "x" not in quantized:
                quantized["x"] = quantize(q, k, v, dtype, transpose_v=transpose_v)
            return flash_attention_8bit(quantized["x"], causal=causal, softmax_scale=scale, window_size=window)
        return eight_bit
    if system in SDPA:  # enable_gqa: k, v have fewer heads than q (decoding); without it SDPA refuses them
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] < q.shape[1], dropout_p=dropout)
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, softmax_scale=scale, kernel=system,
                                           window_size=window, dropout_p=dropout,
                                           dropout_seed=0 if dropout else None, deterministic=deterministic)


def only_backend(system):
    """The context in which SDPA runs this system's backend alone (for SDPA's default and ours: no constraint)."""
    backend = SDPA.get(system)
    return sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()


def measure(system, inputs, refs, mode, causal, scale, tolerance, args, window=(-1, -1)):
    """Check one system against the reference, then measure its peak memory and time: part of a row."""
    attn = attention_fn(system, causal, scale, window, args.dropout, args.deterministic)
    (q, k, v, do), backend = inputs, SDPA.get(system)
    if mode != "fwd":
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        with warnings.catch_warnings(), only_backend(system):
            if backend:  # a refused backend warns at length before raising; the raise is enough
                warnings.simplefilter("ignore")
            o = attn(q, k, v)
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=mode == "bwd") if mode != "fwd" else ()
            own_mask = args.dropout and (system in SDPA or system == "manual")  # a mask of their own
            error = 0.0 if own_mask else max_error([o, *grads], refs)
            if not error <= tolerance:  # also catches NaN
                return {"status": "MISMATCH", "max_error": error, "note": f"max error {error:.2e} > {tolerance:.0e}"}
            fn = {"fwd": lambda: attn(q, k, v),  # only the work of the mode: bwd reuses the forward above
                  "bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                  "fwd_bwd": lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do)}[mode]
            torch.cuda.reset_peak_memory_stats()  # the allocator counts on the host, as calls are issued
            held = torch.cuda.memory_allocated()
            fn()
            memory, ms = torch.cuda.max_memory_allocated() - held, time_ms(fn, args.warmup, args.rep)
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # a refusing SDPA backend raises RuntimeError
        note = f"{type(exc).__name__}: {str(exc).strip()[:150]}".splitlines()[0]
        return {"status": "unsupported" if backend else "ERROR", "note": note}
    return {"status": "ok", "ms": ms, "memory_mib": memory / 2**20, "max_error": None if own_mask else error}


def add_ratios(rows, peak):
    """TFLOP/s, % of peak, and ratios to manual attention and to SDPA's fastest backend, for the rows of one
    problem, layout and mode: every ratio is between two measurements of the same run."""
    ok = {row["system"]: row for row in rows if row["status"] == "ok"}
    manual, sdpa_ms = ok.get("manual"), min((row["ms"] for s, row in ok.items() if s in SDPA), default=None)
    for row in ok.values():
        flops = attention_flops(*(row[key] for key in ("batch", "heads", "seqlen", "d", "causal", "mode")),
                                row.get("window"))
        row["tflops"] = flops / row["ms"] / 1e9  # FLOP per ms -> TFLOP/s
        row["pct_peak"] = 100 * row["tflops"] / peak if peak else None
        row["vs_sdpa"] = sdpa_ms / row["ms"] if sdpa_ms else None
        if manual:
            row.update(speedup=manual["ms"] / row["ms"], memory_saving=manual["memory_mib"] / row["memory_mib"])
    return rows


def fitting_kernels(kernels, dtype, d):
    """The names of our kernels that run dtype ("fp16", ...) with head dim d on this GPU."""
    torch_dtype = str(DTYPES[dtype]).removeprefix("torch.")  # as list_kernels() names it: float16, ...
    return {name for name, kernel in kernels.items()
            if kernel["available"] and torch_dtype in kernel["dtypes"] and d <= max(kernel["head_dims"])}


def bench_problem(problem, kernels, args, peak):
    """Yield the rows of one problem, every layout, mode and system on the same inputs."""
    causal, scale, dtype, d = problem["causal"], problem["d"] ** -0.5, problem["dtype"], problem["d"]
    window = window_of(causal, problem.get("window"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (problem["batch"], problem["heads"], problem["seqlen"], d)
    inputs = [torch.randn(shape, dtype=DTYPES[dtype], device="cuda", generator=generator) for _ in range(4)]
    refs = reference_outputs(*inputs[:3], inputs[3] if args.modes != ["fwd"] else None, causal, scale, window,
                             args.dropout)
    fits = fitting_kernels(kernels, dtype, d)
    for layout, mode in itertools.product(args.layout, args.modes):
        # The same values in both layouts; transposed holds them as (B, N, H, d) in memory.
        views = inputs if layout == "contiguous" else [t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs]
        rows = []
        for system in args.systems:
            if system in kernels and system not in fits:
                continue
            row = dict.fromkeys(ROW_FIELDS) | problem | {"layout": layout, "mode": mode, "system": system}
            if mode != "fwd" and system in kernels and kernels[system]["backward_kernel"] not in fits:
                row.update(status="unsupported", note=f"no {dtype} backward kernel (main.py would upcast to fp32)")
            elif system in EIGHT_BIT and (mode != "fwd" or dtype == "fp32" or d > max(EIGHT_BIT_HEAD_DIMS)):
                row.update(status="unsupported",
                           note=f"8-bit attention: forward only, fp16/bf16, d <= {max(EIGHT_BIT_HEAD_DIMS)}")
            elif system in EIGHT_BIT:
                row.update(measure(system, views, refs, mode, causal, scale, EIGHT_BIT_TOLERANCE, args, window))
            else:
                row.update(measure(system, views, refs, mode, causal, scale, TOLERANCE[dtype], args, window))
            rows.append(row)
            if row["status"] == "OOM":
                gc.collect()  # measure's frames are gone now: what they held is free for the next system
        yield from add_ratios(rows, peak)


def decode_memory(problem):
    """Bytes one decoding problem holds before any system runs: q, K, V (and o) in the dtype, and what
    decode_reference holds for one batch element: its K and V in float32 and, when H_kv < H_q, expanded."""
    float_heads = problem["kv_heads"] + (problem["heads"] if problem["kv_heads"] < problem["heads"] else 0)
    return decode_bytes(problem) + 2 * problem["seqlen_k"] * DECODE_HEAD_DIM * 4 * float_heads


def decode_reference(q, k, v, scale):
    """O in float32 by reference.attention, one batch element at a time: a float32 copy of the whole cache
    would need twice its memory, and H_q / H_kv times that again where reference.py expands K, V for GQA."""
    return torch.cat([reference.attention(*(t[b:b + 1].float() for t in (q, k, v)), False, scale)
                      for b in range(q.shape[0])])


def decode_inputs(problem):
    """(q, k, v, the float32 reference output), or (None, a note) where they do not fit in the GPU's free
    memory: checked before allocating, as one problem (B=32, N_k=131072, H_kv=32: 64 GiB) may fill it."""
    gc.collect()  # the last problem's cache is garbage now: hand its memory back to the GPU before counting
    torch.cuda.empty_cache()
    needed, free = decode_memory(problem), torch.cuda.mem_get_info()[0]
    note = f"needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    if needed > free:
        return None, note
    generator, dtype = torch.Generator(device="cuda").manual_seed(0), DTYPES[problem["dtype"]]
    batch, seqlen_k = problem["batch"], problem["seqlen_k"]
    try:
        q = torch.randn(batch, problem["heads"], 1, DECODE_HEAD_DIM, dtype=dtype, device="cuda", generator=generator)
        k, v = (torch.randn(batch, problem["kv_heads"], seqlen_k, DECODE_HEAD_DIM, dtype=dtype, device="cuda",
                            generator=generator) for _ in range(2))
        return (q, k, v, decode_reference(q, k, v, DECODE_HEAD_DIM ** -0.5)), None
    except torch.cuda.OutOfMemoryError:  # fragmentation, or another process took memory since
        return None, note


def add_bandwidth(rows, peak):
    """GB/s, % of the peak bandwidth (TB/s) and the ratio to SDPA's default choice, for the rows of one
    decoding problem: above 1 is faster than what scaled_dot_product_attention picks."""
    ok = {row["system"]: row for row in rows if row["status"] == "ok"}
    for row in ok.values():
        row["gbps"] = decode_bytes(row) / row["ms"] / 1e6  # bytes per ms -> GB/s
        row["pct_hbm"] = 100 * row["gbps"] / (1000 * peak) if peak else None
        row["vs_sdpa"] = ok["sdpa"]["ms"] / row["ms"] if "sdpa" in ok else None
    return rows


def bench_decode_problem(problem, kernels, args, peak):
    """Yield the rows of one decoding problem: every system on the same K, V cache, or OOM rows."""
    fits = fitting_kernels(kernels, problem["dtype"], DECODE_HEAD_DIM)
    rows = [dict.fromkeys(DECODE_ROW_FIELDS) | problem | {"system": system}
            for system in args.systems if system not in kernels or system in fits]
    inputs, note = decode_inputs(problem)
    if inputs is None:
        yield from (row | {"status": "OOM", "note": note} for row in rows)
        return
    q, k, v, ref = inputs
    for row in rows:
        result = measure(row["system"], (q, k, v, None), [ref], "fwd", False, DECODE_HEAD_DIM ** -0.5,
                         TOLERANCE[problem["dtype"]], args)
        row.update((key, value) for key, value in result.items() if key in row)  # all but the peak memory
        if row["status"] == "OOM":
            gc.collect()
    # More rounds, taking turns over the systems, and each row's median: one timing of a step of 15-50 us can be
    # several per cent off (a slow stretch of the GPU), and then the ratio to SDPA with it
    timed = [(row, attention_fn(row["system"], False, DECODE_HEAD_DIM ** -0.5), [row["ms"]])
             for row in rows if row["status"] == "ok"]
    for _ in range(args.decode_rounds - 1):
        for row, attn, times in timed:
            with only_backend(row["system"]):
                times.append(time_ms(lambda: attn(q, k, v), args.warmup, args.rep))
    for row, attn, times in timed:
        row["ms"] = statistics.median(times)
        with only_backend(row["system"]):
            row["host_us"] = host_us(lambda: attn(q, k, v), row["ms"])
    yield from add_bandwidth(rows, peak)


def host_us(fn, gpu_ms):
    """The host's time for one call of fn in microseconds (Python, checks, launches), the least of three loops of
    calls back to back: they queue on the GPU without waiting for it (the queue holds them all). A loop makes 10 to
    200 calls, about 20 ms of the GPU's time at gpu_ms a call."""
    calls = max(10, min(200, int(20 / gpu_ms)))
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def prepare(args, command, shapes, head_dims, **extra):
    """Set up a run and describe it: float32 matmuls really float32, our kernels built; returns {name: info}
    of our kernels and the run's metadata."""
    torch.backends.cuda.matmul.allow_tf32 = False  # manual attention must really be float32 in fp32 rows
    # Autograd's own thread warns when it first calls cuBLAS; that is harmless.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    kernels = {info["name"]: info for info in list_kernels()}
    for name in (name for name in args.systems if name in kernels and not kernels[name]["available"]):
        print(f"note: kernel {name} needs {kernels[name]['gpus']}; skipped on this GPU")
    build([name for name in args.systems if name in kernels and kernels[name]["available"]],  # in parallel, first
          [tile_dim(name, d) for name in kernels for d in head_dims if d <= max(kernels[name]["head_dims"])])
    timer = "main.time_ms (CUDA events, L2 flushed, the host kept ahead)"
    major, minor = torch.cuda.get_device_capability()
    metadata = {"gpu": torch.cuda.get_device_name(), "compute_capability": f"sm_{major}{minor}",
                "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                "timer": timer, "shapes": shapes,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
                **extra}
    print(f"{metadata['gpu']}, torch {metadata['torch']}, CUDA {metadata['cuda']}, timer: {timer}")
    return kernels, metadata


def run_sweep(args, command):
    """Run every requested problem; print its rows as it completes."""
    kernels, metadata = prepare(args, command, f"B={args.batch or '16384//N'}, H={args.heads or '2048//d'}", args.d)
    print(*table_lines([]), sep="\n")
    rows = []
    for dtype, d, causal, seqlen in itertools.product(args.dtype, args.d, args.causal, args.seqlens):
        batch, heads = args.batch or max(1, TOKENS // seqlen), args.heads or max(1, WIDTH // d)
        problem = {"dtype": dtype, "d": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        if args.window is not None:
            problem["window"] = args.window
        if args.dropout:
            problem["dropout"] = args.dropout
        if args.deterministic:
            problem["deterministic"] = True
        for row in bench_problem(problem, kernels, args, peak_tflops(metadata["gpu"], dtype)):
            rows.append(row)
            print(table_lines([row])[-1], flush=True)
    return metadata, rows


def run_decode(args, command):
    """Run every requested decoding problem, one K, V cache at a time; print its rows as it completes."""
    kernels, metadata = prepare(args, command, f"H_q={DECODE_HEADS}, d={DECODE_HEAD_DIM}, N_q=1", [DECODE_HEAD_DIM],
                                sweep="decode", rounds=args.decode_rounds)
    print(*table_lines([], DECODE_COLUMNS), sep="\n")
    rows = []
    for dtype, batch, seqlen_k, kv_heads in itertools.product(args.dtype, args.decode_batch, args.decode_seqlens,
                                                              args.decode_kv_heads):
        problem = {"dtype": dtype, "batch": batch, "heads": DECODE_HEADS, "kv_heads": kv_heads, "seqlen_k": seqlen_k}
        for row in bench_decode_problem(problem, kernels, args, peak_bandwidth(metadata["gpu"])):
            rows.append(row)
            print(table_lines([row], DECODE_COLUMNS)[-1], flush=True)
    return metadata, rows


class Block(torch.nn.Module):
    """nanoGPT's transformer block: causal self-attention by attend(q, k, v), then an MLP, each after a LayerNorm
    and added to the residual stream."""
    def __init__(self, width, heads, attend):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.c_attn, self.c_proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * width, width))
        self.heads, self.attend = heads, attend

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, d) views of one projection
        x = x + self.c_proj(self.attend(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(torch.nn.Module):
    """nanoGPT's GPT: token and position embeddings, the blocks, a LayerNorm and the output head tied to the token
    embedding, initialised as nanoGPT does (N(0, 0.02), zero biases); forward returns the next-token loss."""
    def __init__(self, attend, layers, width, heads, seqlen, vocab, **_):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(seqlen, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads, attend) for _ in range(layers))
        self.ln_f, self.lm_head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets):  # (B, T) token ids each
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (autocast computes the loss in float32)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bench_model_system(system, tokens):
    """One system's row: MODEL_STEPS training steps of a compiled GPT with the system's attention, from weights and
    on a batch that every system shares; the median step after warm-up, its peak memory, the first and last loss."""
    backend, row = SDPA.get(system), dict.fromkeys(MODEL_ROW_FIELDS) | {"system": system}
    torch.manual_seed(0)  # the same weights for every system
    model = GPT(attention_fn(system, causal=True, scale=None), **MODEL).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    compiled = torch.compile(model)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(MODEL_STEPS[1])]
    try:
        with only_backend(system):
            losses = [step() for _ in range(MODEL_STEPS[0])]  # the first compiles: the backend is chosen there
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for start, end in events:
                start.record()
                losses.append(step())
                end.record()
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return row | {"status": "OOM"}
    except Exception as exc:  # a refusing SDPA backend raises RuntimeError (through torch.compile's own errors)
        note = f"{type(exc).__name__}: {str(exc).strip()[:150]}".splitlines()[0]
        return row | {"status": "unsupported" if backend else "ERROR", "note": note}
    finally:
        torch._dynamo.reset()  # the next system compiles its own graphs
    ms = statistics.median_high(start.elapsed_time(end) for start, end in events)  # (one of the steps: the 11th of 20)
    return row | {"status": "ok", "ms": ms, "memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "first_loss": losses[0].item(), "last_loss": losses[-1].item()}


def add_model_ratios(rows):
    """Tokens/s, vs SDPA (the time of sdpa, its default backend, over the row's) and the loss check: each system's
    first and last loss within MODEL_LOSS_TOLERANCE of the first system's, else MISMATCH (a wrong forward or
    gradient)."""
    done = [row for row in rows if row["status"] == "ok"]
    sdpa = next((row["ms"] for row in done if row["system"] == "sdpa"), None)
    for row in done:
        row["tokens_per_s"] = MODEL["batch"] * MODEL["seqlen"] / row["ms"] * 1e3
        row["vs_sdpa"] = sdpa / row["ms"] if sdpa else None
        differences = [abs(row[key] / done[0][key] - 1) for key in ("first_loss", "last_loss")]
        worst = math.nan if any(map(math.isnan, differences)) else max(differences)  # (max skips a NaN)
        if not worst <= MODEL_LOSS_TOLERANCE:
            row["status"], row["note"] = "MISMATCH", (f"losses differ from {done[0]['system']}'s by "
                                                      f"{worst:.1e} > {MODEL_LOSS_TOLERANCE:.0e}")
    return rows


def run_model(args, command):
    """Train the GPT for MODEL_STEPS with each system's attention; print the rows."""
    shapes = ", ".join(f"{key}={value}" for key, value in MODEL.items()) + ", bf16 autocast, AdamW"
    _, metadata = prepare(args, command, shapes, [MODEL["width"] // MODEL["heads"]], sweep="model")
    generator = torch.Generator().manual_seed(0)  # the same batch for every system
    tokens = torch.randint(MODEL["vocab"], (MODEL["batch"], MODEL["seqlen"] + 1), generator=generator).cuda()
    rows = []
    for system in args.systems:
        rows.append(bench_model_system(system, tokens))
        print(table_lines(rows[-1:], MODEL_COLUMNS)[-1], flush=True)
    print("\n".join(table_lines(add_model_ratios(rows), MODEL_COLUMNS)))
    return metadata, rows


def table_lines(rows, columns=COLUMNS):
    """A markdown table whose cells are padded, so that it reads as a plain table too: header, rule, rows."""
    lines = ["| " + " | ".join(header.rjust(width) for _, header, width, _ in columns) + " | note |",
             "|" + "|".join("-" * (width + 2) for _, _, width, _ in columns) + "|---|"]
    for row in rows:
        cells = [("" if row[key] is None else fmt.format(row[key])).rjust(width) for key, _, width, fmt in columns]
        lines.append("| " + " | ".join(cells) + " | " + (row["note"] or "").replace("|", "\\|") + " |")  # | ends a cell
    return lines


def group_title(row):
    window = f", window={row['window']}" if row.get("window") is not None else ""
    window += f", dropout={row['dropout']}" if row.get("dropout") else ""
    window += ", deterministic" if row.get("deterministic") else ""
    return f"{row['mode']}, {row['dtype']}, d={row['d']}, {'causal' if row['causal'] else 'non-causal'}{window}"


def group_rows(rows):
    """{title: rows} per (mode, dtype, d, causal), in the order the groups first appear."""
    return {t: [row for row in rows if group_title(row) == t] for t in dict.fromkeys(map(group_title, rows))}


def pyplot(out_dir):
    """matplotlib.pyplot drawing to files only (it works without a display), and out_dir made."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    return plt


def write_figures(out_dir, metadata, rows):
    """One PNG per (mode, dtype, d, causal): TFLOP/s and peak memory against N, a line per system and layout."""
    plt = pyplot(out_dir)
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    systems, figures = list(dict.fromkeys(row["system"] for row in rows)), {}  # a system has one colour everywhere
    for title, group in group_rows(rows).items():
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
        for ax, field, label in zip(axes, ("tflops", "memory_mib"), ("TFLOP/s", "peak memory beyond the inputs, MiB")):
            for system, layout in dict.fromkeys((row["system"], row["layout"]) for row in group):
                points = [(row["seqlen"], row[field]) for row in group
                          if (row["system"], row["layout"]) == (system, layout) and row[field]]
                style, name = ("o-", system) if layout == "contiguous" else ("s--", f"{system} ({layout})")
                if points:
                    ax.plot(*zip(*points), style, label=name, color=colors[systems.index(system) % len(colors)])
            seqlens = sorted({row["seqlen"] for row in group})
            ax.set(xscale="log", yscale="log" if field == "memory_mib" else "linear", xlabel="sequence length N",
                   ylabel=label, xticks=seqlens, xticklabels=seqlens)
            ax.minorticks_off()
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{metadata['gpu']} | {title} | {metadata['date'][:10]} (no point: OOM, unsupported or mismatch)")
        # "fwd, fp16, d=64, non-causal" -> fwd_fp16_d64_noncausal.png
        figures[title] = out_dir / (title.replace(", ", "_").replace("=", "").replace("-", "") + ".png")
        fig.savefig(figures[title], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return figures


def write_decode_figure(out_dir, metadata, rows):
    """[decode.png]: % of peak bandwidth (GB/s where the peak is unknown) against N_k, a panel per batch size and
    dtype, a line per system and H_kv; [] without rows."""
    if not rows:
        return []
    plt = pyplot(out_dir)
    colors = plt.get_cmap("tab10").colors
    field, label = ("pct_hbm", "% of peak bandwidth") if any(row["pct_hbm"] for row in rows) else ("gbps", "GB/s")
    batches, dtypes, systems, kv_heads = (list(dict.fromkeys(row[key] for row in rows))
                                          for key in ("batch", "dtype", "system", "kv_heads"))
    fig, axes = plt.subplots(len(batches), len(dtypes), figsize=(7 * len(dtypes), 3.6 * len(batches)), squeeze=False,
                             sharey=True, layout="constrained")
    for ax, (batch, dtype) in zip(axes.flat, itertools.product(batches, dtypes)):
        group = [row for row in rows if (row["batch"], row["dtype"]) == (batch, dtype)]
        for system, heads in itertools.product(systems, kv_heads):
            points = [(row["seqlen_k"], row[field]) for row in group
                      if (row["system"], row["kv_heads"]) == (system, heads) and row[field]]
            if points:  # a colour per system, a line style per H_kv
                ax.plot(*zip(*points), ["o-", "s--", "^:", "d-."][kv_heads.index(heads) % 4],
                        color=colors[systems.index(system) % len(colors)], label=f"{system}, H_kv={heads}")
        seqlens = sorted({row["seqlen_k"] for row in group})
        ax.set(xscale="log", xlabel="cache length N_k", ylabel=label, title=f"{dtype}, B={batch}", xticks=seqlens,
               xticklabels=seqlens)
        ax.minorticks_off()
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{metadata['gpu']} | decoding, {metadata['shapes']} | {metadata['date'][:10]} "
                 "(no point: OOM, unsupported or mismatch)")
    figure = out_dir / "decode.png"
    fig.savefig(figure, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [figure]


def link(target, page):
    """target as a markdown link from page: relative, with forward slashes."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def section_bounds(lines, title=DECODE_TITLE):
    """(first, end) of a section in a page's lines: its heading up to the next # or ## heading; None where the page
    has none."""
    if title not in lines:
        return None
    first = lines.index(title)
    return first, next((i for i in range(first + 1, len(lines)) if lines[i].startswith(("# ", "## "))), len(lines))


def replace_section(page, section, title=DECODE_TITLE):
    """page with its section of that title replaced by section, or with section appended: nothing else changes."""
    lines = page.splitlines()
    first, end = section_bounds(lines, title) or (len(lines), len(lines))
    parts = ("\n".join(lines[:first]).rstrip("\n"), section.strip("\n"), "\n".join(lines[end:]))
    return "\n\n".join(part for part in parts if part) + "\n"


def how_measured(metadata, render_command, what="section"):
    """The lines that say how a page or section was measured, and how it was written if from saved results."""
    lines = ["Measured with:", "", "```", metadata["command"], "```", ""]
    if render_command != metadata["command"]:
        lines += [f"This {what} was written from the saved results with:", "", "```", render_command, "```", ""]
    return lines


def write_decode_section(path, metadata, rows, figures, results, render_command):
    """The decoding section of the benchmark page (replaced, or appended): how it was measured, then the
    figure and a table per dtype."""
    path.parent.mkdir(parents=True, exist_ok=True)
    peak = peak_bandwidth(metadata["gpu"])
    lines = [DECODE_TITLE, "",  # a sentence a line: they vary in length
             f"One new token per sequence: q is (B, H_q, 1, d), K and V a cache of N_k keys in H_kv heads "
             f"({metadata['shapes']}; H_kv < H_q is grouped-query attention), forward only.",
             f"Measured on {metadata['gpu']} on {metadata['date'][:10]} (torch {metadata['torch']}, CUDA "
             f"{metadata['cuda']}, {metadata['timer']}); `bench.py --decode` writes this section from "
             f"[{link(results, path)}]({link(results, path)}): rerun it rather than edit it.",
             "Bandwidth is the limit: decoding reads the cache once, at two FLOPs per element read, so GB/s counts "
             "the bytes of K and V once plus q and o, and %HBM compares them with the GPU's peak memory bandwidth "
             + (f"({peak} TB/s)." if peak else "(not in bench.py's table for this GPU)."),
             f"ms is the GPU's time for a step, the median of {metadata.get('rounds', 1)} timings, each over all the "
             "systems in turn before the next, and vs SDPA is the time of `sdpa` (its default backend choice) over the "
             "row's; above 1 is faster.",
             "host µs is the host's time for a call (Python, checks, launches; the least of three loops of up to 200 "
             "calls): where it exceeds ms, steps run one after another eagerly wait for the host (not when replayed "
             "from a CUDA graph).",
             "OOM: the cache and the float32 reference do not fit, or the system ran out of memory.",
             "Max err is against float32 attention on the same inputs.", ""] + how_measured(metadata, render_command)
    lines += [f"![decoding]({link(figure, path)})" for figure in figures] + [""]
    for dtype in dict.fromkeys(row["dtype"] for row in rows):
        lines += [f"### {dtype}", ""] + table_lines([row for row in rows if row["dtype"] == dtype],
                                                    [column for column in DECODE_COLUMNS if column[0] != "dtype"])
        lines += [""]
    path.write_text(replace_section(path.read_text() if path.is_file() else "", "\n".join(lines)))


def write_model_section(path, metadata, rows, results, render_command):
    """The section "Inside a model" of the benchmark page (replaced, or appended): how it was measured, the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [MODEL_TITLE, "",  # a sentence a line
             f"A whole training step of a GPT compiled by `torch.compile` ({metadata['shapes']}; nanoGPT's model), "
             "with each system as its attention: forward, loss, backward and the optimizer step, where attention "
             "is a part of the time.",
             f"Measured on {metadata['gpu']} on {metadata['date'][:10]} (torch {metadata['torch']}, CUDA "
             f"{metadata['cuda']}); `bench.py --model` writes this section from "
             f"[{link(results, path)}]({link(results, path)}): rerun it rather than edit it.",
             f"ms/step is the median (the higher middle one) of {MODEL_STEPS[1]} steps after {MODEL_STEPS[0]} of "
             "warm-up (compilation); vs SDPA is the time of `sdpa` (its default backend choice) over the row's; "
             "above 1 is faster; GiB is the peak memory allocated.",
             f"Every system starts from the same weights and trains on the same batch: loss 1 and loss "
             f"{sum(MODEL_STEPS)} must agree with the first row's within {MODEL_LOSS_TOLERANCE:.0%} (else MISMATCH).",
             ""] + how_measured(metadata, render_command) + table_lines(rows, MODEL_COLUMNS) + [""]
    path.write_text(replace_section(path.read_text() if path.is_file() else "", "\n".join(lines), MODEL_TITLE))


def write_markdown(path, metadata, rows, figures, results, render_command):
    """The benchmark page: metadata, then a figure and a table per group; the sections of the decoding sweep and of
    the training step already on the page stay (their sweeps write them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks", "",
             f"Measured on {metadata['gpu']} on {metadata['date'][:10]}. `bench.py` writes this page and its figures",
             f"from [{link(results, path)}]({link(results, path)}); rerun it rather than edit them. Speedup and memory",
             "saving are relative to manual attention (PyTorch, with the N x N matrix in memory), vs SDPA to the",
             "fastest of SDPA's backends (and its default choice), both on the same problem in the same run; above 1",
             "is better. An empty cell: that system did not run (see status). TFLOP/s counts 4·B·H·N²·d forward,",
             "halved when causal, x2.5 backward, x3.5 both. Layout contiguous: q, k, v made as (B, H, N, d);",
             "transposed: made as (B, N, H, d) and viewed as (B, H, N, d), as nanoGPT holds them.", ""]
    if any(row.get("window") is not None for row in rows):
        lines += ["A window (`--window W`): each query sees the W keys before it (and, unless causal, the W after);",
                  "SDPA and manual attention get it as an N x N mask, made once outside the timed calls (as a model",
                  "keeps it in a buffer), and TFLOP/s counts the (query, key) pairs it keeps.", ""]
    if any(row.get("dropout") for row in rows):
        lines += ["Dropout (`--dropout P`): every system drops each entry of P with probability P; SDPA and manual",
                  "attention draw their own masks, so their rows are timed but not checked (max error empty).", ""]
    if any(row["system"] in EIGHT_BIT for row in rows):
        lines += ["8-bit systems (`flash_attention_8bit`, forward only): fp8 (e4m3 wgmma, Hopper) and int8 (s8 mma.sync for",
                  "Q K^T, P V in 16 bits). `fp8`, `int8`: quantize() and the kernel, as a call on fp16/bf16 tensors runs;",
                  "`-kernel`: the kernel alone on inputs quantized once; `-vt`: V quantized already transposed (fp8's",
                  "default), else the fp8 kernel transposes each V_j as it lands. TFLOP/s",
                  "counts the same FLOPs as the 16-bit rows (and %peak uses the 16-bit peak); max err is against float32",
                  "attention, where 8-bit rounding reaches a few % of a row's scale (docs/accuracy.md).", ""]
    if any(row.get("deterministic") for row in rows):
        lines += ["`--deterministic`: our backward computes dQ without atomics (flash_attention(deterministic=True)).",
                  ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in metadata.items() if key != "command"]
    lines += [""] + how_measured(metadata, render_command, "page")
    for title, group in group_rows(rows).items():
        lines += [f"## {title}", "", f"![{title}]({link(figures[title], path)})", ""]
        lines += table_lines(group, [column for column in COLUMNS if column[0] not in GROUP_FIELDS]) + [""]
    page, old = "\n".join(lines), path.read_text().splitlines() if path.is_file() else []
    for title in SECTIONS:  # the sections of other sweeps stay
        if bounds := section_bounds(old, title):
            page = replace_section(page, "\n".join(old[slice(*bounds)]), title)
    path.write_text(page)


def problem_title(row):
    """Which problem a row measured, in words."""
    if "first_loss" in row:  # a training step's row
        return "the training step (--model)"
    if "kv_heads" in row:  # a decoding row
        return f"decoding, {row['dtype']}, B={row['batch']}, H_kv={row['kv_heads']}, N_k={row['seqlen_k']}"
    return f"{group_title(row)}, N={row['seqlen']}, {row['layout']}"


def merge_results(paths, command):
    """The rows of several results.json files (of the main sweep, on one GPU), a later file's row in place of an
    earlier one of the same problem and system, and the first file's metadata with every file's command."""
    saved = []
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"bench.py: no results file {path}")
        saved.append(json.loads(path.read_text()))
        if saved[-1]["metadata"].get("sweep") or saved[-1]["metadata"]["gpu"] != saved[0]["metadata"]["gpu"]:
            raise SystemExit(f"bench.py: --merge joins results.json files of the main sweep from one GPU; {path} is "
                             f"{saved[-1]['metadata'].get('sweep') or saved[-1]['metadata']['gpu']}")
    rows = {}
    for results in saved:
        for row in results["rows"]:
            rows[tuple(row.get(field) for field in ROW_FIELDS[:ROW_FIELDS.index("system") + 1] + EXTRA_FIELDS)] = row
    metadata = dict(saved[0]["metadata"], command="\n".join(r["metadata"]["command"] for r in saved) +
                    f"\n# (joined by {command})")
    return metadata, list(rows.values())


def cli(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, command = parse_args(argv), shlex.join(["python", "bench.py", *argv])
    if args.plot_from:
        if not args.plot_from.is_file():
            raise SystemExit(f"bench.py: no results file {args.plot_from}")
        saved, out, results = json.loads(args.plot_from.read_text()), args.out or args.plot_from.parent, args.plot_from
        metadata, rows = saved["metadata"], saved["rows"]
        sweep = metadata.get("sweep")  # the file says which sweep wrote it
        print(*table_lines(rows, {"decode": DECODE_COLUMNS, "model": MODEL_COLUMNS}.get(sweep, COLUMNS)), sep="\n")
    elif not args.merge and not torch.cuda.is_available():
        print("bench.py: no CUDA GPU found; the benchmark needs one "
              "(--plot-from FILE redraws saved results without a GPU)", file=sys.stderr)
        return 1
    else:  # measured now, or joined from saved runs (no GPU needed)
        sweep = "decode" if args.decode else "model" if args.model else None
        if args.merge:
            metadata, rows = merge_results(args.merge, command)
            print(*table_lines(rows), sep="\n")
        else:
            metadata, rows = {"decode": run_decode, "model": run_model}.get(sweep, run_sweep)(args, command)
        out = args.out or Path("bench_results")
        out.mkdir(parents=True, exist_ok=True)
        results = out / {"decode": "decode.json", "model": "model.json"}.get(sweep, "results.json")
        results.write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=1) + "\n")
    if sweep == "model":
        figures = []
        if args.markdown:
            write_model_section(args.markdown, metadata, rows, results, command)
    elif sweep == "decode":
        figures = write_decode_figure(out, metadata, rows)
        if args.markdown:
            write_decode_section(args.markdown, metadata, rows, figures, results, command)
    else:
        figures = write_figures(out, metadata, rows)
        if args.markdown:
            write_markdown(args.markdown, metadata, rows, figures, results, command)
    print(f"wrote {len(figures)} figures to {out}" + (f" and {args.markdown}" if args.markdown else ""))
    print("rows: " + ", ".join(f"{n} {status}" for status, n in Counter(row["status"] for row in rows).items()))
    problems = [row for row in rows if row["status"] in ("MISMATCH", "ERROR")]
    for row in problems:
        print(f"!! {row['status']}: {row['system']}, {problem_title(row)}: {row['note']}")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(cli())
