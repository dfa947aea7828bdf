"""Writes docs/accuracy.md: the error of every kernel's O, dQ, dK and dV against float64, beside the error of
PyTorch's scaled_dot_product_attention (SDPA) in the same dtype on the same inputs; and its section "8-bit attention"
(--8bit: that section only, the rest left as it is). Needs a CUDA GPU:

    python docs/make_accuracy.py
    python docs/make_accuracy.py --8bit
"""
import datetime
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import reference  # noqa: E402  (the repository root is not a package)
import main  # noqa: E402
from main import flash_attention, list_kernels, outputs, rel_err  # noqa: E402

B, H = 2, 4
INTRO = """# Accuracy

FlashAttention is exact attention: it computes softmax(Q K^T · scale) V itself, with no sparsity and no
low-rank approximation. It differs from the textbook formula only in the order of its floating-point
operations (blocks of keys, the online softmax's rescaling by e^(m_old - m_new), exp2 instead of exp), so its
error is rounding error, and rounding error is measured against the same formula in float64 on the same
inputs.

## How the table is measured

For each kernel, dtype and head dim d, causal and not: q, k, v and dO are random normal, of shape
(B, H, N, d) = (2, 4, 1000, d), and also N = 4096 for fp16 at d = 64 and 128, in the kernel's dtype. O
and the gradients dQ, dK, dV of the loss sum(O · dO) are compared with `reference.attention` run in
float64 on the same (rounded) inputs, with autograd for the gradients. Each cell is

    ours / SDPA (ratio)

where "ours" is the relative Frobenius error ||x - x64|| / ||x64|| of the kernel, "SDPA" is the same error
of `torch.nn.functional.scaled_dot_product_attention` (the backend PyTorch picks by default) in the same
dtype on the same inputs, and the ratio is ours / SDPA: 1 means as accurate as PyTorch, below 1 more
accurate. The tests (`tests/test_kernels.py`, `tests/test_fuzz.py`) fail a kernel whose ratio exceeds 3
(plus a small floor for outputs that are exactly zero), against SDPA with its cuDNN backend off (its flash or
memory-efficient one: `tests/conftest.py` says why).

Every kernel accumulates in fp32: the products S_ij = Q_i K_j^T, P_ij V_j, dP_ij, the row max m_i and sum
l_i, and the gradients. fp16 and bf16 appear only as inputs, as the tensor-core operands P_ij and dS_ij,
and as outputs, so the errors are of the order of the input dtype's rounding (unit roundoff 2^-11 for
fp16, 2^-8 for bf16, 2^-24 for fp32).

One kernel gives a little of this for speed: the `hopper` forward at d >= 128 rescales lazily (m_i moves only
where a row's maximum passes it by more than 8, in base 2: notebook 08), so the largest entry of a row of P_ij
is some 2^x <= 256 instead of exactly 1, and fp16 or bf16 round it. Measured on an H100 on 2026-11-28 (B = 4,
H = 16, N = 2048, d = 128), its error in O was 1.02-1.04x SDPA's on inputs like those below, and up to 1.26x on
rows dominated by a few keys (q scaled by 3); on an H200 at d = 160, 192 and 256, 1.17-1.18x on keys that grow
along the sequence (N = 1000).

## Guarantees the tests check

`tests/test_numerics.py` checks these on every kernel and dtype:

- Determinism: two runs give bit-identical O, dK and dV. dQ is summed with fp32 atomics in an order that
  can change between runs, so its last bits can differ (the test allows a relative difference of 1e-5 for
  fp32 and 1e-3 for fp16 and bf16 between two runs).
- Large and equal scores: scores up to 1e4 (fp32) or 1e3 (fp16, bf16), whose exponentials overflow, stay
  finite and accurate, because every exponent is taken after subtracting the running row max. Equal scores
  (q = 0, or all keys equal) give the mean of the values a row sees.
- In this table no row is fully masked: q, k and v have one length and the only mask is causal, so row i
  always sees key 0 (with N_q > N_k, or a window, a row can see no key: it gets O = 0 and L = -inf); its
  largest score adds exp(0) = 1 to l_i, so l_i >= 1 and O_i = (sum of P_ij V_j) / l_i never divides by zero. Row 0 sees key 0 alone and equals v_0 exactly.
- NaN and Inf reach the rows that see them, as in SDPA: a NaN or +Inf in row r of q makes row r of O
  non-finite and no other; in row j of k or v, every row that sees key j (all rows; causal, rows i >= j).
  One exception each way: an Inf in k gives a row whose query has the opposite sign in that column a score
  of -Inf, a weight of 0 and a finite output, as in float64 (SDPA's fused kernels return non-finite
  rows there); and a masked weight is an exact 0 that still multiplies v_j in the product P V, where
  0 · NaN = NaN, so with causal masking a NaN or Inf in v_j can also turn rows i < j into NaN (in a tiled kernel, those whose tiles hold key j). Rows that stay finite are
  correct. In the backward, a NaN in row r of q makes row r of dQ non-finite, leaves the other rows of dQ
  finite and correct, and reaches dK and dV through the keys row r sees.
"""


def measure(kernel, dtype, d, N, causal):
    """(ours, SDPA) relative errors of O, dQ, dK, dV."""
    g = torch.Generator(device="cuda").manual_seed(N + d)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(4))
    exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal), q.double(), k.double(), v.double(),
                    do.double())
    ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal=causal, kernel=kernel), q, k, v, do)
    sdpa = outputs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v, do)
    return [(rel_err(x, e), rel_err(s, e)) for x, s, e in zip(ours, sdpa, exact)]


def render(table, environment):
    return f"{INTRO}\n## Results\n\n{environment}\n\n{table}\n"


def environment(command, extra=()):
    return "\n".join(["| | |", "|---|---|", f"| gpu | {torch.cuda.get_device_name()} |",
                      f"| compute capability | sm_{''.join(map(str, torch.cuda.get_device_capability()))} |",
                      f"| torch | {torch.__version__} |", f"| cuda | {torch.version.cuda} |",
                      f"| date | {datetime.date.today().isoformat()} |", f"| command | `{command}` |", *extra])


EIGHT_BIT = "## 8-bit attention"
EIGHT_BIT_INTRO = f"""{EIGHT_BIT}

`flash_attention_8bit` (flash.cu's section 8) is not exact: Q and K (and for fp8 V and P) are rounded to 8 bits,
with one scale per block of 128 rows of a head, and the fp8 kernel sums Q K^T in fp16. Its error is measured as
FlashAttention-3's paper measures it (Table 3): the RMSE of O against float64 attention on the same inputs, (B, H,
N, d) = (2, 8, 4096, d), on plain N(0, 1) inputs and on N(0, 1) inputs plus, with probability 0.001 per entry, an
outlier from N(0, 100) (standard deviation 10). Rows: the hopper kernel in fp16 (no quantization: the floor), fp8
without and with the rotation (`rotate=True`: Q and K times a random-sign Hadamard matrix, which leaves Q K^T
unchanged), and int8 without and with the rotation (Q and K in int8, K smoothed by its mean, P and V in fp16).
Non-causal. FlashAttention-3 reports 9.1e-3 for fp8 with block quantization and the rotation on the outlier inputs,
and 2.4e-2 for a plain fp8 baseline.
"""


def inputs_8bit(d, outliers, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = [torch.randn(2, 8, 4096, d, device="cuda", generator=g) for _ in range(3)]
    if outliers:
        x = [t + 10 * torch.randn(t.shape, device="cuda", generator=g) * (torch.rand(t.shape, device="cuda", generator=g)
                                                                          < 0.001) for t in x]
    return [t.half() for t in x]


def measure_8bit():
    lines = ["| d | inputs | fp16 | fp8 | fp8, rotated | int8 | int8, rotated |", "|---|---|---|---|---|---|---|"]
    for d in main.EIGHT_BIT_HEAD_DIMS:
        for outliers in (False, True):
            q, k, v = inputs_8bit(d, outliers, d + outliers)
            exact = reference.attention(q.double(), k.double(), v.double())
            rmse = lambda o: ((o.double() - exact) ** 2).mean().sqrt().item()
            cells = [rmse(flash_attention(q, k, v)), rmse(main.flash_attention_8bit(q, k, v)),
                     rmse(main.flash_attention_8bit(q, k, v, rotate=True)),
                     rmse(main.flash_attention_8bit(q, k, v, dtype=torch.int8)),
                     rmse(main.flash_attention_8bit(q, k, v, dtype=torch.int8, rotate=True))]
            lines.append(f"| {d} | {'N(0, 1) + outliers' if outliers else 'N(0, 1)'} | "
                         + " | ".join(f"{c:.1e}" for c in cells) + " |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("docs/make_accuracy.py needs a CUDA GPU; docs/accuracy.md is left as it is.")
    page = ROOT / "docs" / "accuracy.md"
    old = page.read_text() if page.exists() else ""
    kept = old[old.index(EIGHT_BIT):] if EIGHT_BIT in old else ""  # the section the other run writes
    if "--8bit" in sys.argv:
        section = f"{EIGHT_BIT_INTRO}\n{environment('python docs/make_accuracy.py --8bit')}\n\n{measure_8bit()}\n"
        page.write_text((old[:old.index(EIGHT_BIT)] if kept else old + "\n") + section)
        sys.exit(print("wrote the 8-bit section of docs/accuracy.md"))
    lines = ["| kernel | dtype | d | N | causal | O | dQ | dK | dV |", "|---|---|---|---|---|---|---|---|---|"]
    worst = (0.0, "")
    for kn in list_kernels():
        if not kn["available"]:
            continue
        for dtype in kn["dtypes"]:
            for d in kn["head_dims"]:
                for N in (1000, 4096) if dtype == "float16" and d in (64, 128) else (1000,):
                    for causal in (False, True):
                        errors = measure(kn["name"], dtype, d, N, causal)
                        cells = [f"{e:.1e} / {s:.1e} ({e / s:.2f})" for e, s in errors]
                        lines.append(f"| {kn['name']} | {dtype} | {d} | {N} | {causal} | " + " | ".join(cells) + " |")
                        for name, (e, s) in zip(["O", "dQ", "dK", "dV"], errors):
                            worst = max(worst, (e / s, f"{name}, {kn['name']} {dtype} d={d} N={N} causal={causal}"))
                        print(lines[-1], flush=True)
    notes = ("", f"The largest ratio is {worst[0]:.2f} ({worst[1]}).")
    page.write_text(render("\n".join(lines), environment("python docs/make_accuracy.py", notes))
                    + ("\n" + kept if kept else ""))
    print("wrote docs/accuracy.md")
