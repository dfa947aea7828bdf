"""Grader for exercise 17: python exercises/grade.py 17

The tiles are those flash_decode_hopper copies (64 keys of K_j or V_j, fp16 or bf16) at every tile width the hopper
kernels have, d = 32 .. 256: by a box per 64-column panel, or, where d is a multiple of 64, by one box of whole rows
(tensor_map's whole_rows, tma_load_rows in flash.cu). The grader stores the boxes as TMA does, element by element,
and checks your layout against that and against the kernel's piece().
"""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _grading import ROOT, load_answer  # noqa: E402

ans = load_answer(__file__)
ROWS = 64
WIDTHS = (32, 64, 96, 128, 160, 192, 256)  # the hopper kernels' tile widths
SHAPES = [(d, whole_rows) for d in WIDTHS for whole_rows in (False, True) if not whole_rows or d % 64 == 0]


def stored(d, whole_rows):
    """The grader's TMA: {(row, column): byte of the tile, before the swizzle} for every element of the tile. A box
    stores its elements innermost dimension first, and the boxes go one after another."""
    where = {}
    if whole_rows:  # one box (64 columns, d / 64 panels, ROWS rows)
        panels = d // 64
        for row in range(ROWS):
            for panel in range(panels):
                for col in range(64):
                    where[row, 64 * panel + col] = 2 * (col + 64 * (panel + panels * row))
    else:  # a box (64 columns, ROWS rows) per panel c, at byte c * ROWS * 128
        for c in range(-(-d // 64)):
            for row in range(ROWS):
                for col in range(min(64, d - 64 * c)):
                    where[row, 64 * c + col] = c * ROWS * 128 + 2 * (col + 64 * row)
    return where


def swizzled(byte):
    """The 128-byte swizzle: 16-byte piece c of line l goes to piece c ^ (l % 8)."""
    line = byte // 128
    return line * 128 + ((byte % 128 // 16) ^ (line % 8)) * 16 + byte % 16


def expect(call, got, expected, hints):
    if got == expected and not isinstance(got, bool):
        return
    said = [h for h, wrong in hints if wrong is not None and got == wrong]
    raise AssertionError(f"{call}: expected {expected}, got {got!r}. " + " ".join(said))


@pytest.mark.parametrize("d,whole_rows", SHAPES)
def test_copies_per_tile(d, whole_rows):
    expected = 1 if whole_rows else -(-d // 64)
    expect(f"copies_per_tile({d}, whole_rows={whole_rows})", ans.copies_per_tile(d, whole_rows), expected,
           [("One box of whole rows holds all of a row's panels: one copy a tile.", d // 64 if whole_rows else None),
            ("A panel is 64 columns, and a last panel that is half full is still a box (TMA fills it with zeros).",
             d // 64 if not whole_rows and d % 64 else None)])


@pytest.mark.parametrize("d", [d for d in WIDTHS if d % 64])
def test_whole_rows_need_whole_panels(d):
    with pytest.raises(ValueError):
        ans.copies_per_tile(d, True)
        raise AssertionError(f"copies_per_tile({d}, whole_rows=True) should raise ValueError: a row of {d} columns is "
                             "not whole panels, and a box of whole rows would read past it")


@pytest.mark.parametrize("d,whole_rows", SHAPES)
def test_line(d, whole_rows):
    where = stored(d, whole_rows)
    for row in range(ROWS):
        for p in range(d // 8):
            panel, panels = p // 8, d // 64
            expect(f"line(row={row}, p={p}, d={d}, whole_rows={whole_rows})", ans.line(row, p, d, whole_rows),
                   where[row, 8 * p] // 128,
                   [("A box of whole rows stores row after row, each row its d / 64 panels: line row * (d / 64) + "
                     "panel.", panel * ROWS + row if whole_rows and panel else None),
                    ("Copied by panels, each panel is its own box of ROWS lines: line panel * ROWS + row.",
                     row * panels + panel if not whole_rows and panel and panels else None)])


@pytest.mark.parametrize("d,whole_rows", SHAPES)
def test_offset(d, whole_rows):
    where = stored(d, whole_rows)
    for row in range(ROWS):
        for p in range(d // 8):
            byte = where[row, 8 * p]
            line = byte // 128
            by_row = line * 128 + ((p % 8) ^ (row % 8)) * 16 if line % 8 != row % 8 else None
            expect(f"offset(row={row}, p={p}, d={d}, whole_rows={whole_rows})", ans.offset(row, p, d, whole_rows),
                   swizzled(byte),
                   [("The swizzle XORs the piece with the line's index mod 8, not the row's: with whole rows of more "
                     "than one panel they differ.", by_row),
                    ("TMA stores the pieces swizzled: piece c of line l at piece c ^ (l % 8).",
                     byte if swizzled(byte) != byte and byte != by_row else None)])


@pytest.mark.parametrize("d,whole_rows", SHAPES)
def test_ldmatrix_conflict(d, whole_rows):
    where, worst = stored(d, whole_rows), 1
    for r0 in range(0, ROWS, 8):
        for p in range(d // 8):
            groups = [swizzled(where[r0 + r, 8 * p]) % 128 // 16 for r in range(8)]
            worst = max(worst, max(groups.count(g) for g in groups))
    distinct = 8 // worst  # (the rows spread evenly over the groups they use)
    expect(f"ldmatrix_conflict({d}, whole_rows={whole_rows})", ans.ldmatrix_conflict(d, whole_rows), worst,
           [("That is how many groups the 8 rows use; the read takes as many passes as the most rows in one group.",
             distinct if distinct != worst else None)])


def test_against_the_kernel():
    """Your layout against flash_decode_hopper's: which copies it issues, and piece()'s line and swizzle."""
    code = re.sub(r"//[^\n]*", "", (ROOT / "flash.cu").read_text())
    kernel = code[code.index("flash_decode_hopper(Rows<const T> Q"):]
    kernel = kernel[:kernel.index("\n}\n")]
    found = re.search(r"line = whole_rows \? ([^:;]+) : ([^;]+);", kernel)
    assert found and "constexpr bool whole_rows = decode_whole_rows(d);" in kernel \
        and "constexpr bool decode_whole_rows(int d) { return d % 64 == 0; }" in code \
        and "((p % 8) ^ (line % 8)) * 16" in kernel and "tma_load_rows(K_s(s)" in kernel, \
        "flash_decode_hopper's piece() or its copies changed in flash.cu: update this grader"
    whole_line, panel_line = (compile(e.replace("panels(d)", "panels").replace("/", "//"), "piece", "eval")
                              for e in found.groups())
    for d in WIDTHS:
        whole_rows = d % 64 == 0
        assert ans.copies_per_tile(d, whole_rows) == (1 if whole_rows else -(-d // 64)), \
            f"d = {d}: the kernel copies a tile in {1 if whole_rows else -(-d // 64)} boxes"
        for row in range(ROWS):
            for p in range(d // 8):
                names = dict(row=row, p=p, panels=-(-d // 64), B_c=ROWS)
                line = eval(whole_line if whole_rows else panel_line, {}, names)
                assert ans.line(row, p, d, whole_rows) == line and \
                    ans.offset(row, p, d, whole_rows) == line * 128 + ((p % 8) ^ (line % 8)) * 16, \
                    f"d = {d}, row {row}, piece {p}: flash_decode_hopper's piece() puts it in line {line}"
