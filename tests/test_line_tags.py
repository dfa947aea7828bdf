"""The "l.N" tags in reference.py and flash.cu follow the line numbers of the FlashAttention-2 paper
(Dao, 2023, arXiv 2307.08691), Algorithms 1 and 2, so a reader can follow the code with the paper open.

PAPER holds the paper's numbering: line -> the step's words, and the symbols a comment on that step must
name. A tag whose comment describes its step ("l.8: S_ij = Q_i K_j^T") must name one of them; every tag must
be a line of its algorithm; reference.py tags every step. And each kernel of flash.cu reads in about 100 lines:
its steps live in functions named for them, where the tags follow them.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PAPER = {
    1: {  # Algorithm 1, FlashAttention-2 forward pass
        3: ("for 1 <= i <= T_r", ["for 1 <= i <= T_r", "i"]),
        4: ("Load Q_i from HBM to on-chip SRAM", ["Q_i"]),
        5: ("On chip, initialize O_i^(0) = 0, l_i^(0) = 0, m_i^(0) = -inf", ["O_i = 0", "l_i = 0", "m_i = -inf"]),
        6: ("for 1 <= j <= T_c", ["for 1 <= j <= T_c", "j"]),
        7: ("Load K_j, V_j from HBM to on-chip SRAM", ["K_j, V_j"]),
        8: ("On chip, compute S_i^(j) = Q_i K_j^T", ["S_ij = Q_i K_j^T"]),
        9: ("On chip, compute m_i^(j), P~_i^(j), l_i^(j)", ["m_i", "P_ij", "l_i", "softmax"]),
        10: ("On chip, compute O_i^(j) = diag(e^(m^(j-1) - m^(j))) O_i^(j-1) + P~ V_j", ["O_i"]),
        12: ("On chip, compute O_i = diag(l_i^(T_c))^-1 O_i^(T_c)", ["O_i", "l_i"]),
        13: ("On chip, compute L_i = m_i^(T_c) + log(l_i^(T_c))", ["L_i"]),
        14: ("Write O_i to HBM as the i-th block of O", ["O_i"]),
        15: ("Write L_i to HBM as the i-th block of L", ["L_i"]),
    },
    2: {  # Algorithm 2, FlashAttention-2 backward pass
        4: ("Compute D = rowsum(dO o O), write D to HBM", ["D = rowsum", "D_i = rowsum"]),
        5: ("for 1 <= j <= T_c", ["for 1 <= j <= T_c", "j"]),
        6: ("Load K_j, V_j from HBM to on-chip SRAM", ["K_j, V_j"]),
        7: ("Initialize dK_j = (0), dV_j = (0) on SRAM", ["dK_j = dV_j = 0"]),
        8: ("for 1 <= i <= T_r", ["for 1 <= i <= T_r", "i"]),
        9: ("Load Q_i, O_i, dO_i, dQ_i, L_i, D_i from HBM to on-chip SRAM", ["Q_i", "dO_i"]),
        10: ("On chip, compute S_i^(j) = Q_i K_j^T", ["S_ij"]),
        11: ("On chip, compute P_i^(j) = exp(S_ij - L_i)", ["P_ij"]),
        12: ("On chip, compute dV_j <- dV_j + (P_i^(j))^T dO_i", ["dV_j"]),
        13: ("On chip, compute dP_i^(j) = dO_i V_j^T", ["dP_ij"]),
        14: ("On chip, compute dS_i^(j) = P_i^(j) o (dP_i^(j) - D_i)", ["dS_ij"]),
        15: ("Load dQ_i from HBM to SRAM, then on chip, update dQ_i <- dQ_i + dS_i^(j) K_j", ["dQ_i"]),
        16: ("On chip, compute dK_j <- dK_j + dS_i^(j)^T Q_i", ["dK_j"]),
        18: ("Write dK_j, dV_j to HBM", ["dK_j, dV_j"]),
    },
}
TAG = re.compile(r"(?:Alg\.(\d) )?l\.(\d+)(?:-(\d+))?((?:, l\.\d+)*)(?::([^;]*))?")
BACKWARD = ("bwd", "backward", "store_rows", "copy_L_D", "preprocess")


def tags(path):
    """(function, algorithm, [line numbers], text after the colon or None) for every tag in a comment. A comment
    at column 0 right above a function (its template and __global__ lines between) is that function's heading
    and its tags are the function's; any other comment's belong to the function it follows or is in."""
    marker = "#" if path.suffix == ".py" else "//"
    function, found, heading = None, [], []

    def add(matches):
        for m in matches:
            alg = int(m.group(1) or (2 if any(w in function for w in BACKWARD) else 1))
            first, last = int(m.group(2)), int(m.group(3) or m.group(2))
            lines = list(range(first, last + 1)) + [int(x) for x in re.findall(r"\d+", m.group(4))]
            found.append((function, alg, lines, m.group(5)))

    for line in path.read_text().splitlines():
        if line.startswith(marker):  # may head the function below
            heading += TAG.finditer(line[len(marker):])
            continue
        code = line.split(marker, 1)[0]
        if (code[:1].strip() and (m := re.search(r"(\w+)\(", code)) and m.group(1) != "__launch_bounds__"
                and not code.startswith(("#", "template"))):
            function = m.group(1)
        if not code.startswith(("template", "__global__")):
            add(heading)
            heading = []
        if marker in line:
            add(TAG.finditer(line.split(marker, 1)[1]))
    return found


@pytest.mark.parametrize("file", ["reference.py", "flash.cu"])
def test_every_tag_names_its_step_in_the_paper(file):
    found = tags(ROOT / file)
    assert len(found) > 20, f"{file}: only {len(found)} tags"
    for function, alg, lines, text in found:
        for n in lines:
            assert n in PAPER[alg], f"{file}:{function}: l.{n} is not a numbered step of Algorithm {alg}"
        if text and text.strip():
            words = [w for n in lines for w in PAPER[alg][n][1]]
            assert any(w in text for w in words), (
                f"{file}:{function}: the comment of l.{lines} says {text.strip()!r}, but Algorithm {alg} line(s) "
                f"{lines} are: " + " | ".join(PAPER[alg][n][0] for n in lines))


def test_reference_tags_every_step():
    found = tags(ROOT / "reference.py")
    for alg, function, skipped in ((1, "flash_forward", {14, 15}), (2, "flash_backward", set())):
        tagged = {n for f, a, lines, _ in found if f == function and a == alg for n in lines}
        missing = set(PAPER[alg]) - skipped - tagged
        assert not missing, f"reference.py:{function} tags no line {sorted(missing)} of Algorithm {alg}"


@pytest.mark.parametrize("kernel", ["flash_fwd_fp32", "flash_fwd_volta", "flash_fwd_turing", "flash_fwd_ampere",
                                    "flash_fwd_hopper", "flash_bwd_fp32", "flash_bwd_ampere", "flash_bwd_hopper"])
def test_each_kernel_tags_its_main_steps(kernel):
    tagged = {n for f, a, lines, _ in tags(ROOT / "flash.cu") if f == kernel for n in lines}
    main_steps = {4, 7, 8, 9, 10} if "fwd" in kernel else {6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 18}
    assert main_steps <= tagged, f"{kernel} tags no line {sorted(main_steps - tagged)}"


def test_each_kernel_reads_in_about_100_lines():
    """Lines of code (not comments, not blank) of every __global__ function, from its name to its closing brace."""
    lines = (ROOT / "flash.cu").read_text().splitlines()
    sizes = {}
    for i, line in enumerate(lines):
        if "__global__" in line and not line.lstrip().startswith("//"):
            start = next(k for k in range(i, len(lines)) if re.match(r"\w+\(", lines[k]))
            end = lines.index("}", start)
            sizes[lines[start].split("(")[0]] = sum(1 for x in lines[start:end + 1] if x.strip() and not
                                                    x.strip().startswith("//"))
    assert len(sizes) >= 15 and "flash_fwd_hopper" in sizes, sorted(sizes)
    long = {k: n for k, n in sizes.items() if n > 100}
    assert not long, f"kernels past 100 lines of code (move a step into a function of its own): {long}"
