"""Bad input raises a clear TypeError/ValueError in Python, before anything reaches the GPU."""
import contextlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import main
from main import flash_attention, list_kernels, pick_kernel

ROOT = pathlib.Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def qkv(shape=(1, 2, 8, 64), dtype=torch.float32, device="cpu"):
    return [torch.randn(shape, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize("make, error, words", [
    (lambda: ([[1.0]], *qkv()[1:]), TypeError, "q must be a torch.Tensor"),
    (lambda: qkv((2, 8, 64)), ValueError, "4 dimensions (B, H, N, d)"),
    (lambda: (*qkv()[:2], torch.randn(1, 2, 9, 64)), ValueError, "k and v must have the same shape"),
    (lambda: (torch.randn(2, 2, 8, 64), *qkv()[1:]), ValueError, "must have the same B and d"),
    (lambda: (torch.randn(1, 2, 8, 32), *qkv()[1:]), ValueError, "must have the same B and d"),
    (lambda: (torch.randn(1, 3, 8, 64), *qkv()[1:]), ValueError, "H_q must be a multiple of the key/value heads"),
    (lambda: qkv(dtype=torch.float64), TypeError, "float32, float16 or bfloat16, got torch.float64"),
    (lambda: [torch.ones(1, 2, 8, 64, dtype=torch.int32)] * 3, TypeError, "got torch.int32"),
    (lambda: (*qkv()[:2], torch.randn(1, 2, 8, 64).half()), TypeError, "one dtype"),
    (lambda: qkv(), ValueError, "must be a CUDA tensor, got a tensor on cpu"),
])
def test_bad_inputs(make, error, words):
    with pytest.raises(error) as info:
        flash_attention(*make())
    assert words in str(info.value)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(softmax_scale="0.1"), ValueError, "softmax_scale must be None or a finite number"),
    (dict(softmax_scale=float("nan")), ValueError, "finite number"),
    (dict(softmax_scale=1e300), ValueError, "(the kernels multiply it by log2(e) in float32), got 1e+300"),
    (dict(kernel="nope"), ValueError, "unknown kernel 'nope'; valid: 'auto', 'fp32'"),
    (dict(kernel=3), TypeError, "kernel must be a string"),
    (dict(return_lse=1), TypeError, "return_lse must be True or False"),
    (dict(window_size=5), ValueError, "window_size must be a pair of integers (left, right), each >= -1"),
    (dict(window_size=(-2, 0)), ValueError, "each >= -1 (-1: no bound), got (-2, 0)"),
    (dict(window_size=(1.5, 0)), ValueError, "window_size must be a pair of integers"),
    (dict(window_size=(True, 0)), ValueError, "window_size must be a pair of integers"),
    (dict(softcap=-1.0), ValueError, "softcap must be a number from 0 (off) to 2.36e+38 (float32's range), got -1.0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a number from 0 (off)"),
    (dict(softcap=1e39), ValueError, "got 1e+39"),
    (dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes must be None or a torch.Tensor, got list"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must be a float32 tensor of shape (H_q,) = (2,) "
                                                   "or (B, H_q) = (1, 2) on cpu, got torch.float32 (3,)"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), ValueError, "got torch.float64 (2,)"),
    (dict(alibi_slopes=torch.ones(2, 2)), ValueError, "got torch.float32 (2, 2)"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be a number in [0, 1), got 1.0"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be a number in [0, 1), got -0.1"),
    (dict(dropout_p="0.1"), ValueError, "dropout_p must be a number in [0, 1), got '0.1'"),
    (dict(dropout_p=True), ValueError, "dropout_p must be a number in [0, 1), got True"),
    (dict(deterministic=1), TypeError, "deterministic must be None, True or False, got 1"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed must be None or an integer in [0, 2^63), got -1"),
    (dict(dropout_p=0.1, dropout_seed=2 ** 63), ValueError, "an integer in [0, 2^63)"),
    (dict(dropout_p=0.1, dropout_seed=1.5), ValueError, "an integer in [0, 2^63), got 1.5"),
])
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        flash_attention(*qkv(), **kwargs)
    assert words in str(info.value)


# The arguments FlashAttention's own functions also take keep their names there (flash_attn_func,
# flash_attn_varlen_func, flash_attn_with_kvcache), so that a call can switch by keyword without surprises.
FLASH_ATTN_NAMES = {
    "flash_attention": {"softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "dropout_p",
                        "deterministic"},
    "flash_attention_varlen": {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                               "causal", "window_size", "softcap", "alibi_slopes", "dropout_p", "deterministic"},
    "flash_attention_with_kvcache": {"k_cache", "v_cache", "cache_seqlens", "k", "v", "softmax_scale", "causal",
                                     "window_size", "softcap", "alibi_slopes"},
}


@pytest.mark.parametrize("name", FLASH_ATTN_NAMES)
def test_arguments_named_as_flash_attention_names_them(name):
    missing = FLASH_ATTN_NAMES[name] - set(inspect.signature(getattr(main, name)).parameters)
    assert not missing, f"{name} lacks FlashAttention's argument names {sorted(missing)}"


def test_list_kernels_fields():
    kernels = list_kernels()
    assert [k["name"] for k in kernels][0] == "fp32"
    for k in kernels:
        assert set(k) >= {"name", "dtypes", "backward", "head_dims", "min_arch", "available"}
        assert set(k["dtypes"]) <= {"float32", "float16", "bfloat16"}
        assert all(isinstance(d, int) for d in k["head_dims"]) and isinstance(k["min_arch"], int)
        arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1] if torch.cuda.is_available() else 0
        runs = arch == 90 and main._builds_sm90a() if k["sm90a"] else arch >= k["min_arch"]
        assert k["available"] == (arch > 0 and runs)


@pytest.mark.parametrize("dtype, d, arch, expected", [
    ("float16", 64, 70, "volta"), ("float16", 128, 75, "turing"), ("float16", 64, 80, "ampere"),
    ("float16", 128, 90, "hopper"), ("bfloat16", 64, 90, "hopper"), ("float16", 64, 100, "ampere"),
    ("bfloat16", 64, 80, "ampere"), ("float32", 64, 70, "fp32"),
    ("float32", 96, 90, "fp32"), ("float16", 96, 90, "hopper"), ("float16", 200, 75, None),
    ("float16", 256, 80, "ampere"), ("float32", 256, 70, "fp32"), ("bfloat16", 64, 75, None),
])
def test_auto_picks_the_kernel_of_each_generation(dtype, d, arch, expected):
    if expected is None:
        with pytest.raises(ValueError, match=f"no kernel takes dtype {dtype} with head dim {d} on sm_{arch}"):
            pick_kernel(dtype, d, arch)
    else:
        assert pick_kernel(dtype, d, arch) == expected


def test_any_head_dim_runs_on_the_narrowest_tile_that_holds_it():
    assert [main.tile_dim("hopper", d) for d in (1, 8, 32, 33, 80, 96, 111, 160, 200, 256)] == \
        [32, 32, 32, 64, 96, 96, 128, 160, 256, 256]
    assert [main.tile_dim("fp32", d) for d in (5, 16, 40, 256)] == [16, 16, 64, 256]
    assert main.tile_dim("turing", 80) == 128 and main.MAX_HEAD_DIM == 256


def test_hopper_needs_an_sm90a_build():
    # sm_90a code runs on sm_90 only; a build without sm_90a (TORCH_CUDA_ARCH_LIST=9.0) falls back to ampere
    assert pick_kernel("float16", 128, 90, sm90a=False) == "ampere"
    with pytest.raises(ValueError, match="kernel 'hopper'.*sm_90 \\(built for sm_90a\\); got float16, d=128, sm_80"):
        pick_kernel("float16", 128, 80, "hopper")


def test_a_named_kernel_runs_on_any_gpu_that_can_execute_it():
    assert pick_kernel("float16", 64, 90, "volta") == "volta" and pick_kernel("float16", 64, 90, "turing") == "turing"
    with pytest.raises(ValueError, match="kernel 'turing' takes dtypes \\['float16'\\].*sm_75\\+; got float16, d=64, sm_70"):
        pick_kernel("float16", 64, 70, "turing")
    with pytest.raises(ValueError, match="kernel 'ampere'.*got bfloat16, d=64, sm_75. Kernels that fit: none"):
        pick_kernel("bfloat16", 64, 75, "ampere")


def test_shape_errors_come_before_the_device_check():
    with pytest.raises(ValueError, match="the head dim d must be between 1 and 256, got 300"):
        flash_attention(*qkv((1, 2, 8, 300)))
    with pytest.raises(ValueError, match="B and H must each be at most 65535, got B = 65536"):
        flash_attention(*qkv((65536, 1, 1, 16)))


@cuda
def test_bad_inputs_on_gpu():
    q, k, v = qkv(device="cuda")
    with pytest.raises(ValueError, match="the head dim d must be between 1 and 256, got 257"):
        flash_attention(*qkv((1, 2, 8, 257), device="cuda"))
    with pytest.raises(ValueError, match="kernel 'volta' takes dtypes \\['float16'\\], head dims up to 128"):
        flash_attention(*qkv((1, 2, 8, 160), device="cuda", dtype=torch.float16), kernel="volta")
    with pytest.raises(ValueError, match="one device|v must be a CUDA tensor"):
        flash_attention(q, k, v.cpu()) if torch.cuda.device_count() < 2 else flash_attention(q, k, v.to("cuda:1"))
    with pytest.raises(ValueError, match="B and H must each be at most 65535, got B = 65536"):
        flash_attention(*qkv((65536, 1, 1, 16), device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available() or main._arch() < 80, reason="needs a CUDA GPU, sm_80 or newer")
def test_an_error_raised_inside_an_extension_reaches_python():
    """flash.cu's own checks (TORCH_CHECK) guard what main.py has validated already. Called directly, one must
    still raise RuntimeError, with the number in its message: an extension that carried a second C++ runtime
    crashed the process there (main._cxx_runtime). In a child process, so that a crash fails this test alone."""
    code = """import sys, torch
sys.path.insert(0, '.')
import main
q = torch.randn(1, 2, 17, 64, device='cuda', dtype=torch.float16)
lengths = torch.tensor([17], device='cuda', dtype=torch.int32)
try:
    main.load('ampere', 64).forward(q, q, q, -1, -1, 0.125, 0.0, None, lengths, None, None, 0, 0, 0.0, None,
                                    main._stream(q))
except RuntimeError as e:
    print(e)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the process ended with {run.returncode}:\n{run.stderr[-3000:]}"
    assert "takes seqlens_k only for decoding (N_q <= 16)" in run.stdout, run.stdout


def test_kernel_table_is_read_from_flash_cu():
    # one source of truth: main.py's table is flash.cu's KERNELS, in its order
    text = (ROOT / "flash.cu").read_text()
    rows = text[text.index("constexpr KernelSpec KERNELS[] = {"):].split("};")[0]
    assert [k["name"] for k in list_kernels()] == re.findall(r'\{"(\w+)", "', rows)
    assert main.KERNELS["ampere"]["head_dims"] == (32, 64, 96, 128, 160, 192, 256) and main.KERNELS["hopper"]["sm90a"]
    assert main.KERNELS["volta"]["backward_kernel"] == "fp32"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_fake_implementations(dtype, layout):
    # what torch.compile traces with: shapes, dtypes and strides of the outputs, without a GPU (meta tensors)
    B, H, N, d = 2, 3, 5, 64
    if layout == "transposed":
        q, k, v = (torch.empty(B, N, H, d, dtype=dtype, device="meta").transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.empty(B, H, N, d, dtype=dtype, device="meta") for _ in range(3))
    o, L = torch.ops.flash.forward(q, k, v, -1, 0, 0.125, 0.0, None, "auto")
    assert o.shape == q.shape and o.dtype == dtype and o.stride() == q.stride()
    assert L.shape == (B, H, N) and L.dtype == torch.float32
    dq, dk, dv = torch.ops.flash.backward(torch.empty_like(o), None, q, k, v, o, L, -1, 0, 0.125, 0.0, None, "auto")
    assert dq.shape == dk.shape == dv.shape == q.shape and dq.dtype == dk.dtype == dv.dtype == dtype
    assert dk.stride() == k.stride() and dv.stride() == v.stride() and dq.is_contiguous()


def test_fake_implementations_with_unequal_lengths_and_groups():
    q = torch.empty(2, 8, 5, 64, dtype=torch.float16, device="meta")
    k, v = (torch.empty(2, 2, 300, 64, dtype=torch.float16, device="meta") for _ in range(2))
    o, L = torch.ops.flash.forward(q, k, v, -1, 0, 0.125, 0.0, None, "auto")
    assert o.shape == q.shape and L.shape == (2, 8, 5)
    dq, dk, dv = torch.ops.flash.backward(torch.empty_like(o), None, q, k, v, o, L, -1, 0, 0.125, 0.0, None, "auto")
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_kvcache_checks_its_inputs_too():
    q, k_cache, v_cache = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        main.flash_attention_with_kvcache(q, k_cache, v_cache, 3)


@cuda
@pytest.mark.parametrize("lengths, words", [(2 ** 32 + 3, "got cache_seqlens = [4294967299]"),  # (int32: 3)
                                            (-1, "must lie in [N_new, N_max] = [0, 16]")])
def test_kvcache_lengths_are_checked_before_any_cast(lengths, words):
    q, k_cache, v_cache = (torch.randn(1, 2, n, 64, device="cuda") for n in (1, 16, 16))
    for cache_seqlens in (lengths, torch.tensor([lengths], device="cuda")):
        with pytest.raises(ValueError) as info:
            main.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)
        assert words in str(info.value)


@cuda
def test_kvcache_checks_the_kernel_before_it_appends():
    """A kernel that does not take these inputs raises before k and v go into the caches."""
    q, k_cache, v_cache, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.float16)
                                 for n in (1, 16, 16, 1, 1))
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="kernel 'fp32' takes dtypes"):
        main.flash_attention_with_kvcache(q, k_cache, v_cache, 3, k, v, kernel="fp32")
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("limit", ["99KB", "0", "-5", " 1024", ""])
def test_a_smem_limit_that_is_no_number_of_bytes_is_refused(limit, monkeypatch):
    monkeypatch.setenv("FLASH_SMEM_LIMIT", limit)
    with pytest.raises(ValueError, match=f"FLASH_SMEM_LIMIT must be a number of bytes, such as 101376; got '{limit}'"):
        main.load("fp32", 64)


def test_kvcache_is_forward_only():
    q, k_cache, v_cache = torch.randn(1, 2, 1, 64, requires_grad=True), *(torch.randn(1, 2, 16, 64) for _ in range(2))
    with pytest.raises(ValueError, match="forward only .* q requires grad"):
        main.flash_attention_with_kvcache(q, k_cache, v_cache, 3)


def test_pick_kernel_and_tile_dim_say_what_they_take():
    for args, error, words in [(("float16", 64, 90, "foo"), ValueError, "unknown kernel 'foo'; valid: 'auto'"),
                               ((torch.float16, 64, 90), TypeError, "dtype must be a name such as 'float16'"),
                               (("float16", 0, 90), ValueError, "no kernel takes dtype float16 with head dim 0")]:
        with pytest.raises(error, match=re.escape(words)):
            main.pick_kernel(*args)
    with pytest.raises(ValueError, match="kernel 'ampere' takes head dims 1 to 256, got 300"):
        main.tile_dim("ampere", 300)


def test_dropout_mask_needs_the_seed():
    q = torch.randn(1, 2, 4, 64)
    with pytest.raises(TypeError, match="dropout_mask needs the call's dropout_seed"):
        main.dropout_mask(q, q, 0.1, None)


def packed_qkv(total=10, H=2, d=64, device="cpu"):
    return [torch.randn(total, H, d, device=device) for _ in range(3)]


def cu(*starts, device="cpu", dtype=torch.int32):
    return torch.tensor(starts, dtype=dtype, device=device)


@pytest.mark.parametrize("make, error, words", [
    (lambda: (torch.randn(1, 10, 2, 64), *packed_qkv()[1:], cu(0, 10), cu(0, 10), 10, 10), ValueError,
     "q must be a packed tensor (total, H, d), got shape (1, 10, 2, 64)"),
    (lambda: (*packed_qkv(), cu(0, 10, dtype=torch.int64), cu(0, 10), 10, 10), ValueError,
     "cu_seqlens_q must be an int32 tensor (B + 1,)"),
    (lambda: (*packed_qkv(), cu(0, 10), [0, 10], 10, 10), ValueError, "cu_seqlens_k must be an int32 tensor"),
    (lambda: (*packed_qkv(), cu(10), cu(10), 10, 10), ValueError, "with B >= 1"),
    (lambda: (*packed_qkv(), cu(0, 4, 10), cu(0, 10), 10, 10), ValueError, "the same B sequences"),
    (lambda: (*packed_qkv(), cu(0, 10), cu(0, 10), 10.0, 10), ValueError,
     "max_seqlen_q must be an integer in [0, 2^31)"),
    (lambda: (*packed_qkv(), cu(0, 10), cu(0, 10), 10, 2 ** 32 + 1), ValueError,  # (an int32 would read 1)
     "max_seqlen_k must be an integer in [0, 2^31), got 4294967297"),
    (lambda: (packed_qkv()[0], *packed_qkv(d=32)[1:], cu(0, 10), cu(0, 10), 10, 10), ValueError,
     "q (total_q, H_q, d) and k, v (total_k, H_kv, d) must have the same d"),
    (lambda: ("q", *packed_qkv()[1:], cu(0, 10), cu(0, 10), 10, 10), TypeError, "q must be a torch.Tensor, got str"),
    (lambda: (*packed_qkv(), cu(0, 10), cu(0, 10), 10, 10), ValueError, "must be a CUDA tensor"),
])
def test_varlen_bad_inputs(make, error, words):
    with pytest.raises(error) as info:
        main.flash_attention_varlen(*make())
    assert words in str(info.value)


def test_varlen_alibi_slopes_are_per_sequence():
    q, k, v = packed_qkv()
    with pytest.raises(ValueError, match=re.escape("(B, H_q) = (3, 2)")):
        main.flash_attention_varlen(q, k, v, cu(0, 2, 5, 10), cu(0, 2, 5, 10), 5, 5, alibi_slopes=torch.ones(1, 2))


@cuda
def test_varlen_lengths_are_checked():
    q, k, v = packed_qkv(device="cuda")
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is less than the longest sequence, 6"):
        main.flash_attention_varlen(q, k, v, cu(0, 4, 10, device="cuda"), cu(0, 4, 10, device="cuda"), 4, 6)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k must start at 0, never decrease and end at 10")):
        main.flash_attention_varlen(q, k, v, cu(0, 4, 10, device="cuda"), cu(0, 6, 4, device="cuda"), 6, 6)


def test_varlen_fake_implementations():
    q = torch.empty(30, 8, 64, dtype=torch.bfloat16, device="meta")
    k, v = (torch.empty(50, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    starts = torch.empty(4, dtype=torch.int32, device="meta")
    o, L = torch.ops.flash.varlen_forward(q, k, v, starts, starts, 20, 30, -1, 0, 0.125, 0.0, None, "auto")
    assert o.shape == q.shape and o.is_contiguous() and L.shape == (8, 30) and L.dtype == torch.float32
    dq, dk, dv = torch.ops.flash.varlen_backward(torch.empty_like(o), None, q, k, v, o, L, starts, starts, 20, 30,
                                                 -1, 0, 0.125, 0.0, None, "auto")
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


# Layouts where the kernels read a padded, copied or grouped tensor. O must still come back in q's layout, dK and dV
# in k's and v's, and dQ contiguous, as the ops' fake implementations say: torch.compile plans with those strides.
LAYOUTS = {  # name: (d, H_q, H_kv, q as a transposed view, k and v as transposed views, deterministic, q's d strided)
    "grouped heads, k and v transposed": (64, 4, 2, False, True, False, False),
    "d = 80 (padded to 96), transposed": (80, 4, 4, True, True, False, False),
    "deterministic, q transposed": (64, 4, 4, True, False, True, False),
    "q's last dimension strided (copied)": (64, 4, 4, False, False, False, True),
}


def layout_problem(d, H_q, H_kv, q_transposed, kv_transposed, d_strided, device="cpu"):
    def make(H, N, transposed, strided=False):
        if strided:
            return torch.randn(2, H, d, N, dtype=torch.bfloat16, device=device).transpose(-1, -2)
        x = torch.randn(2, N, H, d, dtype=torch.bfloat16, device=device)
        return x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()
    return make(H_q, 77, q_transposed, d_strided), make(H_kv, 50, kv_transposed), make(H_kv, 50, kv_transposed)


class AllocatesAsFlashCu:
    """A stand-in for a kernel's extension that allocates its outputs as flash.cu's forward and backward do:
    O = empty_like(Q); dQ fp32 (B, H_q, N_q, d), or empty_like(Q) when deterministic; dK, dV like K, V, or
    (B, H_q, N_k, d) with grouped heads."""
    def __init__(self, deterministic):
        self.deterministic = deterministic

    def forward(self, Q, K, V, *options):
        return torch.empty_like(Q), torch.empty(Q.shape[:3])

    def backward(self, Q, K, V, O, L, dO, *options):
        dQ = torch.empty_like(Q) if self.deterministic else torch.empty(Q.shape)
        def per_query_head(X):
            return torch.empty(*Q.shape[:2], *X.shape[2:], dtype=X.dtype) if Q.shape[1] != K.shape[1] else \
                torch.empty_like(X)
        return dQ, per_query_head(K), per_query_head(V)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_come_back_in_the_layouts_the_fakes_promise(layout, monkeypatch):
    """main.py's side of it, on the CPU with the stand-in above (tests/test_ops.py checks the kernels on a GPU)."""
    d, H_q, H_kv, q_transposed, kv_transposed, deterministic, d_strided = LAYOUTS[layout]
    monkeypatch.setattr(main, "load", lambda *build: AllocatesAsFlashCu(deterministic))
    monkeypatch.setattr(main, "_arch", lambda device=None: 90)
    monkeypatch.setattr(main, "_builds_sm90a", lambda: True)
    monkeypatch.setattr(main, "_stream", lambda t: 0)
    monkeypatch.setattr(main, "_on_device", lambda t: contextlib.nullcontext())
    q, k, v = layout_problem(d, H_q, H_kv, q_transposed, kv_transposed, d_strided)
    o, L = main._run_forward(q, k, v, (-1, 0), 0.125, 0.0, None, "hopper")
    dq, dk, dv = main._run_backward(o, None, q, k, v, o, L, -1, 0, 0.125, 0.0, None, "hopper",
                                    deterministic=deterministic)
    q_, k_, v_, o_, L_ = (t.to("meta") for t in (q, k, v, o, L))  # (the same strides, on the meta device)
    fake_o, _ = torch.ops.flash.forward(q_, k_, v_, -1, 0, 0.125, 0.0, None, "hopper")
    fakes = torch.ops.flash.backward(o_, None, q_, k_, v_, o_, L_, -1, 0, 0.125, 0.0, None, "hopper")
    for name, real, fake in zip(("O", "dQ", "dK", "dV"), (o, dq, dk, dv), (fake_o, *fakes)):
        assert real.stride() == fake.stride() and real.dtype == fake.dtype, (
            f"{name}: strides {real.stride()} {real.dtype}, where the fake implementation says {fake.stride()} "
            f"{fake.dtype}")
