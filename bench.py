"""Benchmark our FlashAttention kernels against manual attention and PyTorch SDPA; write docs/benchmarks.md.

    python bench.py --quick                  # well under a minute: N=1024,4096, d=64, fp16+fp32
    python bench.py                          # full sweep: N=512..16384, d=64,128, 3 dtypes, 3 modes, causal or not
    python bench.py --kernels manual,fp32,sdpa-flash --seqlens 2048,65536 --d 64 --causal on --modes fwd
    python bench.py --batch 4 --heads 16 --layout contiguous,transposed   # fixed B and H; also nanoGPT's layout
    python bench.py --out docs/benchmarks --markdown docs/benchmarks.md   # measure, rewrite the docs page
    python bench.py --plot-from docs/benchmarks/results.json --markdown docs/benchmarks.md   # no GPU needed

Each system is checked against a float32 reference before it is timed. Row status: ok, OOM, unsupported (an SDPA
backend refused, or a kernel has no backward for the dtype), MISMATCH (not timed), ERROR. Exit status 2 if a row
is MISMATCH or ERROR, 1 without a GPU. --out (default bench_results/) gets results.json (a table: pandas.DataFrame(
json.load(f)["rows"])) and the figures; --plot-from draws the figures beside its file.
"""
import argparse, contextlib, datetime, gc, importlib.metadata, importlib.util, itertools, json  # noqa: E401
import math, os, re, shlex, sys, warnings  # noqa: E401
from collections import Counter
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import reference
from main import build, flash_attention, list_kernels, time_ms

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
# Dense peak TFLOP/s from NVIDIA's data sheets (tensor cores with fp32 sums; CUDA cores for fp32, TF32 off). Keys
# match whole words of the GPU's name, first match wins: specific names come first ("A10" is not "A100", "A10G").
PEAK_TFLOPS = [("H100 PCIe", {"fp16": 756.5, "bf16": 756.5, "fp32": 51.0}),
               ("H100 NVL", {"fp16": 835.5, "bf16": 835.5, "fp32": 60.0}),
               ("H100", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
               ("H200", {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}),
               ("A100", {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5}), ("V100", {"fp16": 125.0, "fp32": 15.7}),
               ("T4", {"fp16": 65.0, "fp32": 8.1}), ("RTX 4090", {"fp16": 165.2, "bf16": 165.2, "fp32": 82.6}),
               ("L4", {"fp16": 121.0, "bf16": 121.0, "fp32": 30.3}),
               ("A10", {"fp16": 125.0, "bf16": 125.0, "fp32": 31.2})]
QUICK = "--seqlens 1024,4096 --d 64 --dtype fp16,fp32 --modes fwd,fwd_bwd --causal off --warmup 5 --rep 20".split()
# The fields of a row, and how the terminal and the markdown page show them: (field, header, width, format).
COLUMNS = [("dtype", "dtype", 5, "{}"), ("d", "d", 3, "{}"), ("causal", "causal", 6, "{}"), ("mode", "mode", 7, "{}"),
           ("seqlen", "N", 5, "{}"), ("batch", "B", 3, "{}"), ("heads", "H", 3, "{}"), ("layout", "layout", 10, "{}"),
           ("system", "system", 14, "{}"), ("status", "status", 11, "{}"), ("ms", "ms", 9, "{:.3f}"),
           ("tflops", "TFLOP/s", 7, "{:.1f}"), ("pct_peak", "%peak", 5, "{:.1f}"), ("speedup", "speedup", 7, "{:.2f}x"),
           ("vs_sdpa", "vs SDPA", 7, "{:.2f}x"), ("memory_mib", "MiB", 7, "{:.0f}"),
           ("memory_saving", "mem saving", 10, "{:.1f}x"), ("max_error", "max err", 7, "{:.0e}")]
ROW_FIELDS = [field for field, *_ in COLUMNS] + ["note"]
GROUP_FIELDS = ("mode", "dtype", "d", "causal")  # one figure and one markdown table each


def attention_flops(batch, heads, seqlen, head_dim, causal, mode):
    """FLOPs of one call: forward is 2 matmuls of 2*N*N*d each; causal skips half."""
    return 4 * batch * heads * seqlen**2 * head_dim / (2 if causal else 1) * MODE_FLOP_FACTOR[mode]


def peak_tflops(gpu_name, dtype_name):
    """Dense peak TFLOP/s of a GPU for a dtype, or None when not in our table."""
    matches = (peaks for key, peaks in PEAK_TFLOPS if re.search(rf"\b{re.escape(key)}\b", gpu_name))
    return next(matches, {}).get(dtype_name)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Examples: the top of bench.py.")
    add = parser.add_argument
    add("--quick", action="store_true", help=" ".join(QUICK) + " (flags given win)")
    add("--kernels", type=comma_list(str, systems), metavar="LIST", help="default: all of " + ",".join(systems))
    add("--dtype", type=comma_list(str, DTYPES), metavar="LIST", default="fp16,bf16,fp32", help="default: %(default)s")
    add("--causal", choices=["on", "off", "both"], default="both", help="default: %(default)s")
    add("--d", type=comma_list(int), metavar="LIST", default="64,128", help="head dims (default: %(default)s)")
    add("--modes", type=comma_list(str, MODE_FLOP_FACTOR), default="fwd,bwd,fwd_bwd", help="default: %(default)s")
    add("--layout", type=comma_list(str, LAYOUTS), metavar="LIST", default="contiguous", help="contiguous (q, k, v "
        "made as (B, H, N, d)), transposed (made as (B, N, H, d), then .transpose(1, 2)); default: %(default)s")
    add("--seqlens", type=comma_list(int), default="512,1024,2048,4096,8192,16384", help="sequence lengths N")
    add("--batch", type=int, help="fixed batch size (default: 16384 // N)")
    add("--heads", type=int, help="fixed number of heads (default: 2048 // d)")
    add("--warmup", type=float, default=25.0, help="warm-up per measurement in ms (default: %(default)s)")
    add("--rep", type=float, default=100.0, help="measuring time per measurement in ms (default: %(default)s)")
    add("--out", type=Path, help="folder for results.json and the figures (default: bench_results)")
    add("--markdown", type=Path, metavar="FILE", help="also write a markdown page (docs/benchmarks.md)")
    add("--plot-from", type=Path, metavar="FILE", help="redraw a saved results.json instead of running (no GPU)")
    args = parser.parse_args(argv)
    if args.quick:
        args = parser.parse_args(QUICK + argv)  # flags given come after the preset's, so they win
    args.causal = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    args.systems = [system for system in systems if args.kernels is None or system in args.kernels]
    return args


def reference_outputs(q, k, v, do, causal, scale, max_block_elements=2**27):
    """[O], or [O, dQ, dK, dV] when do is given, in float32 by reference.py's Algorithms 1 and 2: with blocks
    as large as keep one S_ij under max_block_elements, it is fast and exists where manual attention runs out."""
    q, k, v = (t.float() for t in (q, k, v))
    block = max(16, 2 ** int(math.log2((max_block_elements / (q.shape[0] * q.shape[1])) ** 0.5)))
    O, L = reference.flash_forward(q, k, v, causal, scale, B_r=block, B_c=block)
    if do is None:
        return [O]
    return [O, *reference.flash_backward(q, k, v, O, L, do.float(), causal, scale, B_r=block, B_c=block)]


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


def attention_fn(system, causal, scale):
    """f(q, k, v) -> output for one system."""
    if system == "manual":
        return lambda q, k, v: reference.attention(q, k, v, causal, scale)
    if system in SDPA:
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, softmax_scale=scale, kernel=system)


def measure(system, inputs, refs, mode, causal, scale, tolerance, args):
    """Check one system against the reference, then measure its peak memory and time: part of a row."""
    attn, (q, k, v, do), backend = attention_fn(system, causal, scale), inputs, SDPA.get(system)
    if mode != "fwd":
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        only_backend = sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()
        with warnings.catch_warnings(), only_backend:
            if backend:  # a refused backend warns at length before raising; the raise is enough
                warnings.simplefilter("ignore")
            o = attn(q, k, v)
            grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=mode == "bwd") if mode != "fwd" else ()
            error = max_error([o, *grads], refs)
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
    return {"status": "ok", "ms": ms, "memory_mib": memory / 2**20, "max_error": error}


def add_ratios(rows, peak):
    """TFLOP/s, % of peak, and ratios to manual attention and to SDPA's fastest backend, for the rows of one
    problem, layout and mode: every ratio is between two measurements of the same run."""
    ok = {row["system"]: row for row in rows if row["status"] == "ok"}
    manual, sdpa_ms = ok.get("manual"), min((row["ms"] for s, row in ok.items() if s in SDPA), default=None)
    for row in ok.values():
        flops = attention_flops(*(row[key] for key in ("batch", "heads", "seqlen", "d", "causal", "mode")))
        row["tflops"] = flops / row["ms"] / 1e9  # FLOP per ms -> TFLOP/s
        row["pct_peak"] = 100 * row["tflops"] / peak if peak else None
        row["vs_sdpa"] = sdpa_ms / row["ms"] if sdpa_ms else None
        if manual:
            row.update(speedup=manual["ms"] / row["ms"], memory_saving=manual["memory_mib"] / row["memory_mib"])
    return rows


def bench_problem(problem, kernels, args, peak):
    """Yield the rows of one problem, every layout, mode and system on the same inputs."""
    causal, scale, dtype, d = problem["causal"], problem["d"] ** -0.5, problem["dtype"], problem["d"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (problem["batch"], problem["heads"], problem["seqlen"], d)
    inputs = [torch.randn(shape, dtype=DTYPES[dtype], device="cuda", generator=generator) for _ in range(4)]
    refs = reference_outputs(*inputs[:3], inputs[3] if args.modes != ["fwd"] else None, causal, scale)
    torch_dtype = str(DTYPES[dtype]).removeprefix("torch.")  # as list_kernels() names it: float16, ...
    fits = {name for name, kernel in kernels.items()  # our kernels for this dtype and d on this GPU
            if kernel["available"] and torch_dtype in kernel["dtypes"] and d in kernel["head_dims"]}
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
            else:
                row.update(measure(system, views, refs, mode, causal, scale, TOLERANCE[dtype], args))
            rows.append(row)
            if row["status"] == "OOM":
                gc.collect()  # measure's frames are gone now: what they held is free for the next system
        yield from add_ratios(rows, peak)


def run_sweep(args, command):
    """Run every requested problem; print its rows as it completes."""
    torch.backends.cuda.matmul.allow_tf32 = False  # manual attention must really be float32 in fp32 rows
    # Autograd's own thread warns when it first calls cuBLAS; that is harmless.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    kernels = {info["name"]: info for info in list_kernels()}
    for name in (name for name in args.systems if name in kernels and not kernels[name]["available"]):
        print(f"note: kernel {name} needs {kernels[name]['gpus']}; skipped on this GPU")
    build([name for name in args.systems if name in kernels and kernels[name]["available"]])  # in parallel, first
    timer = (f"triton {importlib.metadata.version('triton')} do_bench" if importlib.util.find_spec("triton")
             else "CUDA events, L2 flushed")  # what main.time_ms uses
    major, minor = torch.cuda.get_device_capability()
    metadata = {"gpu": torch.cuda.get_device_name(), "compute_capability": f"sm_{major}{minor}",
                "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                "timer": timer, "shapes": f"B={args.batch or '16384//N'}, H={args.heads or '2048//d'}",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command}
    print(f"{metadata['gpu']}, torch {metadata['torch']}, CUDA {metadata['cuda']}, timer: {timer}")
    print(*table_lines([]), sep="\n")
    rows = []
    for dtype, d, causal, seqlen in itertools.product(args.dtype, args.d, args.causal, args.seqlens):
        batch, heads = args.batch or max(1, TOKENS // seqlen), args.heads or max(1, WIDTH // d)
        problem = {"dtype": dtype, "d": d, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        for row in bench_problem(problem, kernels, args, peak_tflops(metadata["gpu"], dtype)):
            rows.append(row)
            print(table_lines([row])[-1], flush=True)
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
    return f"{row['mode']}, {row['dtype']}, d={row['d']}, {'causal' if row['causal'] else 'non-causal'}"


def group_rows(rows):
    """{title: rows} per (mode, dtype, d, causal), in the order the groups first appear."""
    return {t: [row for row in rows if group_title(row) == t] for t in dict.fromkeys(map(group_title, rows))}


def write_figures(out_dir, metadata, rows):
    """One PNG per (mode, dtype, d, causal): TFLOP/s and peak memory against N, a line per system and layout."""
    import matplotlib
    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
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


def write_markdown(path, metadata, rows, figures, results, render_command):
    """The benchmark page: metadata, then a figure and a table per group."""
    path.parent.mkdir(parents=True, exist_ok=True)
    relative = lambda p: Path(os.path.relpath(p, path.parent)).as_posix()  # noqa: E731
    lines = ["# Benchmarks", "",
             f"Measured on {metadata['gpu']} on {metadata['date'][:10]}. `bench.py` writes this page and its figures",
             f"from [{relative(results)}]({relative(results)}); rerun it rather than edit them. Speedup and memory",
             "saving are relative to manual attention (PyTorch, with the N x N matrix in memory), vs SDPA to the",
             "fastest of SDPA's backends (and its default choice), both on the same problem in the same run; above 1",
             "is better. An empty cell: that system did not run (see status). TFLOP/s counts 4·B·H·N²·d forward,",
             "halved when causal, x2.5 backward, x3.5 both. Layout contiguous: q, k, v made as (B, H, N, d);",
             "transposed: made as (B, N, H, d) and viewed as (B, H, N, d), as nanoGPT holds them.", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in metadata.items() if key != "command"]
    lines += ["", "Measured with:", "", "```", metadata["command"], "```", ""]
    if render_command != metadata["command"]:
        lines += ["This page was written from the saved results with:", "", "```", render_command, "```", ""]
    for title, group in group_rows(rows).items():
        lines += [f"## {title}", "", f"![{title}]({relative(figures[title])})", ""]
        lines += table_lines(group, [column for column in COLUMNS if column[0] not in GROUP_FIELDS]) + [""]
    path.write_text("\n".join(lines))


def cli(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, command = parse_args(argv), shlex.join(["python", "bench.py", *argv])
    if args.plot_from:
        if not args.plot_from.is_file():
            raise SystemExit(f"bench.py: no results file {args.plot_from}")
        saved, out, results = json.loads(args.plot_from.read_text()), args.out or args.plot_from.parent, args.plot_from
        metadata, rows = saved["metadata"], saved["rows"]
        print(*table_lines(rows), sep="\n")
    elif not torch.cuda.is_available():
        print("bench.py: no CUDA GPU found; the benchmark needs one "
              "(--plot-from FILE redraws saved results without a GPU)", file=sys.stderr)
        return 1
    else:
        metadata, rows = run_sweep(args, command)
        out = args.out or Path("bench_results")
        out.mkdir(parents=True, exist_ok=True)
        results = out / "results.json"
        results.write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=1) + "\n")
    figures = write_figures(out, metadata, rows)
    if args.markdown:
        write_markdown(args.markdown, metadata, rows, figures, results, command)
    print(f"wrote {len(figures)} figures to {out}" + (f" and {args.markdown}" if args.markdown else ""))
    print("rows: " + ", ".join(f"{n} {status}" for status, n in Counter(row["status"] for row in rows).items()))
    problems = [row for row in rows if row["status"] in ("MISMATCH", "ERROR")]
    for row in problems:
        print(f"!! {row['status']}: {row['system']}, {group_title(row)}, N={row['seqlen']}, {row['layout']}: "
              f"{row['note']}")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(cli())
