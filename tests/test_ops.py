"""flash_attention inside models: the torch.library ops (opcheck, torch.compile), inputs read in place
through their strides, the log-sum-exp L and its gradient, and grids of more than 65535 heads.

Skipped, visibly, without a CUDA GPU (the fake implementations are checked on the CPU in test_validation.py).
"""
import pytest
import torch
import torch.nn as nn

import main
from main import flash_attention, list_kernels, outputs, rel_err
import test_kernels  # tests/ is on sys.path under pytest
from test_validation import LAYOUTS, layout_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = [(k["name"], dtype) for k in list_kernels() if k["available"] for dtype in k["dtypes"]]


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_opcheck(kernel, dtype):
    # schema, fake implementation, autograd registration and torch.compile tracing, as PyTorch checks them
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
               for _ in range(3))
    torch.library.opcheck(torch.ops.flash.forward.default, (q, k, v, -1, 0, 0.125, 0.0, None, kernel))
    slopes = torch.rand(3, device="cuda")  # and with a window, a softcap and ALiBi
    torch.library.opcheck(torch.ops.flash.forward.default, (q, k, v, 20, 3, 0.125, 5.0, slopes, kernel))
    key = torch.tensor([123], device="cuda")  # and with dropout and the deterministic backward
    torch.library.opcheck(torch.ops.flash.forward.default, (q, k, v, -1, 0, 0.125, 0.0, None, kernel, 0.1, key, True))


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_L_and_its_gradient(kernel, dtype):
    # L is the natural-log row log-sum-exp, and a loss that uses L differentiates through it
    torch.manual_seed(3)
    q, k, v, do = (torch.randn(2, 3, 130, 64, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    dL = torch.randn(2, 3, 130, device="cuda")

    def loss_terms(attention, q, k, v):
        o, L = attention(q, k, v)
        return (o.double() * do.double()).sum() + (L.double() * dL.double()).sum(), L

    def exact(q, k, v):
        S = q @ k.transpose(-1, -2) / 8
        S = S.masked_fill(torch.ones(130, 130, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        return torch.softmax(S, dim=-1) @ v, torch.logsumexp(S, dim=-1)

    results = []
    for attention, inputs in ((lambda *x: flash_attention(*x, causal=True, kernel=kernel, return_lse=True), (q, k, v)),
                              (exact, [t.double() for t in (q, k, v)])):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        loss, L = loss_terms(attention, *inputs)
        results.append([L, *torch.autograd.grad(loss, inputs)])
    # SDPA returns no L to compare with: fixed bounds, ten times fp16's and bf16's unit roundoff
    bound = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}[dtype]
    for name, x, ref in zip(["L", "dQ", "dK", "dV"], *results):
        assert x.dtype == (torch.float32 if name == "L" else q.dtype)
        assert rel_err(x, ref) < bound, f"{name}: relative error {rel_err(x, ref):.1e}"


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_strided_inputs_are_read_in_place(kernel, dtype):
    torch.manual_seed(4)
    B, N, H, d = 2, 129, 3, 64
    dt = getattr(torch, dtype)
    qkv = torch.randn(B, N, 3, H, d, device="cuda", dtype=dt)        # one packed tensor, as nanoGPT and llm.c
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))     # (B, H, N, d) views, rows 3 H d apart
    do = torch.randn(B, N, H, d, device="cuda", dtype=dt).transpose(1, 2)
    assert all(main._readable(t) is t for t in (q, k, v, do)), "a strided view was copied"
    test_kernels.check(kernel, q, k, v, do, causal=True)
    o = flash_attention(*(torch.randn(B, N, H, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(3)),
                        kernel=kernel)
    assert o.stride() == (N * H * d, d, H * d, 1), f"O is not in the layout of q: strides {o.stride()}"


def test_odd_strides_are_copied_once():
    q, k, v, do = (torch.randn(1, 2, 40, 68, device="cuda", dtype=torch.float16)[..., :64] for _ in range(4))
    assert main._readable(q) is not q and main._readable(q).is_contiguous()  # rows 136 bytes apart: not 16 B
    test_kernels.check("auto", q, k, v, do, causal=False)


def test_more_than_65535_heads():
    torch.manual_seed(5)
    q, k, v, do = (torch.randn(1100, 64, 3, 64, device="cuda", dtype=torch.float16) for _ in range(4))  # B*H = 70400
    test_kernels.check("auto", q, k, v, do, causal=True)
    test_kernels.check("fp32", *(t.float() for t in (q, k, v, do)), causal=False)


class Block(nn.Module):
    """A nanoGPT-style transformer block: q, k, v are views of one packed projection, read in place."""

    def __init__(self, width=256, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):                                              # (B, N, width)
        B, N, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, C // self.heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))    # (B, H, N, d)
        y = flash_attention(q, k, v, causal=True)                      # (B, H, N, d)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.ln2(x))


@pytest.mark.parametrize("fullgraph", [True, False])
def test_torch_compile_matches_eager(fullgraph):
    torch.manual_seed(6)
    torch._dynamo.reset()
    model = nn.Sequential(Block(), Block()).cuda().to(torch.bfloat16)
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=fullgraph)
    results = []
    for m in (model, compiled):
        m.zero_grad()
        y = m(x)
        y.float().square().mean().backward()
        results.append([y] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert rel_err(b, a.double()) < 2e-2
    if fullgraph:
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons


def test_torch_compile_with_groups_and_unequal_lengths():
    """Cross-attention with grouped-query heads (8 query heads, 2 key/value heads, N_q != N_k, bottom-right
    causal) compiled with fullgraph=True: the fake implementation gives the shapes, autograd the gradients."""
    torch.manual_seed(7)
    torch._dynamo.reset()
    q, do = (torch.randn(2, 8, 33, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 2, 97, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    attention = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    same_as_eager(outputs(torch.compile(attention, fullgraph=True), q, k, v, do), outputs(attention, q, k, v, do))
    test_kernels.check("auto", q, k, v, do, causal=True)  # (and eager is right)


def same_as_eager(compiled, eager):
    """Compiled, the same kernels run on the same inputs: the same O, dK and dV, and dQ but for the order of its
    atomic sums."""
    for name, x, e in zip(["O", "dQ", "dK", "dV"], compiled, eager):
        assert x.shape == e.shape and x.stride() == e.stride(), f"{name}: shape {tuple(x.shape)}, strides {x.stride()}"
        assert rel_err(x, e.double()) < (1e-3 if name == "dQ" else 1e-6), f"{name}: compiled differs from eager"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_compile_where_the_kernels_read_a_padded_copied_or_grouped_tensor(layout):
    """The layouts of test_validation.LAYOUTS, compiled with fullgraph=True: Inductor asserts that every output has
    the strides the fake implementation gave it (the real kernels this time), and the values match eager's."""
    torch.manual_seed(8)
    torch._dynamo.reset()
    d, H_q, H_kv, q_transposed, kv_transposed, deterministic, d_strided = LAYOUTS[layout]
    q, k, v = layout_problem(d, H_q, H_kv, q_transposed, kv_transposed, d_strided, device="cuda")
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    attention = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=deterministic)  # noqa: E731
    same_as_eager(outputs(torch.compile(attention, fullgraph=True), q, k, v, do), outputs(attention, q, k, v, do))
