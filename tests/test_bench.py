"""Tests for bench.py. All but the last three run on the CPU."""
import argparse
import itertools
import json
import math
import re
import subprocess
import sys
import time
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
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H200 NVL", "fp16", 835.5),
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
    assert not args.decode
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


def save_results(path, metadata, rows):
    """path, holding results as bench.py saves them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": metadata, "rows": rows}))
    return path


def test_plot_from_writes_figures_and_page_and_reports_the_mismatch(tmp_path, capsys):
    metadata, rows = sample_results()
    results = save_results(tmp_path / "docs" / "benchmarks" / "results.json", metadata, rows)
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


def test_merge_joins_runs_a_later_row_replacing_an_earlier_one(tmp_path, capsys):
    metadata, rows = sample_results()
    first = save_results(tmp_path / "a" / "results.json", metadata, rows)
    rerun = [dict(row, ms=0.5, note="rerun") for row in rows if row["system"] == "ampere" and row["seqlen"] == 1024]
    more = [dict(row, d=128) for row in rows[:4]]  # a head dim the first run did not have
    second = save_results(tmp_path / "b" / "results.json", dict(metadata, command="python bench.py --d 128"),
                          rerun + more)
    out = tmp_path / "joined"
    assert bench.cli(["--merge", str(first), str(second), "--out", str(out)]) == 2  # (sample_results' MISMATCH)
    joined = json.loads((out / "results.json").read_text())
    assert len(joined["rows"]) == len(rows) + len(more)
    assert [row for row in joined["rows"] if row.get("note") == "rerun"] == rerun
    assert joined["metadata"]["command"].startswith(metadata["command"] + "\npython bench.py --d 128\n# (joined by")
    decode = save_results(tmp_path / "decode.json", dict(metadata, sweep="decode"), [])
    other_gpu = save_results(tmp_path / "c" / "results.json", dict(metadata, gpu="NVIDIA A100-SXM4-80GB"), rows)
    for bad in (decode, other_gpu, tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match="--merge joins|no results file"):
            bench.cli(["--merge", str(first), str(bad), "--out", str(out)])


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
    docs.mkdir()
    (docs / "benchmarks.md").write_text(page)  # a decoding section on it stays: --decode writes that
    figures = bench.write_figures(docs / "benchmarks", saved["metadata"], saved["rows"])
    shipped = {path.name for path in (ROOT / "docs" / "benchmarks").glob("*.png")}
    assert {path.name for path in figures.values()} <= shipped
    bench.write_markdown(docs / "benchmarks.md", saved["metadata"], saved["rows"], figures,
                         docs / "benchmarks" / "results.json", command)
    assert (docs / "benchmarks.md").read_text() == page, f"docs/benchmarks.md is stale: run {command}"


# ---------------------------------------------------------------- decoding

def make_decode_row(system, status="ok", ms=None, **fields):
    problem = dict(dtype="fp16", batch=8, heads=32, kv_heads=8, seqlen_k=4096)
    return dict.fromkeys(bench.DECODE_ROW_FIELDS) | problem | dict(system=system, status=status, ms=ms, **fields)


def test_decode_flags_and_their_defaults():
    args = bench.parse_args(["--decode"])
    assert args.decode
    assert (args.decode_batch, args.decode_seqlens, args.decode_kv_heads) == ([1, 8, 32], [4096, 32768, 131072],
                                                                              [32, 8])
    assert args.decode_rounds == 3  # each row the median of three timings
    assert args.dtype == ["fp16", "bf16"]  # fp32 only when asked for
    split_kv = [kernel["name"] for kernel in bench.list_kernels() if kernel["split_kv"]]  # ours that decode
    assert args.systems == [*split_kv, "sdpa", "sdpa-flash", "sdpa-cudnn", "manual"]  # manual last: the most memory
    args = bench.parse_args(["--decode", "--dtype", "bf16,fp32", "--kernels", "manual,sdpa-cudnn,sdpa",
                             "--decode-batch", "2,4", "--decode-seqlens", "1024", "--decode-kv-heads", "1,4,32",
                             "--warmup", "1", "--rep", "5", "--out", "elsewhere", "--markdown", "page.md",
                             "--decode-rounds", "1"])
    assert (args.dtype, args.systems, args.decode_rounds) == (["bf16", "fp32"], ["sdpa", "sdpa-cudnn", "manual"], 1)
    assert (args.decode_batch, args.decode_seqlens, args.decode_kv_heads) == ([2, 4], [1024], [1, 4, 32])
    assert (args.warmup, args.rep, args.out, args.markdown) == (1.0, 5.0, Path("elsewhere"), Path("page.md"))


@pytest.mark.parametrize("argv", [["--decode", "--decode-kv-heads", "32,5"],  # 5 does not divide H_q = 32
                                  ["--decode", "--decode-rounds", "0"],  # no timing
                                  ["--decode", "--kernels", "sdpa-math"],  # not a decoding system
                                  ["--decode", "--kernels", "volta"],  # no split-KV kernel
                                  ["--decode-batch", "one"], ["--decode-seqlens", ","],
                                  ["--decode", "--dropout", "0.1"], ["--decode", "--window", "64"],  # a fixed workload
                                  ["--model", "--deterministic"], ["--decode", "--model"],
                                  ["--merge", "a.json", "--plot-from", "b.json"]])
def test_bad_decode_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_decode_bytes_and_bandwidth_by_hand():
    # B=8, H_q=32, H_kv=8, N_k=4096, d=128, fp16: K and V 2*8*8*4096*128*2 = 134217728 bytes, q and o
    # 2*8*32*128*2 = 131072 bytes; in 0.05 ms that is 2686.976 GB/s, 80.2% of 3.35 TB/s.
    assert bench.decode_bytes(make_decode_row("ampere")) == 134_348_800
    assert bench.decode_bytes(make_decode_row("ampere", dtype="bf16")) == 134_348_800
    assert bench.decode_bytes(make_decode_row("ampere", dtype="fp32")) == 2 * 134_348_800
    rows = [make_decode_row("ampere", ms=0.05), make_decode_row("sdpa", ms=0.1), make_decode_row("manual", "OOM")]
    ampere, sdpa, manual = bench.add_bandwidth(rows, peak=3.35)
    assert ampere["gbps"] == pytest.approx(2686.976) and sdpa["gbps"] == pytest.approx(1343.488)
    assert ampere["pct_hbm"] == pytest.approx(80.208, abs=1e-3)
    assert (ampere["vs_sdpa"], sdpa["vs_sdpa"]) == (2.0, 1.0)  # sdpa's time over the row's
    assert manual["gbps"] is manual["pct_hbm"] is manual["vs_sdpa"] is None
    (alone,) = bench.add_bandwidth([make_decode_row("hopper", ms=0.05)], peak=None)  # no sdpa row, unknown GPU
    assert alone["gbps"] == pytest.approx(2686.976) and alone["pct_hbm"] is alone["vs_sdpa"] is None


@pytest.mark.parametrize("name, tbps", [
    ("NVIDIA H100 80GB HBM3", 3.35),  # SXM
    ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", 3.9),
    ("NVIDIA H200", 4.8),
    ("NVIDIA A100-SXM4-80GB", 2.0),
    ("NVIDIA A100 80GB PCIe", 2.0),
    ("NVIDIA A100-SXM4-40GB", 1.555),
    ("NVIDIA A100-PCIE-40GB", 1.555),
    ("NVIDIA A10G", None),
    ("Some Future GPU", None),
])
def test_peak_bandwidth_lookup(name, tbps):
    assert bench.peak_bandwidth(name) == tbps


def test_decode_memory_counts_the_cache_and_the_reference_of_one_batch_element():
    problem = {"dtype": "fp16", "batch": 32, "heads": 32, "kv_heads": 32, "seqlen_k": 131072}
    # 64 GiB of cache, 0.5 MiB of q and o, and one batch element's K and V in float32: 2*32*131072*128*4 = 4 GiB
    assert bench.decode_memory(problem) == 64 * 2**30 + 2**19 + 4 * 2**30
    # GQA: a quarter of the cache, and reference.py's float32 K and V expanded to 32 heads besides the 8
    assert bench.decode_memory(problem | {"kv_heads": 8}) == 16 * 2**30 + 2**19 + 5 * 2**30


def test_decode_reference_and_sdpa_agree_on_grouped_query_attention():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 50, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = reference.attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), False, 0.25)
    out = bench.decode_reference(q, k, v, 0.25)  # a batch element at a time, in float32
    assert out.dtype == torch.float32 and out.shape == (3, 8, 1, 16)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    sdpa = bench.attention_fn("sdpa", False, 0.25)(q, k, v)  # enable_gqa, as H_kv < H_q
    torch.testing.assert_close(sdpa, expected)


def test_a_problem_that_does_not_fit_gives_oom_rows_without_allocating(monkeypatch):
    def allocate(*args, **kwargs):
        raise AssertionError("allocated although the problem does not fit")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch, "randn", allocate)
    monkeypatch.setattr(torch, "Generator", allocate)
    kernels = {"volta": dict(available=True, dtypes=["float16"], head_dims=[64, 128]),
               "ampere": dict(available=True, dtypes=["float16", "bfloat16"], head_dims=[64, 128]),
               "hopper": dict(available=False, dtypes=["float16", "bfloat16"], head_dims=[64, 128])}
    args = argparse.Namespace(systems=["volta", "ampere", "hopper", "sdpa", "manual"])
    problem = {"dtype": "bf16", "batch": 32, "heads": 32, "kv_heads": 32, "seqlen_k": 131072}
    rows = list(bench.bench_decode_problem(problem, kernels, args, peak=3.35))
    assert [row["system"] for row in rows] == ["ampere", "sdpa", "manual"]  # ours that run bf16 on this GPU
    assert all(list(row) == bench.DECODE_ROW_FIELDS for row in rows)
    for row in rows:
        assert (row["status"], row["note"], row["ms"]) == ("OOM", "needs 68.0 GiB, 40.0 GiB free", None)
        assert (row["batch"], row["kv_heads"], row["seqlen_k"]) == (32, 32, 131072)


SECTION = bench.DECODE_TITLE + "\n\nnew tables\n"


@pytest.mark.parametrize("page, expected", [
    # in the middle: its ### subsections go with it, the next ## heading and all after it stay
    ("# Benchmarks\n\nintro\n\n" + bench.DECODE_TITLE + "\n\nold\n\n### fp16\n\nold table\n\n## fwd, fp16\n\nrest\n",
     "# Benchmarks\n\nintro\n\n" + SECTION + "\n## fwd, fp16\n\nrest\n"),
    ("# Benchmarks\n\nintro\n\n" + bench.DECODE_TITLE + "\n\nold\n", "# Benchmarks\n\nintro\n\n" + SECTION),
    ("# Benchmarks\n\nintro\n", "# Benchmarks\n\nintro\n\n" + SECTION),  # none yet: appended
    ("# Benchmarks\n\nintro", "# Benchmarks\n\nintro\n\n" + SECTION),
    ("", SECTION),
])
def test_replace_section_changes_only_the_decoding_section(page, expected):
    assert bench.replace_section(page, SECTION) == expected
    assert bench.replace_section(expected, SECTION) == expected


def sample_decode_results():
    """A small, made-up decode.json: two dtypes, with OOM, unsupported and MISMATCH rows."""
    metadata = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "sm_90", "torch": "2.11.0", "cuda": "12.8",
                "python": "3.11.7", "timer": "triton 3.5.0 do_bench", "shapes": "H_q=32, d=128, N_q=1",
                "date": "2026-01-02T03:04:05+00:00", "command": "python bench.py --decode --out docs/benchmarks",
                "sweep": "decode"}
    rows = []
    for dtype, batch, seqlen_k, kv_heads in itertools.product(("fp16", "bf16"), (1, 8), (4096, 32768), (32, 8)):
        fields = dict(dtype=dtype, batch=batch, seqlen_k=seqlen_k, kv_heads=kv_heads)
        ms = bench.decode_bytes(make_decode_row("", **fields)) / 2.5e9  # 2.5 TB/s
        group = [make_decode_row("ampere", ms=ms, **fields), make_decode_row("sdpa", ms=1.5 * ms, **fields),
                 make_decode_row("sdpa-flash", ms=1.4 * ms, **fields),
                 make_decode_row("sdpa-cudnn", "unsupported", note="RuntimeError: no", **fields),
                 make_decode_row("manual", ms=6 * ms, **fields)]
        if (batch, seqlen_k) == (8, 32768):
            group[-1].update(status="OOM", ms=None)
        if (dtype, batch, seqlen_k, kv_heads) == ("bf16", 1, 4096, 8):
            group[2].update(status="MISMATCH", ms=None, max_error=0.7, note="max error 7e-01 > 4e-01")
        rows += bench.add_bandwidth(group, peak=3.35)
    return metadata, rows


def test_plot_from_a_decode_file_replaces_only_the_decoding_section(tmp_path, capsys):
    metadata, rows = sample_decode_results()
    results = save_results(tmp_path / "docs" / "benchmarks" / "decode.json", metadata, rows)
    markdown = tmp_path / "docs" / "benchmarks.md"
    before, after = "# Benchmarks\n\nThe prefill sweep's page.\n\n", "\n\n## fwd, fp16, d=64, causal\n\nits table\n"
    markdown.write_text(before + bench.DECODE_TITLE + "\n\nold numbers" + after)
    assert bench.cli(["--plot-from", str(results), "--markdown", str(markdown)]) == 2  # the MISMATCH row
    figure = results.parent / "decode.png"  # beside the results file, as no --out was given
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 10_000
    page = markdown.read_text()
    assert page.startswith(before + bench.DECODE_TITLE + "\n") and page.endswith(after)
    section = page[len(before):-len(after)]
    assert "old numbers" not in section and section.count("\n## ") == 0
    assert "### fp16" in section and "### bf16" in section
    assert section.count("|   B | H_q | H_kv |    N_k |     system |      status |") == 2  # a table per dtype
    assert metadata["command"] in section and f"--plot-from {results}" in section  # how measured, how written
    assert "NVIDIA H100 80GB HBM3" in section and "Bandwidth is the limit" in section and "3.35 TB/s" in section
    assert "![decoding](benchmarks/decode.png)" in section
    assert "[benchmarks/decode.json](benchmarks/decode.json)" in section
    assert re.search(r"\| +8 \| +32 \| +8 \| +32768 \| +manual \| +OOM \|", section)
    assert re.search(r"\| +1 \| +32 \| +32 \| +4096 \| +ampere \| +ok \| .* \| +1\.500x \|", section)
    out = capsys.readouterr().out
    assert "!! MISMATCH: sdpa-flash, decoding, bf16, B=1, H_kv=8, N_k=4096: max error 7e-01 > 4e-01" in out


def test_the_prefill_page_keeps_its_decoding_section(tmp_path):
    metadata, rows = sample_results()
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Old page\n\n" + SECTION)
    figures = bench.write_figures(tmp_path / "benchmarks", metadata, rows)
    bench.write_markdown(markdown, metadata, rows, figures, tmp_path / "benchmarks" / "results.json",
                         metadata["command"])
    page = markdown.read_text()
    assert page.startswith("# Benchmarks\n") and "# Old page" not in page
    assert page.endswith("\n\n" + SECTION) and page.count(bench.DECODE_TITLE) == 1


# ---------------------------------------------------------------- inside a model (--model)

def test_model_flags_and_systems():
    args = bench.parse_args(["--model"])
    ours = [kernel["name"] for kernel in bench.list_kernels() if "bfloat16" in kernel["dtypes"]]
    assert args.model and args.systems == ["sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", *ours]
    assert bench.parse_args(["--model", "--kernels", "hopper,sdpa"]).systems == ["sdpa", "hopper"]  # run order
    for kernels in ("fp32", "sdpa-math", "fp8"):  # no bf16; the N x N matrix; 8-bit, forward only
        with pytest.raises(SystemExit):
            bench.parse_args(["--model", "--kernels", kernels])


def test_the_model_reads_heads_as_views_and_any_attention_gives_the_same_loss_and_gradients():
    """The GPT on the CPU, float64, with manual attention (reference.py) and with SDPA: the attention gets (B, H, T, d)
    views of one projection and returns them in the layout c_proj expects, so both give one loss and one gradient."""
    config = dict(bench.MODEL, layers=2, width=32, heads=4, seqlen=16, batch=3, vocab=50)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(config["vocab"], (config["batch"], config["seqlen"] + 1), generator=generator)
    seen, results = [], []
    for system in ("manual", "sdpa"):
        attend = bench.attention_fn(system, causal=True, scale=None)

        def spy(q, k, v, attend=attend):
            seen.append((q.shape, q.is_contiguous(), q.stride()))
            return attend(q, k, v)
        torch.manual_seed(0)
        model = bench.GPT(spy, **config).double()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert seen[0] == ((3, 4, 16, 8), False, (16 * 96, 8, 96, 1))  # a view of the (B, T, 3, H, d) projection
    assert abs(results[0][0].item() - math.log(config["vocab"])) < 0.1  # N(0, 0.02) weights: near-uniform logits
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    causal_changes = bench.GPT(bench.attention_fn("sdpa", causal=False, scale=None), **config).double()
    causal_changes.load_state_dict(model.state_dict())
    assert not torch.allclose(causal_changes(tokens[:, :-1], tokens[:, 1:]), results[1][0])  # the mask matters


def make_model_row(system, status="ok", ms=None, first=10.9, last=6.0, note=None):
    return dict.fromkeys(bench.MODEL_ROW_FIELDS) | dict(system=system, status=status, ms=ms, first_loss=first,
                                                        last_loss=last, note=note)


def test_model_rows_get_vs_sdpa_and_a_loss_check():
    rows = [make_model_row("sdpa", ms=20.0), make_model_row("sdpa-flash", "unsupported", note="RuntimeError: no"),
            make_model_row("hopper", ms=16.0, last=6.05), make_model_row("ampere", ms=25.0, last=6.5)]
    bench.add_model_ratios(rows)
    assert [row["vs_sdpa"] for row in rows] == [1.0, None, 1.25, 0.8]
    assert [row["status"] for row in rows] == ["ok", "unsupported", "ok", "MISMATCH"]
    assert rows[3]["note"] == "losses differ from sdpa's by 8.3e-02 > 2e-02"
    nan = bench.add_model_ratios([make_model_row("sdpa", ms=20.0), make_model_row("hopper", ms=1.0, last=math.nan)])
    assert nan[1]["status"] == "MISMATCH"


def test_plot_from_a_model_file_replaces_only_its_section(tmp_path, capsys):
    metadata = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "shapes": "layers=6, ...",
                "date": "2026-01-02T03:04:05+00:00", "command": "python bench.py --model", "sweep": "model"}
    rows = bench.add_model_ratios([make_model_row("sdpa", ms=20.0), make_model_row("hopper", ms=16.0)])
    results = save_results(tmp_path / "benchmarks" / "model.json", metadata, rows)
    markdown = tmp_path / "benchmarks.md"
    before, after = "# Benchmarks\n\nintro\n\n", "\n\n" + SECTION
    markdown.write_text(before + bench.MODEL_TITLE + "\n\nold numbers" + after)
    assert bench.cli(["--plot-from", str(results), "--markdown", str(markdown)]) == 0
    page = markdown.read_text()
    assert page.startswith(before + bench.MODEL_TITLE + "\n") and page.endswith(after)
    assert "old numbers" not in page and "[benchmarks/model.json](benchmarks/model.json)" in page
    assert re.search(r"\| +hopper \| +ok \| +16\.00 \| +1024000 \| +1\.25x \|", page)
    figures = bench.write_figures(tmp_path / "figures", *sample_results())  # the prefill page keeps it
    bench.write_markdown(markdown, *sample_results(), figures, tmp_path / "results.json", "python bench.py")
    assert page[len(before):].split(SECTION)[0].strip() in markdown.read_text()


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_run_on_the_gpu(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    result = run_bench("--decode", "--decode-batch", "2", "--decode-seqlens", "4096", "--warmup", "5", "--rep", "20",
                       "--out", str(tmp_path), "--markdown", str(markdown), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert {row["status"] for row in rows} <= {"ok", "unsupported"}
    assert {(row["dtype"], row["kv_heads"]) for row in rows} == set(itertools.product(("fp16", "bf16"), (32, 8)))
    ours = {k["name"] for k in bench.list_kernels() if k["available"] and k["split_kv"] and "float16" in k["dtypes"]
            and 128 in k["head_dims"]}
    for kv_heads in (32, 8):  # grouped-query attention included
        systems = {row["system"] for row in rows if row["status"] == "ok" and (row["dtype"], row["kv_heads"]) == (
            "fp16", kv_heads)}
        assert {"sdpa", "manual"} | ours <= systems
    assert all(row["gbps"] > 0 and row["vs_sdpa"] > 0 and row["host_us"] > 0 for row in rows if row["status"] == "ok")
    assert (tmp_path / "decode.png").is_file() and bench.DECODE_TITLE in markdown.read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_timer_measures_the_gpu_when_the_host_is_slower():
    x = torch.zeros(1024, device="cuda")

    def slow_host_fast_gpu():  # 300 us of the host's time, then a kernel of a few us
        start = time.perf_counter()
        while time.perf_counter() - start < 300e-6:
            pass
        x.add_(1)
    assert bench.time_ms(slow_host_fast_gpu, warmup_ms=1, rep_ms=10) < 0.05  # had the GPU waited: over 0.2
