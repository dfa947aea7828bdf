"""Tests for bench.py. All but the last run on the CPU."""
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
import reference

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- FLOPs, peaks, ratios

def test_forward_flops_is_four_b_h_n2_d():
    assert bench.attention_flops(2, 3, 1024, 64, False, "fwd") == 4 * 2 * 3 * 1024**2 * 64


@pytest.mark.parametrize("mode, factor", [("fwd", 1.0), ("bwd", 2.5), ("fwd_bwd", 3.5)])
def test_causal_halves_and_backward_multiplies(mode, factor):
    forward = bench.attention_flops(4, 16, 2048, 64, False, "fwd")
    assert bench.attention_flops(4, 16, 2048, 64, False, mode) == pytest.approx(factor * forward)
    assert bench.attention_flops(4, 16, 2048, 64, True, mode) == pytest.approx(factor * forward / 2)


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "fp16", 989.4),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA A10", "fp16", 125.0),
    ("NVIDIA A10G", "fp16", None),  # not an A10, and not in the table
    ("NVIDIA L40S", "fp16", None),  # not an L4
    ("NVIDIA GeForce RTX 4090", "fp16", 165.2),
    ("Tesla T4", "bf16", None),  # no bf16 tensor cores
    ("Some Future GPU", "fp16", None),
])
def test_peak_table_lookup(name, dtype, peak):
    assert bench.peak_tflops(name, dtype) == peak


def make_row(system, status="ok", ms=None, mib=None, **fields):
    row = dict.fromkeys(bench.ROW_FIELDS)
    row.update(dtype="fp16", d=64, causal=False, mode="fwd", seqlen=1024, batch=16, heads=32, layout="contiguous",
               system=system, status=status, ms=ms, memory_mib=mib, **fields)
    return row


def test_ratios_are_to_manual_and_to_the_fastest_sdpa_backend():
    rows = [make_row("manual", ms=8.0, mib=400.0), make_row("ampere", ms=2.0, mib=50.0),
            make_row("sdpa", ms=4.0, mib=60.0), make_row("sdpa-cudnn", ms=1.0, mib=50.0),
            make_row("sdpa-flash", "unsupported"), make_row("sdpa-math", "OOM")]
    bench.add_ratios(rows, peak=100.0)
    manual, ampere, sdpa, cudnn, flash, math = rows
    flops = 4 * 16 * 32 * 1024**2 * 64
    assert ampere["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert ampere["pct_peak"] == pytest.approx(ampere["tflops"])  # peak 100 TFLOP/s
    assert (ampere["speedup"], ampere["memory_saving"]) == (4.0, 8.0)
    assert (manual["speedup"], manual["memory_saving"]) == (1.0, 1.0)
    assert ampere["vs_sdpa"] == 0.5 and sdpa["vs_sdpa"] == 0.25 and cudnn["vs_sdpa"] == 1.0  # cuDNN is the fastest
    for failed in (flash, math):
        assert failed["tflops"] is failed["speedup"] is failed["vs_sdpa"] is None


def test_ratios_stay_empty_without_manual_or_sdpa():
    rows = bench.add_ratios([make_row("manual", "OOM"), make_row("fp32", ms=2.0, mib=50.0)], peak=None)
    assert rows[1]["tflops"] > 0
    assert rows[1]["pct_peak"] is rows[1]["speedup"] is rows[1]["memory_saving"] is rows[1]["vs_sdpa"] is None


# ---------------------------------------------------------------- command line

def test_defaults_are_the_full_sweep():
    args = bench.parse_args([])
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert (args.d, args.dtype, args.causal) == ([64, 128], ["fp16", "bf16", "fp32"], [False, True])
    assert (args.modes, args.layout) == (["fwd", "bwd", "fwd_bwd"], ["contiguous"])
    assert (args.warmup, args.rep) == (25.0, 100.0)
    assert (args.batch, args.heads, args.out, args.markdown, args.plot_from) == (None,) * 5
    ours = [kernel["name"] for kernel in bench.list_kernels()]
    assert args.systems == ["manual", *ours, "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"]


def test_quick_preset_and_explicit_flags_win_over_it():
    args = bench.parse_args(["--quick"])
    assert (args.seqlens, args.d, args.dtype) == ([1024, 4096], [64], ["fp16", "fp32"])
    assert (args.modes, args.causal) == (["fwd", "fwd_bwd"], [False])
    assert args.rep < bench.parse_args([]).rep
    args = bench.parse_args(["--seqlens", "256", "--quick", "--dtype", "bf16", "--causal", "both"])
    assert (args.seqlens, args.dtype, args.causal) == ([256], ["bf16"], [False, True])
    assert args.d == [64]  # the rest still comes from --quick


def test_lists_numbers_and_layouts():
    args = bench.parse_args(["--kernels", "sdpa-flash, manual,fp32", "--d", "64,128", "--modes", "bwd",
                             "--causal", "on", "--batch", "2", "--heads", "8", "--layout", "transposed,contiguous",
                             "--out", "elsewhere", "--markdown", "docs/benchmarks.md"])
    assert args.systems == ["manual", "fp32", "sdpa-flash"]  # run order: manual first, then ours, then SDPA
    assert (args.d, args.modes, args.causal, args.batch, args.heads) == ([64, 128], ["bwd"], [True], 2, 8)
    assert args.layout == ["transposed", "contiguous"]
    assert (args.out, args.markdown) == (Path("elsewhere"), Path("docs/benchmarks.md"))


@pytest.mark.parametrize("argv", [["--modes", "forward"], ["--dtype", "fp8"], ["--causal", "yes"],
                                  ["--d", "sixty-four"], ["--seqlens", ","], ["--layout", "strided"],
                                  ["--kernels", "manual,nope"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------- reference and checks

@pytest.mark.parametrize("causal", [False, True])
def test_reference_outputs_match_dense_attention_and_autograd(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 40, 16, generator=generator, dtype=torch.float64) for _ in range(4))
    scale = 16 ** -0.5
    # This few elements per block gives blocks of 16 rows: 40 is ragged, and the causal blocks must line up.
    out, dq, dk, dv = bench.reference_outputs(q, k, v, do, causal, scale, max_block_elements=2 * 3 * 16 * 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference.attention(*leaves, causal, scale)
    expected_grads = torch.autograd.grad(expected, leaves, do)
    for got, want in zip((out, dq, dk, dv), (expected, *expected_grads)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    (forward_only,) = bench.reference_outputs(q, k, v, None, causal, scale)  # one block of all 40 rows
    torch.testing.assert_close(forward_only, out, rtol=1e-5, atol=1e-5)


def test_max_error_is_measured_against_each_rows_scale():
    ref = torch.ones(4, 8)
    assert bench.max_error([ref.clone()], [ref]) == 0.0
    wrong_row = ref.clone()
    wrong_row[2] = 0.0
    # unit = row max (1) + RMS (1): the wrong row is off by one whole unit / 2
    assert bench.max_error([ref, wrong_row], [ref, ref]) == pytest.approx(0.5)
    # Rows shrinking like those of causal attention: a wrong last row, 30x smaller than the first, still
    # fails even the loosest tolerance...
    causal_like = torch.ones(1000, 8) / torch.arange(1, 1001.0).sqrt()[:, None]
    last_row_wrong = causal_like.clone()
    last_row_wrong[-1] *= -1
    assert bench.max_error([last_row_wrong], [causal_like]) > max(bench.TOLERANCE.values())
    # ...while rounding noise in an entry near zero does not.
    near_zero = torch.tensor([[1.0, 1e-4]])
    assert bench.max_error([torch.tensor([[1.0, 5e-4]])], [near_zero]) < bench.TOLERANCE["fp32"]


def test_max_error_keeps_nan():
    ref = torch.ones(4, 8)
    broken = ref.clone()
    broken[3, 1] = float("nan")
    assert torch.tensor(bench.max_error([ref, broken], [ref, ref])).isnan()


# ---------------------------------------------------------------- tables, figures, page

def sample_results():
    """A small, made-up results file: two groups, two layouts, with OOM, unsupported and MISMATCH rows."""
    metadata = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "sm_90", "torch": "2.11.0", "cuda": "12.8",
                "python": "3.11.7", "timer": "triton 3.5.0 do_bench", "shapes": "B=16384//N, H=2048//d",
                "date": "2026-01-02T03:04:05+00:00",
                "command": "python bench.py --quick --layout contiguous,transposed"}
    rows = []
    for mode, seqlen, layout in itertools.product(("fwd", "fwd_bwd"), (1024, 4096), bench.LAYOUTS):
        group = [make_row("manual", ms=4.0, mib=800.0), make_row("ampere", ms=1.0, mib=100.0),
                 make_row("sdpa-flash", ms=1.2, mib=110.0),
                 make_row("sdpa-cudnn", "unsupported", note="RuntimeError: no")]
        if (mode, seqlen) == ("fwd_bwd", 4096):
            group[0].update(status="OOM", ms=None, memory_mib=None)
            group[2].update(status="MISMATCH", ms=None, memory_mib=None, max_error=0.7,
                            note="max error 7e-01 > 5e-02")
        for row in group:
            row.update(mode=mode, seqlen=seqlen, batch=16384 // seqlen, layout=layout)
        rows += bench.add_ratios(group, peak=989.4)
    return metadata, rows


def test_table_lines_are_a_markdown_table_whose_columns_line_up():
    _, rows = sample_results()
    header, rule, *lines = bench.table_lines(rows)
    bars = [i for i, char in enumerate(header) if char == "|"]
    assert len(bars) == len(bench.COLUMNS) + 2 and set(rule) == {"|", "-"}
    for line in [rule, *lines]:
        assert [i for i, char in enumerate(line) if char == "|"][:-1] == bars[:-1]  # all but the note's end
    assert "|  1024 |  16 |  32 | contiguous |         manual |          ok |     4.000 |" in lines[0]
    assert "   4.00x |   1.20x |     100 |       8.0x |" in lines[1]  # ampere: speedup, vs SDPA, MiB, saving
    note = bench.table_lines([dict(rows[0], note="a | b")])[-1]
    assert note.endswith("| a \\| b |")  # a "|" in a note would end its cell


def test_plot_from_writes_figures_and_page_and_reports_the_mismatch(tmp_path, capsys):
    metadata, rows = sample_results()
    results = tmp_path / "docs" / "benchmarks" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text(json.dumps({"metadata": metadata, "rows": rows}))
    markdown = tmp_path / "docs" / "benchmarks.md"
    assert bench.cli(["--plot-from", str(results), "--markdown", str(markdown)]) == 2  # the MISMATCH row
    figures = sorted(results.parent.glob("*.png"))  # beside the results file, as no --out was given
    assert [f.name for f in figures] == ["fwd_bwd_fp16_d64_noncausal.png", "fwd_fp16_d64_noncausal.png"]
    assert all(f.read_bytes().startswith(b"\x89PNG") and f.stat().st_size > 10_000 for f in figures)
    page = markdown.read_text()
    assert "![fwd, fp16, d=64, non-causal](benchmarks/fwd_fp16_d64_noncausal.png)" in page
    assert "[benchmarks/results.json](benchmarks/results.json)" in page
    assert metadata["command"] in page and f"--plot-from {results}" in page  # how measured, how written
    assert "| gpu | NVIDIA H100 80GB HBM3 |" in page and "| torch | 2.11.0 |" in page
    assert page.count("|     N |   B |   H |     layout |         system |") == 2
    assert re.search(r"\| +4096 \| +4 \| +32 \| transposed \| +manual \| +OOM \|", page)
    assert "!! MISMATCH: sdpa-flash, fwd_bwd, fp16, d=64, non-causal, N=4096, contiguous" in capsys.readouterr().out


def test_plot_from_a_missing_file_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no results file"):
        bench.cli(["--plot-from", str(tmp_path / "missing.json")])


def test_the_benchmark_page_is_what_bench_py_writes_from_results_json(tmp_path):
    """docs/benchmarks.md is generated: edit bench.py or rerun it, never the page."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    command = re.search(r"written from the saved results with:\n\n```\n(.*)\n```", page).group(1)
    saved = json.loads((ROOT / "docs" / "benchmarks" / "results.json").read_text())
    assert all(list(row) == bench.ROW_FIELDS for row in saved["rows"])
    docs = tmp_path / "docs"
    figures = bench.write_figures(docs / "benchmarks", saved["metadata"], saved["rows"])
    shipped = {path.name for path in (ROOT / "docs" / "benchmarks").glob("*.png")}
    assert {path.name for path in figures.values()} <= shipped
    bench.write_markdown(docs / "benchmarks.md", saved["metadata"], saved["rows"], figures,
                         docs / "benchmarks" / "results.json", command)
    assert (docs / "benchmarks.md").read_text() == page, f"docs/benchmarks.md is stale: run {command}"


# ---------------------------------------------------------------- whole program

def run_bench(*argv, timeout=60):
    return subprocess.run([sys.executable, "bench.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_exits_1_with_one_line(tmp_path):
    result = run_bench("--quick", "--out", str(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.py: no CUDA GPU found; the benchmark needs one")
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_run_on_the_gpu(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    result = run_bench("--quick", "--seqlens", "256", "--layout", "contiguous,transposed", "--out", str(tmp_path),
                       "--markdown", str(markdown), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {row["status"] for row in rows} <= {"ok", "unsupported", "OOM"}
    assert {(row["dtype"], row["mode"], row["layout"]) for row in rows} == {
        (dtype, mode, layout) for dtype in ("fp16", "fp32") for mode in ("fwd", "fwd_bwd") for layout in bench.LAYOUTS}
    ours = {k["name"] for k in bench.list_kernels() if k["available"] and k["backward"] and 64 in k["head_dims"]
            and ({"float16", "float32"} & set(k["dtypes"]))}
    for layout in bench.LAYOUTS:
        systems = {row["system"] for row in rows if row["status"] == "ok" and row["layout"] == layout}
        assert {"manual", "sdpa", "sdpa-math"} | ours <= systems
    timed = [row for row in rows if row["status"] == "ok"]
    assert all(row["ms"] > 0 and row["tflops"] > 0 and row["memory_mib"] > 0 for row in timed)
    assert all(row["speedup"] is not None and row["vs_sdpa"] is not None for row in timed)
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert "transposed" in markdown.read_text()
