"""flash_attention inside models: the torch.library ops (opcheck, torch.compile), inputs read in place
through their strides, the log-sum-exp L and its gradient, and grids of more than 65535 heads.

Skipped, visibly, without a CUDA GPU (the fake implementations are checked on the CPU in test_validation.py).
"""
import pytest
import torch
import torch.nn as nn

import main
import reference
from main import TOLERANCE, flash_attention, list_kernels, outputs, rel_err
from test_validation import LAYOUTS, layout_problem  # tests/ is on sys.path under pytest

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
    for name, x, ref in zip(["L", "dQ", "dK", "dV"], *results):
        assert x.dtype == (torch.float32 if name == "L" else q.dtype)
        assert rel_err(x, ref) < TOLERANCE[dtype], f"{name}: relative error {rel_err(x, ref):.1e}"


@pytest.mark.parametrize("kernel, dtype", CASES)
def test_strided_inputs_are_read_in_place(kernel, dtype):
    torch.manual_seed(4)
    B, N, H, d = 2, 129, 3, 64
    dt = getattr(torch, dtype)
    qkv = torch.randn(B, N, 3, H, d, device="cuda", dtype=dt)        # one packed tensor, as nanoGPT and llm.c
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))     # (B, H, N, d) views, rows 3 H d apart
    do = torch.randn(B, N, H, d, device="cuda", dtype=dt).transpose(1, 2)
    assert all(main._readable(t) is t for t in (q, k, v, do)), "a strided view was copied"
    ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal=True, kernel=kernel), q, k, v, do)
    exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal=True), *(t.double() for t in (q, k, v, do)))
    for name, x, ref in zip(["O", "dQ", "dK", "dV"], ours, exact):
        assert rel_err(x, ref) < TOLERANCE[dtype], f"{name}: relative error {rel_err(x, ref):.1e}"
    o = flash_attention(*(torch.randn(B, N, H, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(3)),
                        kernel=kernel)
    assert o.stride() == (N * H * d, d, H * d, 1), f"O is not in the layout of q: strides {o.stride()}"


def test_odd_strides_are_copied_once():
    q, k, v = (torch.randn(1, 2, 40, 68, device="cuda", dtype=torch.float16)[..., :64] for _ in range(3))
    assert main._readable(q) is not q and main._readable(q).is_contiguous()  # rows 136 bytes apart: not 16 B
    exact = reference.attention(q.double(), k.double(), v.double())
    assert rel_err(flash_attention(q, k, v), exact) < TOLERANCE["float16"]


def test_more_than_65535_heads():
    torch.manual_seed(5)
    q, k, v = (torch.randn(1100, 64, 3, 64, device="cuda", dtype=torch.float16) for _ in range(3))  # B*H = 70400
    o = flash_attention(q, k, v, causal=True)
    assert rel_err(o, reference.attention(q.double(), k.double(), v.double(), causal=True)) < TOLERANCE["float16"]
    o = flash_attention(q.float(), k.float(), v.float(), kernel="fp32")
    assert rel_err(o, reference.attention(q.double(), k.double(), v.double())) < TOLERANCE["float32"]


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
    compiled = outputs(torch.compile(attention, fullgraph=True), q, k, v, do)
    exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal=True), *(t.double() for t in (q, k, v, do)))
    for name, x, r in zip(["O", "dQ", "dK", "dV"], compiled, exact):
        assert x.shape == r.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(r.shape)}"
        assert rel_err(x, r) < TOLERANCE["float16"], f"{name}: relative error {rel_err(x, r):.1e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_compile_where_the_kernels_read_a_padded_copied_or_grouped_tensor(layout):
    """The layouts of test_validation.LAYOUTS, compiled with fullgraph=True: Inductor asserts that every output has
    the strides the fake implementation gave it (the real kernels this time), and the values match float64."""
    torch.manual_seed(8)
    torch._dynamo.reset()
    d, H_q, H_kv, q_transposed, kv_transposed, deterministic, d_strided = LAYOUTS[layout]
    q, k, v = layout_problem(d, H_q, H_kv, q_transposed, kv_transposed, d_strided, device="cuda")
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    attention = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=deterministic)  # noqa: E731
    compiled = outputs(torch.compile(attention, fullgraph=True), q, k, v, do)
    exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal=True), *(t.double() for t in (q, k, v, do)))
    for name, x, r in zip(["O", "dQ", "dK", "dV"], compiled, exact):
        assert rel_err(x, r) < TOLERANCE["bfloat16"], f"{name}: relative error {rel_err(x, r):.1e}"
