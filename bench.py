"""Benchmark our FlashAttention kernels against manual attention and PyTorch SDPA.

Run this first to see why FlashAttention matters. For each sequence length N it
times our kernels, plain PyTorch attention that materializes the N x N score
matrix ("manual"), and each backend of torch's scaled_dot_product_attention
("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"). It reports the
median time, TFLOP/s, % of the GPU's peak, and speedup and memory saving over
manual attention, then draws one figure per (mode, dtype, head dim, causal).

Usage:
    python bench.py --quick                  # well under a minute: N=1024,4096, d=64, fp16+fp32
    python bench.py                          # full sweep: N=512..16384, d=64,128, 3 dtypes, 3 modes
    python bench.py --max-n 65536 --dtype bf16 --causal on --modes fwd
    python bench.py --kernels manual,fp32,sdpa-flash --seqlens 2048,8192 --d 64
    python bench.py --batch 4 --heads 16     # fixed B and H instead of B*N=16384, H*d=2048
    python bench.py --out docs/benchmarks --markdown docs/benchmarks.md   # regenerate the docs page
    python bench.py --plot-from bench_results/results.json                # re-plot; needs no GPU

Files written to --out (default bench_results/): results.json (metadata and
rows), results.csv (the same rows, metadata as leading "# key: value" lines;
read it with pandas.read_csv(path, comment="#")) and the PNG figures.

Row status: "ok"; "OOM" (out of GPU memory); "unsupported" (an SDPA backend
refused the input, or a kernel has no backward pass); "MISMATCH" (output or
gradients disagree with a float32 reference, so the row is not timed);
"ERROR" (the system raised). Exit status: 0, 1 without a GPU, 2 if any row is
MISMATCH or ERROR.
"""
import argparse
import contextlib
import csv
import datetime
import gc
import itertools
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

# Shapes follow FlashAttention's own benchmark: the number of tokens (B*N) and
# the model width (H*d) stay fixed, so batch and heads shrink as N grows.
TOKENS = 16384
WIDTH = 2048

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd_bwd")
# Forward is two matmuls (Q K^T and P V); backward is five (S is recomputed,
# then dV, dP, dQ, dK), hence 2.5x forward, and 3.5x for both together.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}
# Largest error allowed (see max_error). PyTorch's own fused kernels reached
# 1e-2 (fp16) and 2e-1 (bf16, dq of causal N=65536) on an H200; bf16 gets 8x
# the fp16 limit for its 3 fewer mantissa bits. A real bug (a wrong row, a
# mask off by one) gives 0.5 and more.
TOLERANCE = {"fp16": 5e-2, "bf16": 4e-1, "fp32": 1e-3}

# Dense peak TFLOP/s from NVIDIA's data sheets: tensor cores with fp32
# accumulation for fp16/bf16, plain CUDA cores for fp32 (TF32 is off here).
# Keys are matched as whole words in torch.cuda.get_device_name() and the
# first match wins, so specific names come before generic ones ("A10" does not
# match "A100" or "A10G").
PEAK_TFLOPS = [
    ("H100 PCIe", {"fp16": 756.5, "bf16": 756.5, "fp32": 51.0}),
    ("H100 NVL", {"fp16": 835.5, "bf16": 835.5, "fp32": 60.0}),
    ("H100", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
    ("H200", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
    ("A100", {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("RTX 4090", {"fp16": 165.2, "bf16": 165.2, "fp32": 82.6}),
    ("L4", {"fp16": 121.0, "bf16": 121.0, "fp32": 30.3}),
    ("A10", {"fp16": 125.0, "bf16": 125.0, "fp32": 31.2}),
]

# Presets; anything given explicitly on the command line wins over them.
FULL = {"d": [64, 128], "dtype": list(DTYPES), "modes": list(MODES), "causal": "both",
        "warmup": 25.0, "rep": 100.0}
QUICK = {"seqlens": [1024, 4096], "d": [64], "dtype": ["fp16", "fp32"],
         "modes": ["fwd", "fwd_bwd"], "causal": "off", "warmup": 5.0, "rep": 20.0}

ROW_FIELDS = ["dtype", "d", "causal", "mode", "seqlen", "batch", "heads", "system", "status",
              "ms", "tflops", "pct_peak", "speedup", "memory_mib", "memory_saving",
              "max_error", "note"]
# Terminal and markdown table: (row field, header, width, format).
COLUMNS = [("dtype", "dtype", 5, "{}"), ("d", "d", 3, "{}"), ("causal", "causal", 6, "{}"),
           ("mode", "mode", 7, "{}"), ("seqlen", "N", 5, "{}"), ("batch", "B", 3, "{}"),
           ("heads", "H", 3, "{}"), ("system", "system", 14, "{}"),
           ("status", "status", 11, "{}"), ("ms", "ms", 9, "{:.3f}"),
           ("tflops", "TFLOP/s", 7, "{:.1f}"), ("pct_peak", "%peak", 5, "{:.1f}"),
           ("speedup", "speedup", 7, "{:.2f}x"), ("memory_mib", "MiB", 7, "{:.0f}"),
           ("memory_saving", "mem saving", 10, "{:.1f}x"), ("max_error", "max err", 7, "{:.0e}")]
GROUP_FIELDS = ("mode", "dtype", "d", "causal")


def attention_flops(batch, heads, seqlen, head_dim, causal, mode):
    """FLOPs of one call: forward is 2 matmuls of 2*N*N*d each; causal skips half."""
    flops = 4 * batch * heads * seqlen**2 * head_dim
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def problem_shape(seqlen, head_dim, batch=None, heads=None):
    """(B, H) for one N: B*N = 16384 and H*d = 2048 unless given explicitly."""
    return batch or max(1, TOKENS // seqlen), heads or max(1, WIDTH // head_dim)


def peak_tflops(gpu_name, dtype_name):
    """Dense peak TFLOP/s of a GPU for a dtype, or None when not in our table."""
    for key, peaks in PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", gpu_name):
            return peaks.get(dtype_name)
    return None


def comma_list(item_type=str, choices=None):
    """argparse type for "a,b,c" lists, checked against choices."""
    def parse(text):
        items = [item_type(item.strip()) for item in text.split(",") if item.strip()]
        bad = [item for item in items if choices is not None and item not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices or ['values'])}")
        return items
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Benchmark FlashAttention kernels against manual attention and PyTorch SDPA.",
        epilog="Examples are in the docstring at the top of bench.py.")
    parser.add_argument("--quick", action="store_true",
                        help="short run: N=1024,4096, d=64, fp16+fp32, fwd+fwd_bwd, non-causal, few reps")
    parser.add_argument("--kernels", type=comma_list(), metavar="LIST",
                        help="systems to run (default: all): manual, our kernel names, "
                             + ", ".join(SDPA_BACKENDS))
    parser.add_argument("--dtype", type=comma_list(str, DTYPES), metavar="LIST",
                        help="comma list of fp16, bf16, fp32 (default: all)")
    parser.add_argument("--causal", choices=["on", "off", "both"], help="default: both")
    parser.add_argument("--d", type=comma_list(int), metavar="LIST", help="head dims (default: 64,128)")
    parser.add_argument("--modes", type=comma_list(str, MODES), metavar="LIST",
                        help="comma list of fwd, bwd, fwd_bwd (default: all)")
    parser.add_argument("--seqlens", type=comma_list(int), metavar="LIST",
                        help="explicit list of N (default: powers of two from 512 to --max-n)")
    parser.add_argument("--max-n", type=int, default=16384, help="largest N of the default sweep")
    parser.add_argument("--batch", type=int, help="fixed batch size (default: 16384 // N)")
    parser.add_argument("--heads", type=int, help="fixed number of heads (default: 2048 // d)")
    parser.add_argument("--warmup", type=float, help="warm-up time per measurement in ms (default 25)")
    parser.add_argument("--rep", type=float, help="measuring time per measurement in ms (default 100)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="directory for results.json, results.csv and figures")
    parser.add_argument("--markdown", type=Path, metavar="FILE",
                        help="also write a markdown page (e.g. docs/benchmarks.md)")
    parser.add_argument("--plot-from", type=Path, metavar="FILE",
                        help="re-plot a saved results.json instead of running (no GPU needed)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.seqlens is None:
        args.seqlens = [2**i for i in range(9, int(math.log2(max(args.max_n, 1))) + 1)]
    if not args.seqlens:
        parser.error("--max-n must be at least 512")
    args.causal = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    return args


def manual_attention(q, k, v, causal, scale, first_row=0):
    """softmax(Q K^T * scale) V in plain PyTorch, materializing the N x N matrix.

    first_row is the position of q's first row in the sequence; it is non-zero
    only when the reference works on a block of rows, so the causal mask lines up.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        rows = torch.arange(first_row, first_row + q.shape[-2], device=q.device)
        cols = torch.arange(k.shape[-2], device=q.device)
        scores = scores.masked_fill(cols > rows[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def reference_attention(q, k, v, do, causal, scale, max_elements=2**27):
    """Float32 attention output, plus (dq, dk, dv) when do is given.

    Works on blocks of query rows so that each block's scores stay under
    max_elements: the reference exists even where manual attention runs out
    of memory.
    """
    needs_grads = do is not None
    q, k, v = (t.detach().float().requires_grad_(needs_grads) for t in (q, k, v))
    batch, heads, seqlen, _ = q.shape
    block = max(1, max_elements // (batch * heads * seqlen))
    outputs, dq, dk, dv = [], [], torch.zeros_like(k), torch.zeros_like(v)
    for start in range(0, seqlen, block):
        q_block = q[:, :, start:start + block]
        o_block = manual_attention(q_block, k, v, causal, scale, first_row=start)
        outputs.append(o_block.detach())
        if needs_grads:
            grads = torch.autograd.grad(o_block, (q_block, k, v), do[:, :, start:start + block].float())
            dq.append(grads[0])
            dk += grads[1]
            dv += grads[2]
    if not needs_grads:
        return [torch.cat(outputs, dim=2)]
    return [torch.cat(outputs, dim=2), torch.cat(dq, dim=2), dk, dv]


def max_error(results, references):
    """Largest error over all tensors, each element measured against its row's scale.

    The unit is the row's largest |value| plus the tensor's RMS. Rows of causal
    attention differ in size by orders of magnitude: measured against the
    tensor's largest value a wrong late row would vanish, and measured against
    its own size rounding noise in an entry near zero would look huge. NaN
    stays NaN.
    """
    errors = []
    for x, ref in zip(results, references):
        unit = ref.abs().amax(dim=-1, keepdim=True) + ref.square().mean().sqrt()
        errors.append(((x.float() - ref).abs() / unit).max())
    return torch.stack(errors).max().item()


def attention_fn(system, causal, scale):
    """f(q, k, v) -> output for one system."""
    if system == "manual":
        return lambda q, k, v: manual_attention(q, k, v, causal, scale)
    if system in SDPA_BACKENDS:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda q, k, v: sdpa(q, k, v, is_causal=causal, scale=scale)
    from main import flash_attention
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, softmax_scale=scale, kernel=system)


@contextlib.contextmanager
def restricted_to(system):
    """Restrict SDPA to the system's backend; no-op for other systems."""
    if system not in SDPA_BACKENDS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # A refused backend warns at length before raising; the raise is enough
    # (the row says "unsupported") and the table stays readable.
    with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[system])):
        warnings.simplefilter("ignore")
        yield


def run_once(attn, q, k, v, do, mode):
    """Output, and the input gradients when the mode has a backward pass."""
    o = attn(q, k, v)
    if mode == "fwd":
        return [o]
    return [o, *torch.autograd.grad(o, (q, k, v), do)]


def timed_callable(attn, q, k, v, do, mode):
    """The function to time: only the work of the mode, nothing else."""
    if mode == "fwd":
        return lambda: attn(q, k, v)
    if mode == "bwd":
        o = attn(q, k, v)  # forward once, outside the timed region
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do)


def peak_memory(fn):
    """Bytes one call allocates at its peak beyond what was already held."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def cuda_event_median(fn, warmup_ms, rep_ms):
    """Median time in ms with CUDA events (used when triton is missing)."""
    # Writing 256 MB between calls evicts the inputs from L2 (50 MB on an H100),
    # so that small problems are not timed straight out of the cache.
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(5, int(rep_ms / estimate)))]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def make_timer(warmup_ms, rep_ms):
    """(description, timer): timer(fn) is fn's median time in ms after warm-up."""
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        return "CUDA events", lambda fn: cuda_event_median(fn, warmup_ms, rep_ms)
    # do_bench also flushes L2 before every call.
    return (f"triton {triton.__version__} do_bench",
            lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure(system, attn, inputs, refs, mode, timer, tolerance):
    """Check one system against the reference, then measure its memory and time."""
    q, k, v, do = inputs
    if mode != "fwd":
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        with restricted_to(system):
            error = max_error(run_once(attn, q, k, v, do, mode), refs)
            if not error <= tolerance:  # also catches NaN
                return {"status": "MISMATCH", "max_error": error,
                        "note": f"max error {error:.2e} > tolerance {tolerance:.0e}"}
            fn = timed_callable(attn, q, k, v, do, mode)
            memory = peak_memory(fn)
            ms = timer(fn)
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # a refusing SDPA backend raises RuntimeError
        status = "unsupported" if system in SDPA_BACKENDS else "ERROR"
        return {"status": status, "note": f"{type(exc).__name__}: {str(exc).strip()[:150]}".splitlines()[0]}
    return {"status": "ok", "ms": ms, "memory_mib": memory / 2**20, "max_error": error}


def free_memory():
    """Give memory back after an OOM so the next system starts clean."""
    gc.collect()
    torch.cuda.empty_cache()


def relative_to(row, baseline):
    """Speedup and memory saving over manual attention from the same run."""
    if baseline is None or baseline["status"] != "ok" or row["status"] != "ok":
        return {"speedup": None, "memory_saving": None}
    return {"speedup": baseline["ms"] / row["ms"],
            "memory_saving": baseline["memory_mib"] / row["memory_mib"] if row["memory_mib"] else None}


def add_throughput(row, peak):
    """Fill TFLOP/s and % of peak for a timed row."""
    if row["status"] == "ok":
        flops = attention_flops(row["batch"], row["heads"], row["seqlen"], row["d"], row["causal"], row["mode"])
        row["tflops"] = flops / row["ms"] / 1e9  # FLOP per ms -> TFLOP/s
        row["pct_peak"] = 100 * row["tflops"] / peak if peak else None
    return row


def kernel_fits(info, dtype_name, head_dim):
    """Whether one of our kernels handles this dtype and head dim on this GPU."""
    dtype = str(DTYPES[dtype_name]).removeprefix("torch.")
    return info["available"] and dtype in info["dtypes"] and head_dim in info["head_dims"]


def bench_config(config, systems, kernels, modes, timer):
    """Yield a row per (mode, system) for one problem; every system gets the same inputs."""
    dtype, causal, scale = DTYPES[config["dtype"]], config["causal"], config["d"] ** -0.5
    shape = (config["batch"], config["heads"], config["seqlen"], config["d"])
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(shape, dtype=dtype, device="cuda", generator=generator) for _ in range(4)]
    needs_grads = any(mode != "fwd" for mode in modes)
    refs = reference_attention(*inputs[:3], inputs[3] if needs_grads else None, causal, scale)
    for mode in modes:
        baseline = None
        for system in systems:
            info = kernels.get(system)
            if info is not None and not kernel_fits(info, config["dtype"], config["d"]):
                continue
            row = dict.fromkeys(ROW_FIELDS)
            row.update(config, mode=mode, system=system)
            backward = kernels.get(info["backward_kernel"]) if info is not None else None
            if mode != "fwd" and backward is not None and not kernel_fits(backward, config["dtype"], config["d"]):
                row.update(status="unsupported",
                           note=f"no backward kernel for this dtype (gradients via {backward['name']} on upcast inputs)")
            else:
                if backward is not None and backward is not info and mode != "fwd":
                    row.update(note=f"backward by the {backward['name']} kernel")
                row.update(measure(system, attention_fn(system, causal, scale), inputs, refs,
                                   mode, timer, TOLERANCE[config["dtype"]]))
            if row["status"] == "OOM":
                free_memory()
            if system == "manual":
                baseline = row
            row.update(relative_to(row, baseline))
            yield row


def select_systems(requested, kernels):
    """Systems in run order: manual first (the baseline), then ours, then SDPA."""
    known = ["manual", *kernels, *SDPA_BACKENDS]
    unknown = sorted(set(requested or []) - set(known))
    if unknown:
        raise SystemExit(f"bench.py: unknown --kernels {','.join(unknown)}; choose from {','.join(known)}")
    return [system for system in known if requested is None or system in requested]


def collect_metadata(argv, timer_name, batch, heads):
    capability = torch.cuda.get_device_capability()
    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"sm_{capability[0]}{capability[1]}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "timer": timer_name,
        "shapes": f"B={batch or '16384//N'}, H={heads or '2048//d'}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
    }


def run_sweep(args, argv):
    """Run every requested configuration; print each row as it completes."""
    from main import list_kernels  # imported here: --plot-from and the CPU tests need no kernels
    # Manual attention and the reference must really be float32 in fp32 rows.
    torch.backends.cuda.matmul.allow_tf32 = False
    # Autograd's own thread warns when it first calls cuBLAS; that is harmless.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    kernels = {info["name"]: info for info in list_kernels()}
    systems = select_systems(args.kernels, kernels)
    for name in systems:
        if name in kernels and not kernels[name]["available"]:
            print(f"note: kernel {name} needs {kernels[name]['gpus']}; skipped on this GPU")
    timer_name, timer = make_timer(args.warmup, args.rep)
    metadata = collect_metadata(argv, timer_name, args.batch, args.heads)
    print(f"{metadata['gpu']}, torch {metadata['torch']}, CUDA {metadata['cuda']}, timer: {timer_name}")
    print(table_header())
    rows = []
    for dtype_name, d, causal, seqlen in itertools.product(args.dtype, args.d, args.causal, args.seqlens):
        batch, heads = problem_shape(seqlen, d, args.batch, args.heads)
        config = {"dtype": dtype_name, "d": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        for row in bench_config(config, systems, kernels, args.modes, timer):
            rows.append(add_throughput(row, peak_tflops(metadata["gpu"], dtype_name)))
            print(format_row(row), flush=True)
    return metadata, rows


def command_line(argv):
    return shlex.join(["python", "bench.py", *argv])


def format_cell(value, fmt):
    return "" if value is None else fmt.format(value)


def table_header():
    return "  ".join(header.rjust(width) for _, header, width, _ in COLUMNS) + "  note"


def format_row(row):
    cells = [format_cell(row[key], fmt).rjust(width) for key, _, width, fmt in COLUMNS]
    return "  ".join(cells) + ("  " + row["note"] if row["note"] else "")


def write_json(path, metadata, rows):
    path.write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=1) + "\n")


def write_csv(path, metadata, rows):
    with open(path, "w", newline="") as f:
        for key, value in metadata.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def group_rows(rows):
    """{(mode, dtype, d, causal): rows}, in the order the groups first appear."""
    groups = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in GROUP_FIELDS), []).append(row)
    return groups


def group_title(key):
    mode, dtype, d, causal = key
    return f"{mode}, {dtype}, d={d}, {'causal' if causal else 'non-causal'}"


def plot_group(path, rows, title, colors):
    """One PNG: speedup, memory saving and TFLOP/s against N, a bar per system."""
    import matplotlib
    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    seqlens = sorted({row["seqlen"] for row in rows})
    systems = list(dict.fromkeys(row["system"] for row in rows))
    panels = [("speedup", "speedup over manual attention"),
              ("memory_saving", "memory saving over manual attention"),
              ("tflops", "TFLOP/s")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    for ax, (key, label) in zip(axes, panels):
        values = {system: {row["seqlen"]: row[key] for row in rows
                           if row["system"] == system and row[key] is not None} for system in systems}
        # Manual attention is the unit of the ratio panels: a bar of 1 says nothing.
        shown = [s for s in systems if values[s] and (key == "tflops" or s != "manual")]
        width = 0.8 / max(1, len(shown))
        for i, system in enumerate(shown):
            offset = (i - (len(shown) - 1) / 2) * width
            xs = [j + offset for j, n in enumerate(seqlens) if n in values[system]]
            ax.bar(xs, [values[system][n] for n in seqlens if n in values[system]], width,
                   label=system, color=colors[system])
        if key != "tflops":
            ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(seqlens)), [str(n) for n in seqlens])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.text(0.01, 0.01, "no bar: OOM, unsupported or mismatch (see the table)", fontsize=8, color="gray")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_figures(out_dir, metadata, rows):
    """One PNG per (mode, dtype, d, causal) group; returns {group key: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    palette = ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown",
               "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
    # Same colour for a system in every figure.
    systems = list(dict.fromkeys(row["system"] for row in rows))
    colors = {system: palette[i % len(palette)] for i, system in enumerate(systems)}
    figures = {}
    for key, group in group_rows(rows).items():
        mode, dtype, d, causal = key
        path = out_dir / f"{mode}_{dtype}_d{d}_{'causal' if causal else 'noncausal'}.png"
        title = f"{metadata['gpu']} | {group_title(key)} | {metadata['date'][:10]}"
        plot_group(path, group, title, colors)
        figures[key] = path
    return figures


def markdown_table(rows):
    columns = [column for column in COLUMNS if column[0] not in GROUP_FIELDS]
    lines = ["| " + " | ".join(header for _, header, _, _ in columns) + " | note |",
             "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = [format_cell(row[key], fmt) for key, _, _, fmt in columns]
        note = (row["note"] or "").replace("|", "\\|")  # a "|" would end the cell
        lines.append("| " + " | ".join(cells) + f" | {note} |")
    return lines


def write_markdown(path, metadata, rows, figures, render_command):
    """The benchmark page: metadata, then a figure and a table per group."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks", "",
             f"Measured on {metadata['gpu']} on {metadata['date'][:10]}; written by `bench.py`.",
             "Speedup and memory saving are relative to manual attention (PyTorch, materializing",
             "the N x N matrix) in the same run; an empty cell means that system or manual attention",
             "did not run (see status). TFLOP/s counts 4·B·H·N²·d for forward, halved when causal,",
             "x2.5 for backward and x3.5 for forward+backward.", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in metadata.items() if key != "command"]
    lines += ["", "Measured with:", "", "```", metadata["command"], "```", ""]
    if render_command != metadata["command"]:
        lines += ["This page was written from the saved results with:", "", "```", render_command, "```", ""]
    for key, group in group_rows(rows).items():
        figure = Path(os.path.relpath(figures[key], path.parent)).as_posix()
        lines += [f"## {group_title(key)}", "", f"![{group_title(key)}]({figure})", ""]
        lines += markdown_table(group) + [""]
    path.write_text("\n".join(lines))


def print_summary(rows):
    """Status counts, then every MISMATCH and ERROR row; returns how many of those."""
    counts = Counter(row["status"] for row in rows)
    print("rows: " + ", ".join(f"{count} {status}" for status, count in counts.items()))
    problems = [row for row in rows if row["status"] in ("MISMATCH", "ERROR")]
    for row in problems:
        print(f"!! {row['status']}: {row['system']} {group_title(tuple(row[k] for k in GROUP_FIELDS))} "
              f"N={row['seqlen']}: {row['note']}")
    return len(problems)


def cli(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot_from:
        if not args.plot_from.is_file():
            raise SystemExit(f"bench.py: no results file {args.plot_from}")
        saved = json.loads(args.plot_from.read_text())
        metadata, rows = saved["metadata"], saved["rows"]
        print(table_header())
        for row in rows:
            print(format_row(row))
    else:
        if not torch.cuda.is_available():
            print("bench.py: no CUDA GPU found; the benchmark needs one "
                  "(--plot-from FILE re-plots saved results without a GPU)", file=sys.stderr)
            return 1
        metadata, rows = run_sweep(args, argv)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "results.json", metadata, rows)
        write_csv(args.out / "results.csv", metadata, rows)
    figures = write_figures(args.out, metadata, rows)
    if args.markdown:
        write_markdown(args.markdown, metadata, rows, figures, command_line(argv))
    print(f"wrote {len(figures)} figures to {args.out}" + (f" and {args.markdown}" if args.markdown else ""))
    return 2 if print_summary(rows) else 0


if __name__ == "__main__":
    sys.exit(cli())
