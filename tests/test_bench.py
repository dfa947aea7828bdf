"""Tests for bench.py. All but the last run on the CPU."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402  (needs ROOT on sys.path)


# ---------------------------------------------------------------- FLOPs and shapes

def test_forward_flops_is_four_b_h_n2_d():
    assert bench.attention_flops(2, 3, 1024, 64, False, "fwd") == 4 * 2 * 3 * 1024**2 * 64


def test_causal_halves_the_flops():
    full = bench.attention_flops(1, 8, 4096, 128, False, "fwd")
    assert bench.attention_flops(1, 8, 4096, 128, True, "fwd") == full / 2


@pytest.mark.parametrize("mode, factor", [("fwd", 1.0), ("bwd", 2.5), ("fwd_bwd", 3.5)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_factors(mode, factor, causal):
    forward = bench.attention_flops(4, 16, 2048, 64, causal, "fwd")
    assert bench.attention_flops(4, 16, 2048, 64, causal, mode) == pytest.approx(factor * forward)


def test_shape_rule_keeps_tokens_and_width_fixed():
    assert bench.problem_shape(1024, 64) == (16, 32)
    assert bench.problem_shape(16384, 128) == (1, 16)
    assert bench.problem_shape(65536, 64) == (1, 32)  # never fewer than one sequence
    assert bench.problem_shape(1024, 64, batch=3, heads=5) == (3, 5)


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


def test_throughput_and_percent_of_peak():
    row = dict.fromkeys(bench.ROW_FIELDS)
    row.update(dtype="fp16", d=64, causal=False, mode="fwd", seqlen=1024, batch=16, heads=32,
               system="x", status="ok", ms=2.0)
    bench.add_throughput(row, peak=100.0)
    flops = 4 * 16 * 32 * 1024**2 * 64
    assert row["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert row["pct_peak"] == pytest.approx(row["tflops"])
    failed = dict(row, status="OOM", ms=None, tflops=None, pct_peak=None)
    assert bench.add_throughput(failed, peak=100.0)["tflops"] is None


def test_speedup_and_memory_saving_relative_to_manual():
    manual = {"status": "ok", "ms": 8.0, "memory_mib": 400.0}
    fast = {"status": "ok", "ms": 2.0, "memory_mib": 50.0}
    assert bench.relative_to(fast, manual) == {"speedup": 4.0, "memory_saving": 8.0}
    assert bench.relative_to(fast, {"status": "OOM"}) == {"speedup": None, "memory_saving": None}
    assert bench.relative_to(fast, None) == {"speedup": None, "memory_saving": None}


# ---------------------------------------------------------------- command line

def test_defaults_are_the_full_sweep():
    args = bench.parse_args([])
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.d == [64, 128]
    assert args.dtype == ["fp16", "bf16", "fp32"]
    assert args.causal == [False, True]
    assert args.modes == ["fwd", "bwd", "fwd_bwd"]
    assert args.kernels is None
    assert args.out == Path("bench_results")
    assert (args.batch, args.heads, args.markdown, args.plot_from) == (None, None, None, None)


def test_quick_preset():
    args = bench.parse_args(["--quick"])
    assert args.seqlens == [1024, 4096]
    assert args.d == [64]
    assert args.dtype == ["fp16", "fp32"]
    assert args.modes == ["fwd", "fwd_bwd"]
    assert args.causal == [False]
    assert args.rep < bench.FULL["rep"]


def test_explicit_flags_win_over_quick():
    args = bench.parse_args(["--quick", "--seqlens", "256", "--dtype", "bf16", "--causal", "both"])
    assert args.seqlens == [256]
    assert args.dtype == ["bf16"]
    assert args.causal == [False, True]
    assert args.d == [64]  # the rest still comes from --quick


def test_lists_and_numbers():
    args = bench.parse_args(["--kernels", "manual, sdpa-flash,fp32", "--d", "64,128", "--modes", "bwd",
                             "--causal", "on", "--batch", "2", "--heads", "8", "--max-n", "65536",
                             "--out", "elsewhere", "--markdown", "docs/benchmarks.md"])
    assert args.kernels == ["manual", "sdpa-flash", "fp32"]
    assert args.d == [64, 128]
    assert args.modes == ["bwd"]
    assert args.causal == [True]
    assert (args.batch, args.heads) == (2, 8)
    assert args.seqlens[0] == 512 and args.seqlens[-1] == 65536
    assert args.out == Path("elsewhere")
    assert args.markdown == Path("docs/benchmarks.md")


@pytest.mark.parametrize("argv", [["--modes", "forward"], ["--dtype", "fp8"], ["--causal", "yes"],
                                  ["--d", "sixty-four"], ["--max-n", "256"], ["--seqlens", ","]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_system_selection_keeps_manual_first_and_refuses_unknown_names():
    kernels = {"fp32": {}, "ampere": {}}
    assert bench.select_systems(None, kernels) == [
        "manual", "fp32", "ampere", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"]
    assert bench.select_systems(["sdpa-math", "fp32", "manual"], kernels) == ["manual", "fp32", "sdpa-math"]
    with pytest.raises(SystemExit, match="unknown --kernels nope"):
        bench.select_systems(["nope"], kernels)


def test_kernel_fits_dtype_head_dim_and_gpu():
    info = {"name": "fp32", "dtypes": ["float32"], "backward": True, "head_dims": [64, 128],
            "min_arch": 80, "available": True}
    assert bench.kernel_fits(info, "fp32", 64)
    assert not bench.kernel_fits(info, "fp16", 64)
    assert not bench.kernel_fits(info, "fp32", 96)
    assert not bench.kernel_fits(dict(info, available=False), "fp32", 64)


# ---------------------------------------------------------------- reference and checks

@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_reference_matches_manual_attention_and_autograd(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 40, 16, generator=generator) for _ in range(4))
    scale = 16 ** -0.5
    # max_elements this small forces blocks of 2 query rows, so the causal offset matters.
    out, dq, dk, dv = bench.reference_attention(q, k, v, do, causal, scale, max_elements=2 * 3 * 40 * 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = bench.manual_attention(*leaves, causal, scale)
    expected_grads = torch.autograd.grad(expected, leaves, do)
    torch.testing.assert_close(out, expected.detach())
    for got, want in zip((dq, dk, dv), expected_grads):
        torch.testing.assert_close(got, want)
    (forward_only,) = bench.reference_attention(q, k, v, None, causal, scale, max_elements=100)
    torch.testing.assert_close(forward_only, out)


def test_manual_attention_causal_first_row_only_sees_itself():
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    out = bench.manual_attention(q, k, v, causal=True, scale=0.5)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])


def test_max_error_is_measured_against_each_rows_scale():
    ref = torch.ones(4, 8)
    assert bench.max_error([ref.clone()], [ref]) == 0.0
    wrong_row = ref.clone()
    wrong_row[2] = 0.0
    # unit = row max (1) + RMS (1): the wrong row is off by one whole unit / 2
    assert bench.max_error([ref, wrong_row], [ref, ref]) == pytest.approx(0.5)
    # Rows shrinking like those of causal attention: a wrong last row, 30x
    # smaller than the first, still fails even the loosest tolerance...
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


# ---------------------------------------------------------------- writers and plots

def sample_results():
    """A small, made-up results file: two groups, with OOM, unsupported and MISMATCH rows."""
    metadata = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "sm_90", "torch": "2.11.0",
                "cuda": "12.8", "python": "3.11.7", "timer": "triton 3.5.0 do_bench",
                "shapes": "B=16384//N, H=2048//d", "date": "2026-01-02T03:04:05+00:00",
                "command": "python bench.py --quick"}
    rows = []
    for mode in ("fwd", "fwd_bwd"):
        for seqlen in (1024, 4096):
            batch, heads = bench.problem_shape(seqlen, 64)
            baseline = None
            for system, ms, mib in (("manual", 4.0, 800.0), ("ampere", 1.0, 100.0),
                                    ("sdpa-flash", 1.2, 110.0), ("sdpa-cudnn", None, None)):
                row = dict.fromkeys(bench.ROW_FIELDS)
                row.update(dtype="fp16", d=64, causal=False, mode=mode, seqlen=seqlen, batch=batch,
                           heads=heads, system=system, status="ok", ms=ms, memory_mib=mib, max_error=1e-3)
                if system == "sdpa-cudnn":
                    row.update(status="unsupported", max_error=None, note="RuntimeError: No available kernel.")
                if system == "manual" and seqlen == 4096 and mode == "fwd_bwd":
                    row.update(status="OOM", ms=None, memory_mib=None, max_error=None)
                if system == "manual":
                    baseline = row
                row.update(bench.relative_to(row, baseline))
                rows.append(bench.add_throughput(row, peak=989.4))
    rows[-2].update(status="MISMATCH", ms=None, tflops=None, pct_peak=None, speedup=None,
                    memory_mib=None, memory_saving=None, max_error=0.7,
                    note="max error 7.00e-01 > tolerance 2e-02")
    return metadata, rows


def test_json_and_csv_hold_every_row_and_the_metadata(tmp_path):
    metadata, rows = sample_results()
    bench.write_json(tmp_path / "results.json", metadata, rows)
    bench.write_csv(tmp_path / "results.csv", metadata, rows)
    assert json.loads((tmp_path / "results.json").read_text()) == {"metadata": metadata, "rows": rows}
    lines = (tmp_path / "results.csv").read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert comments[0] == "# gpu: NVIDIA H100 80GB HBM3"
    assert "# command: python bench.py --quick" in comments
    table = list(csv.DictReader(lines[len(comments):]))
    assert len(table) == len(rows)
    assert list(table[0]) == bench.ROW_FIELDS
    assert [r["status"] for r in table] == [r["status"] for r in rows]
    assert float(table[1]["speedup"]) == pytest.approx(4.0)
    assert table[3]["ms"] == ""  # unsupported: no time


def test_table_rows_line_up_with_the_header():
    metadata, rows = sample_results()
    header = bench.table_header()
    columns_end = len(header) - len("  note")
    for row in rows:
        line = bench.format_row(row)
        assert len(line) == columns_end or line[columns_end:].startswith("  " + row["note"])
        assert row["system"] in line and row["status"] in line
    ok = bench.format_row(rows[1])
    assert "4.00x" in ok and "8.0x" in ok
    assert bench.format_row(rows[3]).endswith("RuntimeError: No available kernel.")


def test_plot_from_writes_figures_markdown_and_reports_the_mismatch(tmp_path, capsys):
    metadata, rows = sample_results()
    results = tmp_path / "saved" / "results.json"
    results.parent.mkdir()
    bench.write_json(results, metadata, rows)
    out = tmp_path / "docs" / "figures"
    markdown = tmp_path / "docs" / "benchmarks.md"
    status = bench.cli(["--plot-from", str(results), "--out", str(out), "--markdown", str(markdown)])
    assert status == 2  # the sample holds a MISMATCH row
    figures = sorted(out.glob("*.png"))
    assert [f.name for f in figures] == ["fwd_bwd_fp16_d64_noncausal.png", "fwd_fp16_d64_noncausal.png"]
    for figure in figures:
        assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 10_000
    page = markdown.read_text()
    assert "![fwd, fp16, d=64, non-causal](figures/fwd_fp16_d64_noncausal.png)" in page
    assert "python bench.py --quick" in page  # how the numbers were measured
    assert f"--plot-from {results}" in page  # how the page was written
    assert "NVIDIA H100 80GB HBM3" in page and "2.11.0" in page
    assert page.count("| N | B | H | system |") == 2
    assert "| 4096 | 4 | 32 | manual | OOM |" in page
    printed = capsys.readouterr().out
    assert "!! MISMATCH: sdpa-flash fwd_bwd, fp16, d=64, non-causal N=4096" in printed


def test_plot_from_a_missing_file_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no results file"):
        bench.cli(["--plot-from", str(tmp_path / "missing.json")])


# ---------------------------------------------------------------- whole program

def run_bench(*argv, timeout=60):
    return subprocess.run([sys.executable, "bench.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_exits_1_with_one_line(tmp_path):
    result = run_bench("--quick", "--out", str(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.py: no CUDA GPU found")
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_run_on_the_gpu(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    result = run_bench("--quick", "--seqlens", "256", "--out", str(tmp_path), "--markdown", str(markdown),
                       timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    rows = saved["rows"]
    assert {row["status"] for row in rows} <= {"ok", "unsupported", "OOM"}
    assert {(row["dtype"], row["mode"]) for row in rows} == {
        ("fp16", "fwd"), ("fp16", "fwd_bwd"), ("fp32", "fwd"), ("fp32", "fwd_bwd")}
    systems = {row["system"] for row in rows if row["status"] == "ok"}
    assert {"manual", "sdpa-math"} <= systems
    from main import list_kernels
    ours = {k["name"] for k in list_kernels() if k["available"] and k["backward"] and 64 in k["head_dims"]
            and ({"float16", "float32"} & set(k["dtypes"]))}
    assert ours <= systems
    timed = [row for row in rows if row["status"] == "ok"]
    assert all(row["ms"] > 0 and row["tflops"] > 0 and row["memory_mib"] > 0 for row in timed)
    assert all(row["speedup"] is not None for row in timed)
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert (tmp_path / "results.csv").stat().st_size > 0
    assert "![" in markdown.read_text()
