"""The Python side of flash.cu: build each kernel on first use, validate inputs, torch.library ops with
autograd, and a self-check.

    from main import flash_attention, flash_attention_with_kvcache, flash_attention_8bit, list_kernels
    o = flash_attention(q, k, v, causal=False, softmax_scale=None, kernel="auto")
    o, L = flash_attention(q, k, v, return_lse=True)                 # L: (B, H_q, N_q), float32
    o = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new)   # generation
    o = flash_attention_8bit(q, k, v, causal=True, dtype=torch.float8_e4m3fn)   # fp8 (Hopper) or int8, inference

q (B, H_q, N_q, d); k, v (B, H_kv, N_k, d) with H_q a multiple of H_kv (grouped-query attention; H_kv = 1:
multi-query) and any N_k (cross-attention, a KV cache). Causal masking is aligned to the bottom right, as in
FlashAttention: query i sees keys j <= i + N_k - N_q. q, k, v may be any views whose last dimension is
contiguous, e.g. (B, N, H, d).transpose(1, 2) or slices of one packed qkv tensor: they are read in place.
The forward and backward are the torch.library ops flash::forward and flash::backward, so torch.compile
traces flash_attention without a graph break.

`python main.py` builds the kernels for this GPU, checks every available kernel forward and backward
against float64 and prints a table. Without a GPU it checks reference.py against dense attention instead.
"""
import contextlib
import functools
import importlib.util
import math
import os
import re
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _kernel_table():
    """flash.cu's KERNELS table, the one list of what each kernel takes: {name: dict(dtypes, head_dims, min_arch,
    sm90a, backward_kernel, about)}, from the most general kernel to the most specialised."""
    text = open(os.path.join(ROOT, "flash.cu")).read()
    table = text[text.index("constexpr KernelSpec KERNELS[] = {"):]
    table = table[:table.index("};")]
    row = r'\{"(\w+)", "([\w ]+)", \{([\d, ]+)\}, (\d+), (true|false), (true|false), "(\w+)",\s*"([^"]*)"\}'
    return {name: dict(dtypes=tuple(dtypes.split()), head_dims=tuple(int(d) for d in dims.split(",")),
                       min_arch=int(arch), sm90a=sm90a == "true", split_kv=split_kv == "true",
                       backward_kernel=backward, about=about)
            for name, dtypes, dims, arch, sm90a, split_kv, backward, about in re.findall(row, table)}


KERNELS = _kernel_table()
# Decoding: kernels with split_kv run N_q <= SPLIT_KV_MAX_QUERIES with flash_decode (flash.cu's constant)
SPLIT_KV_MAX_QUERIES = int(re.search(r"constexpr int SPLIT_KV_MAX_QUERIES = (\d+);",
                                     open(os.path.join(ROOT, "flash.cu")).read()).group(1))
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_HEAD_DIM = max(max(kn["head_dims"]) for kn in KERNELS.values())  # 256
MAX_GRID = 65535  # H and B are the grid's y and z dimensions


@functools.cache  # (the checks before each launch are a few microseconds, and decoding calls are short)
def _arch(device=None):
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _runs_on(kn, arch, sm90a=True):
    """Whether kernel kn runs on sm_<arch>; sm90a: the build targets sm_90a."""
    if kn["sm90a"]:
        return arch == 90 and sm90a
    return arch >= kn["min_arch"]


def _gpus(kn):
    return "sm_90 (built for sm_90a)" if kn["sm90a"] else f"sm_{kn['min_arch']}+"


def list_kernels():
    """One dict per kernel: name, dtypes, backward (has a backward kernel of its own), backward_kernel,
    head_dims, min_arch, sm90a (runs on sm_90 alone, from an sm_90a build), split_kv (decodes N_q <=
    SPLIT_KV_MAX_QUERIES with a split-KV kernel), gpus (the GPUs in words), available (runs on this GPU),
    about."""
    arch = _arch() if torch.cuda.is_available() else 0
    return [dict(name=name, dtypes=list(k["dtypes"]), backward=k["backward_kernel"] == name,
                 backward_kernel=k["backward_kernel"], head_dims=list(k["head_dims"]), min_arch=k["min_arch"],
                 sm90a=k["sm90a"], split_kv=k["split_kv"], gpus=_gpus(k),
                 available=arch > 0 and _runs_on(k, arch, _builds_sm90a()), about=k["about"])
            for name, k in KERNELS.items()]


@functools.cache
def pick_kernel(dtype, d, arch, kernel="auto", sm90a=True):
    """The kernel that runs dtype ("float16", ...) with head dim d on sm_<arch>: for "auto" the most specialised
    that fits (float16: volta on sm_70, turing on sm_75, ampere from sm_80 on, hopper on sm_90), else the one
    named if it fits. A kernel fits any d up to its widest tile (tile_dim). sm90a: flash.cu is built for sm_90a
    (the hopper kernel needs it)."""
    _check_kernel_name(kernel)
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a name such as 'float16', got {dtype!r}")
    fits = [n for n, kn in KERNELS.items()
            if dtype in kn["dtypes"] and 1 <= d <= max(kn["head_dims"]) and _runs_on(kn, arch, sm90a)]
    if kernel == "auto":
        if not fits:
            raise ValueError(f"no kernel takes dtype {dtype} with head dim {d} on sm_{arch}; kernels: "
                             + "; ".join(f"{n}: {list(kn['dtypes'])}, d <= {max(kn['head_dims'])}, {_gpus(kn)}"
                                         for n, kn in KERNELS.items()))
        return fits[-1]  # KERNELS is ordered from the most general to the most specialised
    if kernel not in fits:
        kn = KERNELS[kernel]
        raise ValueError(f"kernel {kernel!r} takes dtypes {list(kn['dtypes'])}, head dims up to "
                         f"{max(kn['head_dims'])} and {_gpus(kn)}; got {dtype}, d={d}, sm_{arch}. "
                         f"Kernels that fit: {fits or 'none'}")
    return kernel


@functools.cache
def tile_dim(kernel, d):
    """The narrowest tile width of kernel that holds head dim d: its kernels run on q, k, v padded with zeros to
    that width (which adds 0 to every score q.k and gives output columns that are dropped). d = 80 runs on the
    96-wide tiles, d = 111 on the 128-wide."""
    if not 1 <= d <= max(KERNELS[kernel]["head_dims"]):
        raise ValueError(f"kernel {kernel!r} takes head dims 1 to {max(KERNELS[kernel]['head_dims'])}, got {d}")
    return min(D for D in KERNELS[kernel]["head_dims"] if D >= d)


# ---------------------------------------------------------------------------------------------------------
# Building: one extension per kernel and tile width, compiled from flash.cu with -DBUILD_<name> -DHEAD_DIM=<d>
# on its first use, so that a first call compiles one tile shape of one kernel, not all of them.

_extensions = {}


def _arch_list():
    """The targets flash.cu is built for: TORCH_CUDA_ARCH_LIST, else this GPU (9.0a on Hopper)."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_list:
        major, minor = torch.cuda.get_device_capability()
        arch_list = f"{major}.{minor}" + ("a" if major == 9 else "")  # sm_90a unlocks Hopper-only instructions
    return [a for a in arch_list.replace(",", ";").replace(" ", ";").split(";") if a]


@functools.cache
def _builds_sm90a():
    return "9.0a" in _arch_list()


def load(kernel, d=64, packed=False, dropout=False, deterministic=False):
    """The extension of one kernel of flash.cu at tile width d (its forward and, if it has one, backward),
    compiled for the GPU present (or TORCH_CUDA_ARCH_LIST) on first use; later calls, and later processes,
    reuse the build. packed: the build for packed batches (flash_attention_varlen; -DPACKED=1). dropout: the
    build with dropout (-DDROPOUT=1; the others are left as they were, so that dropout_p = 0 costs nothing).
    deterministic: the build whose backward computes dQ without atomics (-DDETERMINISTIC=1)."""
    _smem_limit()  # (flash.cu's launchers read it at every call, and take a malformed one for none)
    key = kernel, d, packed, dropout, deterministic
    if key in _extensions:
        return _extensions[key]
    gencode, tags = [], []
    for arch in _arch_list():  # "8.6", "9.0a", "8.0+PTX"
        number = arch.replace("+PTX", "").replace(".", "")
        gencode.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            gencode.append(f"-gencode=arch=compute_{number},code=compute_{number}")
        tags.append(number + ("ptx" if arch.endswith("+PTX") else ""))
    variant = "".join(f"_{v}" for v, on in (("packed", packed), ("dropout", dropout), ("deterministic", deterministic))
                      if on)
    name = f"flash_{kernel}{variant}_d{d}_sm{'_'.join(tags)}"
    build_dir = os.path.join(ROOT, "build", name)
    library = os.path.join(build_dir, name + ".so")
    if os.path.exists(library) and os.path.getmtime(library) > max(os.path.getmtime(os.path.join(ROOT, f))
                                                                   for f in ("flash.cu", "main.py")):
        # built after the last edit of its sources: import it as it is (torch's loader would first start
        # ninja to check that, which costs seconds)
        spec = importlib.util.spec_from_file_location(name, library)
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _extensions[key] = module
            return module
        except ImportError:  # half written: another process is linking it (torch's loader below waits for that)
            pass
    from torch.utils.cpp_extension import load as load_extension
    os.makedirs(build_dir, exist_ok=True)
    print(f"Building the {kernel} kernel, d = {d}{variant.replace('_', ', ')}, for sm_{', sm_'.join(tags)} "
          "(first use only)...", file=sys.stderr, flush=True)
    _extensions[key] = load_extension(
        name=name, sources=[os.path.join(ROOT, "flash.cu")], build_directory=build_dir,
        extra_cuda_cflags=["-O3", "-std=c++20", "-lineinfo", "-diag-suppress=3189,20013,20015",
                           "--split-compile=0",  # optimise the kernels of one file on all cores
                           f"-DBUILD_{kernel}", f"-DHEAD_DIM={d}", f"-DPACKED={int(packed)}",
                           f"-DDROPOUT={int(dropout)}", f"-DDETERMINISTIC={int(deterministic)}", *gencode],
        extra_ldflags=_cxx_runtime())
    return _extensions[key]


def _cxx_runtime():
    """The libstdc++ this process runs (torch's), as a link input, so that each extension uses that one.
    A compiler whose own libstdc++ is a static library (one built into /opt, say) would otherwise copy it
    into the extension: two C++ runtimes in one process, whose locale tables disagree, so that an error
    message with a number in it (TORCH_CHECK streams it) crashes the process where it should raise."""
    if not os.path.exists("/proc/self/maps"):  # (not Linux: no libstdc++ to share)
        return []
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})[:1]


def _smem_limit():
    """FLASH_SMEM_LIMIT, the shared memory in bytes that the launchers choose tiles for (below the GPU's own), or
    None."""
    limit = os.environ.get("FLASH_SMEM_LIMIT")
    if limit is not None and not (limit.isascii() and limit.isdigit() and int(limit) > 0):
        raise ValueError(f"FLASH_SMEM_LIMIT must be a number of bytes, such as {99 * 1024}; got {limit!r}")
    return None if limit is None else int(limit)


def build(kernels, head_dims=(64,), packed_head_dims=(), variants=()):
    """Builds several kernels at once, at each tile width in head_dims that they have (one nvcc process each, as
    many at once as there are cores). variants: more builds, as load's arguments (kernel, d, packed, dropout,
    deterministic)."""
    jobs = [(k, d, packed) for packed, dims in ((False, head_dims), (True, packed_head_dims))
            for k in kernels for d in dims if d in KERNELS[k]["head_dims"]] + list(variants)
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda job: load(*job), jobs))


# ---------------------------------------------------------------------------------------------------------
# The ops. flash::forward and flash::backward run the kernels; their fake implementations give the shapes,
# dtypes and strides of the outputs without a GPU (torch.compile traces with them); autograd is registered
# through torch.library, and the gradient of L is supported too (see _backward).

def _readable(t):
    """t as the kernels read it: the last dimension contiguous, the other strides multiples of 16 bytes, the
    data 16-byte aligned (the kernels read 16 bytes at a time). Anything else is copied once."""
    step = 16 // t.element_size()
    if t.is_contiguous() and t.shape[-1] % step == 0 and t.data_ptr() % 16 == 0:  # the common case, checked first
        return t
    if t.stride(-1) != 1 or any(s % step for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1):
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# The Python side of a call costs as much as a short decoding step on the GPU, so the two helpers below take
# the cheap paths: the raw stream (torch.cuda.current_stream builds a Stream object), and no device switch
# where the tensors are on the current device already.
def _stream(t):
    """The current CUDA stream of t's device, as the int the extensions take."""
    return torch._C._cuda_getCurrentRawStream(t.device.index)


def _on_device(t):
    """torch.cuda.device(t.device) where that is not the current device: the extensions launch on the current one."""
    return contextlib.nullcontext() if t.get_device() == torch.cuda.current_device() else torch.cuda.device(t.device)


def _padded(t, D):
    """t with its last dimension padded with zeros to D, a tile width (t itself if it has D already)."""
    return t if t.shape[-1] == D else torch.nn.functional.pad(t, (0, D - t.shape[-1]))


def _in_layout(x, like):
    """x in the layout torch.empty_like(like) has (like's where that is dense, else contiguous): the layout the ops'
    fake implementations promise for O, dK and dV, which torch.compile relies on."""
    out = torch.empty_like(like, dtype=x.dtype)
    return x if x.stride() == out.stride() else out.copy_(x)


def _run_forward(q, k, v, window, scale, softcap, alibi_slopes, kernel, seqlens_k=None, packed=None, dropout_p=0.0,
                 dropout_key=None):
    """O (B, H_q, N_q, d) and L (B, H_q, N_q), the row log-sum-exp in natural log, float32. window: (left, right),
    -1 for no bound (causal: right = 0). seqlens_k (int32, (B,)): each sequence's number of keys, for the
    split-KV kernels only (flash_attention_with_kvcache). packed: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) of a packed batch, whose q, k, v are (1, H, total, d) views (flash_attention_varlen).
    dropout_p > 0: dropout of P with the Philox key dropout_key (int64 (1,) on q's device)."""
    kernel = pick_kernel(DTYPES[q.dtype], q.shape[-1], _arch(q.device), kernel, _builds_sm90a())
    if q.numel() == 0 or k.shape[2] == 0:  # (no keys: every row sees none, so O = 0 and L = -inf)
        return torch.zeros_like(q), q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32)
    d, D = q.shape[-1], tile_dim(kernel, q.shape[-1])
    q_, k_, v_ = (_readable(_padded(t, D)) for t in (q, k, v))
    with _on_device(q):
        o, L = load(kernel, D, packed is not None, dropout_p > 0).forward(
            q_, k_, v_, *window, scale, softcap, alibi_slopes, seqlens_k, *(packed or (None, None, 0, 0)),
            dropout_p, dropout_key if dropout_p > 0 else None, _stream(q))
    if q_ is not q:  # (the kernel wrote O in the layout of a padded or copied q)
        o = _in_layout(o[..., :d], q)
    return o, L


@torch.library.custom_op("flash::forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int, scale: float,
             softcap: float, alibi_slopes: Optional[torch.Tensor], kernel: str, dropout_p: float = 0.0,
             dropout_key: Optional[torch.Tensor] = None,
             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """_run_forward as an op: what torch.compile traces and autograd differentiates. deterministic is for the
    backward (autograd hands it the forward's arguments)."""
    return _run_forward(q, k, v, (window_left, window_right), scale, softcap, alibi_slopes, kernel,
                        dropout_p=dropout_p, dropout_key=dropout_key)


@_forward.register_fake
def _(q, k, v, window_left, window_right, scale, softcap, alibi_slopes, kernel, dropout_p=0.0, dropout_key=None,
      deterministic=False):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash::backward", mutates_args=())
def _backward(do: torch.Tensor, dL: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, L: torch.Tensor, window_left: int, window_right: int, scale: float, softcap: float,
              alibi_slopes: Optional[torch.Tensor], kernel: str, dropout_p: float = 0.0,
              dropout_key: Optional[torch.Tensor] = None,
              deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV for the loss sum(O * dO) + sum(L * dL) (dL may be None). A gradient through L changes only
    D_i: dL_i/dS_ij = P_ij, so dS_ij = P_ij o (dP_ij - D_i + dL_i), the kernels' own step with D_i - dL_i.
    dropout_p, dropout_key: the forward's. deterministic: dQ without atomics (bit-identical runs)."""
    return _run_backward(do, dL, q, k, v, o, L, window_left, window_right, scale, softcap, alibi_slopes, kernel,
                         dropout_p=dropout_p, dropout_key=dropout_key, deterministic=deterministic)


@_backward.register_fake
def _(do, dL, q, k, v, o, L, window_left, window_right, scale, softcap, alibi_slopes, kernel, dropout_p=0.0,
      dropout_key=None, deterministic=False):
    return q.new_empty(q.shape), torch.empty_like(k), torch.empty_like(v)


def _run_backward(do, dL, q, k, v, o, L, window_left, window_right, scale, softcap, alibi_slopes, kernel, packed=None,
                  dropout_p=0.0, dropout_key=None, deterministic=False):
    """_backward's work; packed, dropout_p, dropout_key: as in _run_forward."""
    kernel = pick_kernel(DTYPES[q.dtype], q.shape[-1], _arch(q.device), kernel, _builds_sm90a())
    if q.numel() == 0 or k.numel() == 0:
        return q.new_zeros(q.shape), torch.zeros_like(k), torch.zeros_like(v)
    name, dtype = KERNELS[kernel]["backward_kernel"], q.dtype
    d, D = q.shape[-1], tile_dim(name, q.shape[-1])
    tensors = [_readable(_padded(t, D)) for t in (q, k, v, o, do)]
    if DTYPES[dtype] not in KERNELS[name]["dtypes"]:
        tensors = [t.float() for t in tensors]  # the fallback: the fp32 backward on upcast inputs
    q_, k_, v_, o_, do_ = tensors
    with _on_device(q):
        dq, dk, dv = load(name, D, packed is not None, dropout_p > 0, deterministic).backward(
            q_, k_, v_, o_, L, do_, dL, window_left, window_right, scale, softcap, alibi_slopes,
            *(packed or (None, None, 0, 0)), dropout_p, dropout_key if dropout_p > 0 else None, _stream(q))
    dq, dk, dv = (x[..., :d] for x in (dq, dk, dv))
    grouped = dk.shape[1] != k.shape[1]
    if grouped:  # grouped-query attention: one dK, dV per query head, summed over each group
        dk, dv = (x.unflatten(1, (k.shape[1], -1)).sum(2) for x in (dk, dv))
    dq, dk, dv = dq.to(dtype), dk.to(dtype), dv.to(dtype)
    # (the kernels made dK, dV like the k, v they read: where that was a padded or copied tensor, or per query head,
    # the layout the fake implementation promises is made here)
    dk, dv = (x if t_ is t and not grouped else _in_layout(x, t) for x, t_, t in ((dk, k_, k), (dv, v_, v)))
    return dq.contiguous(), dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options  # (the window, scale, softcap, slopes, kernel, dropout and deterministic)
    ctx.set_materialize_grads(False)  # an unused output (L, usually) gets None, not a tensor of zeros


def _autograd_backward(ctx, do, dL):
    q, k, v, o, L = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _backward(do, dL, q, k, v, o, L, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_kernel_name(kernel):
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a string, got {type(kernel).__name__}")
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; valid: 'auto', " + ", ".join(repr(n) for n in KERNELS))


def _check_no_grad(function, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{function} is forward only (inference) and has no gradient, but {name} requires grad: "
                             "call it under torch.no_grad() or pass detached tensors")


def _check_inputs(q, k, v, causal, softmax_scale, kernel, return_lse, window=(-1, -1), alibi_slopes=None, softcap=0.0,
                  B=None):
    """Every check that needs no GPU, in Python, before any launch (the kernel's fit is checked by pick_kernel
    inside the op, which knows the GPU). B: the number of sequences, if not q's first dimension. (Each shape is
    read once and devices are compared by index: a decoding call's checks cost the host a few microseconds.)"""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, N, d), got shape {tuple(t.shape)}")
    q_shape, k_shape = q.shape, k.shape
    if k_shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, H_kv, N_k, d), got {tuple(k_shape)}, {tuple(v.shape)}")
    if q_shape[0] != k_shape[0] or q_shape[3] != k_shape[3]:
        raise ValueError(f"q (B, H_q, N_q, d) and k, v (B, H_kv, N_k, d) must have the same B and d, got "
                         f"{tuple(q_shape)} and {tuple(k_shape)}")
    if (k_shape[1] == 0 and q_shape[1] > 0) or (k_shape[1] > 0 and q_shape[1] % k_shape[1]):
        raise ValueError(f"the query heads H_q must be a multiple of the key/value heads H_kv (grouped-query "
                         f"attention), got H_q = {q_shape[1]}, H_kv = {k_shape[1]}")
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPES):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype not in DTYPES:
                raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_causal_and_scale(causal, softmax_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    _check_scores(q, window, alibi_slopes, softcap, q_shape[0] if B is None else B)
    _check_kernel_name(kernel)
    if not 1 <= q_shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"the head dim d must be between 1 and {MAX_HEAD_DIM}, got {q_shape[3]}")
    if q_shape[0] > MAX_GRID or q_shape[1] > MAX_GRID:
        raise ValueError(f"B and H must each be at most {MAX_GRID}, got B = {q_shape[0]}, H = {q_shape[1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # (last: every other mistake is reported on CPU tensors too)
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
    if not (q.get_device() == k.get_device() == v.get_device()):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


FLOAT32_SCALE_MAX = torch.finfo(torch.float32).max / math.log2(math.e)  # a scale or softcap float32 still holds


def _check_causal_and_scale(causal, softmax_scale):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not abs(softmax_scale) <= FLOAT32_SCALE_MAX):
        raise ValueError(f"softmax_scale must be None or a finite number of at most {FLOAT32_SCALE_MAX:.3g} in size "
                         f"(the kernels multiply it by log2(e) in float32), got {softmax_scale!r}")


def _check_window(window):
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window)):
        raise ValueError(f"window_size must be a pair of integers (left, right), each >= -1 (-1: no bound), "
                         f"got {window!r}")


def _check_scores(q, window, alibi_slopes, softcap, B):
    """The masks and score modifications (flash.cu's Scores), checked as FlashAttention takes them."""
    _check_window(window)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap <= FLOAT32_SCALE_MAX:
        raise ValueError(f"softcap must be a number from 0 (off) to {FLOAT32_SCALE_MAX:.3g} (float32's range), got "
                         f"{softcap!r}")
    if alibi_slopes is not None:
        H_q = q.shape[1]
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be None or a torch.Tensor, got {type(alibi_slopes).__name__}")
        if (alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) not in ((H_q,), (B, H_q))
                or alibi_slopes.device != q.device):
            raise ValueError(f"alibi_slopes must be a float32 tensor of shape (H_q,) = ({H_q},) or (B, H_q) = "
                             f"({B}, {H_q}) on {q.device}, got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)} "
                             f"on {alibi_slopes.device}")


def _check_dropout(dropout_p, deterministic, dropout_seed):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None, True or False, got {deterministic!r}")
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int)
                                     or not 0 <= dropout_seed < 2 ** 63):
        raise ValueError(f"dropout_seed must be None or an integer in [0, 2^63), got {dropout_seed!r}")


def _dropout_key(dropout_p, dropout_seed, device):
    """The Philox key of one call's dropout, int64 (1,) on the GPU (where the kernels read it): dropout_seed, or
    drawn from torch's generator of that device, so that torch.manual_seed reproduces a run (and CUDA graphs and
    torch.compile replay the draw). None without dropout."""
    if dropout_p == 0:
        return None
    if dropout_seed is not None:
        return torch.tensor([dropout_seed], dtype=torch.int64, device=device)
    return torch.randint(0, 2 ** 63 - 1, (1,), dtype=torch.int64, device=device)


def dropout_mask(q, k, dropout_p, dropout_seed):
    """The keep mask (B, H_q, N_q, N_k), bool, of flash_attention(q, k, v, dropout_p=dropout_p,
    dropout_seed=dropout_seed): the entries of P it keeps (and scales by reference.dropout_scale(dropout_p)).
    Computed by reference.dropout_keep from the same Philox bits as the kernels, on q's device."""
    import reference
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int):
        raise TypeError(f"dropout_mask needs the call's dropout_seed, an int (a call without one draws its key from "
                        f"PyTorch's generator, which cannot be read back), got {dropout_seed!r}")
    return reference.dropout_keep(dropout_seed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p, q.device)


def _options(causal, window, alibi_slopes, softcap):
    """The arguments the kernels take: window (left, right) with causal as right = 0 (FlashAttention's rule),
    softcap as a float, the slopes contiguous."""
    left, right = (min(w, 2 ** 31 - 1) for w in window)  # (a side past any sequence's length bounds nothing)
    return (left, 0 if causal else right), float(softcap), None if alibi_slopes is None else alibi_slopes.contiguous()


def flash_attention(q, k, v, causal=False, softmax_scale=None, kernel="auto", return_lse=False,
                    window_size=(-1, -1), alibi_slopes=None, softcap=0.0, dropout_p=0.0, deterministic=None,
                    dropout_seed=None):
    """softmax(q k^T * softmax_scale) v without an N_q x N_k matrix. q (B, H_q, N_q, d); k, v (B, H_kv, N_k, d),
    where H_kv divides H_q: query head h reads key/value head h // (H_q / H_kv) (grouped-query attention).

    causal: aligned to the bottom right, as in FlashAttention: query i sees keys j <= i + N_k - N_q (for
    N_q = N_k, keys 0..i); a query that sees no key (N_q > N_k) gets 0, and L = -inf (FlashAttention-2's
    non-split kernels give +inf there). softmax_scale: default 1/sqrt(d). kernel: "auto" picks the best for this
    dtype and GPU; a name from list_kernels() forces that kernel. return_lse: also return L (B, H_q, N_q),
    float32, the natural-log log-sum-exp of each row of scores (FlashAttention's softmax_lse), which lets
    partial results be merged (reference.merge).
    Differentiable, L included. On the split_kv kernels, N_q <= SPLIT_KV_MAX_QUERIES (decoding) runs a
    split-KV kernel that spreads the keys over the GPU.

    Masks and score modifications, as FlashAttention's arguments of the same names (reference.py has each):
    window_size (left, right): query i sees keys j with i + N_k - N_q - left <= j <= i + N_k - N_q + right; -1
    is no bound; causal sets right = 0 (a sliding window: causal=True, window_size=(w, -1)). Key blocks outside
    every window are never computed. alibi_slopes (H_q,) or (B, H_q), float32: adds -slope_h |i + N_k - N_q - j| to
    the scaled scores. softcap c > 0: scores become c tanh(scores / c) (after the scale, before ALiBi).

    dropout_p: dropout of the attention probabilities P, in the kernels (each entry kept with probability
    1 - p and scaled by 1 / (1 - p), p rounded to a multiple of 1/256); the backward regenerates the same mask.
    dropout_seed: the Philox key (an int in [0, 2^63)); None draws one from torch's generator, so that
    torch.manual_seed reproduces a run. dropout_mask(q, k, dropout_p, dropout_seed) is the mask a seed gives.
    deterministic: the backward computes dQ without atomics, in a second kernel with query blocks outer, so
    that two runs give bit-identical gradients (and no fp32 copy of dQ is needed); it costs time (README).
    None (the default): as torch.use_deterministic_algorithms asks (off unless a user turned it on).
    """
    _check_dropout(dropout_p, deterministic, dropout_seed)
    _check_inputs(q, k, v, causal, softmax_scale, kernel, return_lse, window_size, alibi_slopes, softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window, softcap, alibi_slopes = _options(causal, window_size, alibi_slopes, softcap)
    dropout = float(dropout_p), _dropout_key(dropout_p, dropout_seed, q.device)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or
                                                                      v.requires_grad)):
        deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic
        o, L = _forward(q, k, v, *window, scale, softcap, alibi_slopes, kernel, *dropout, deterministic)
    else:  # inference, eagerly: the kernels without the op's dispatch, which costs as much as a decoding step
        o, L = _run_forward(q, k, v, window, scale, softcap, alibi_slopes, kernel, dropout_p=dropout[0],
                            dropout_key=dropout[1])
    return (o, L) if return_lse else o


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, causal=True,
                                 softmax_scale=None, kernel="auto", return_lse=False, window_size=(-1, -1),
                                 alibi_slopes=None, softcap=0.0):
    """Attention of new tokens against a KV cache, for generation (inference: no gradients).

    q (B, H_q, N_q, d): the new tokens' queries. k_cache, v_cache (B, H_kv, N_max, d): room for N_max tokens per
    sequence, of which sequence b holds the first cache_seqlens[b] (an int, or an integer tensor (B,)). k, v
    (B, H_kv, N_new, d), if given, are written into the caches in place at positions cache_seqlens[b] ..
    cache_seqlens[b] + N_new - 1 first (cache_seqlens itself is not changed: add N_new for the next step). Each
    sequence then attends over its own cache_seqlens[b] + N_new keys; with causal (the default) new token i
    sees them up to itself (bottom right). Decoding (N_q <= SPLIT_KV_MAX_QUERIES on a split_kv kernel) reads
    the lengths on the GPU; otherwise each sequence is one flash_attention call on a view of its cache.
    window_size, alibi_slopes, softcap: as flash_attention's, aligned to each sequence's own length.
    FlashAttention's flash_attn_with_kvcache differs: (B, N, H, d) tensors, causal=False by default, cache_seqlens
    optional (None: the whole cache), return_softmax_lse for return_lse.
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_no_grad("flash_attention_with_kvcache", q, k, v)
    _check_inputs(q, k_cache, v_cache, causal, softmax_scale, kernel, return_lse, window_size, alibi_slopes,
                  softcap)
    B, H_kv, N_max, d = k_cache.shape
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new tokens' keys and values), or neither")
    N_new = 0
    if k is not None:
        _check_inputs(q, k, v, causal, softmax_scale, kernel, return_lse)
        if k.shape[1] != H_kv or k.dtype != k_cache.dtype or k.device != k_cache.device:
            raise ValueError(f"k, v must be (B, H_kv, N_new, d) = (B, {H_kv}, N_new, {d}) in the caches' dtype and "
                             f"device, got {tuple(k.shape)}, {k.dtype}, {k.device}")
        N_new = k.shape[2]
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or an integer tensor (B,), got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, torch.Tensor) and (cache_seqlens.shape != (B,) or cache_seqlens.is_floating_point()
                                                    or cache_seqlens.dtype == torch.bool):
        raise ValueError(f"cache_seqlens must be an integer tensor of shape ({B},), got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    # Checked as Python ints, before any cast that could wrap them (one synchronisation: a bad length must raise,
    # not fault on the GPU)
    given = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * B
    if not all(0 <= n <= N_max - N_new for n in given):
        raise ValueError(f"cache_seqlens + N_new must lie in [N_new, N_max] = [{N_new}, {N_max}] for every sequence, "
                         f"got cache_seqlens = {given if B <= 16 else given[:16] + ['...']}, N_new = {N_new}")
    if B == 0:
        o = q.new_empty(q.shape)
        return (o, q.new_empty(q.shape[:-1], dtype=torch.float32)) if return_lse else o
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    window, softcap, alibi_slopes = _options(causal, window_size, alibi_slopes, softcap)
    kernel = pick_kernel(DTYPES[q.dtype], d, _arch(q.device), kernel, _builds_sm90a())  # (all checks before the append)
    seqlens = torch.tensor(given, dtype=torch.int32, device=q.device)
    lengths = [n + N_new for n in given]
    if N_new:  # append: k_cache[b, :, seqlens[b] + n] = k[b, :, n]
        positions = seqlens[:, None].long() + torch.arange(N_new, device=q.device)        # (B, N_new)
        batch = torch.arange(B, device=q.device)[:, None]
        k_cache[batch, :, positions] = k.transpose(1, 2)  # indexed as (B, N_new, H_kv, d)
        v_cache[batch, :, positions] = v.transpose(1, 2)
    if KERNELS[kernel]["split_kv"] and q.shape[2] <= SPLIT_KV_MAX_QUERIES and _decoding_takes_lengths(kernel, q):
        o, L = _run_forward(q, k_cache, v_cache, window, scale, softcap, alibi_slopes, kernel, seqlens + N_new)
    else:
        per_batch = alibi_slopes is not None and alibi_slopes.dim() == 2  # (B, H_q): sequence b's row
        parts = [_run_forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n], window, scale, softcap,
                              alibi_slopes[b] if per_batch else alibi_slopes, kernel)
                 for b, n in enumerate(lengths)]
        o, L = (torch.cat(x) for x in zip(*parts))
    return (o, L) if return_lse else o


def _decoding_takes_lengths(kernel, q):
    """Whether kernel's split-KV decoding takes the cache lengths for q's dtype and head dim on this GPU (flash.cu's
    decoding_takes_lengths: not where the ampere kernel's two stages exceed a block's shared memory, d >= 192 on sm_86
    and sm_89, or under FLASH_SMEM_LIMIT). Where not, each sequence is decoded by the forward kernel, on a view of
    its valid rows."""
    D = tile_dim(kernel, q.shape[-1])
    with _on_device(q):
        return load(kernel, D).decoding_takes_lengths(q.new_empty(0, 0, 0, D))


# ---------------------------------------------------------------------------------------------------------
# Packed batches of sequences of different lengths, as FlashAttention's varlen functions: q (total_q, H_q, d),
# sequence b its rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1. The kernels see (1, H, total, d) views and find
# each sequence's rows and lengths from cu_seqlens (flash.cu's Rows and Mask), in an extension built with
# -DPACKED=1 on first use.

def _as_batch(x):
    """(total, H, d) -> the (1, H, total, d) view the kernels read (and L (H, total) -> (1, H, total))."""
    return x.unsqueeze(0).transpose(1, 2) if x.dim() == 3 else x.unsqueeze(0)


def _as_packed(x):
    """(1, H, total, d) -> (total, H, d), contiguous (and (1, H, total) -> (H, total))."""
    return x[0].transpose(0, 1).contiguous() if x.dim() == 4 else x[0]


def _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """Each sequence's length against the maxima that size the grid and the tensors' totals: a wrong value
    would make the kernels skip rows or read past a sequence, so it raises (one synchronisation)."""
    for name, cu, longest, total in (("q", cu_seqlens_q, max_seqlen_q, total_q),
                                     ("k", cu_seqlens_k, max_seqlen_k, total_k)):
        starts = cu.tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        if starts[0] != 0 or starts[-1] != total or min(lengths, default=0) < 0:
            raise ValueError(f"cu_seqlens_{name} must start at 0, never decrease and end at {total} (the rows of "
                             f"{name}), got {starts}")
        if max(lengths, default=0) > longest:
            raise ValueError(f"max_seqlen_{name} = {longest} is less than the longest sequence, {max(lengths)}")


@torch.library.custom_op("flash::varlen_forward", mutates_args=())
def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, window_left: int,
                    window_right: int, scale: float, softcap: float, alibi_slopes: Optional[torch.Tensor],
                    kernel: str, dropout_p: float = 0.0, dropout_key: Optional[torch.Tensor] = None,
                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """O (total_q, H_q, d) and L (H_q, total_q) of a packed batch."""
    _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    o, L = _run_forward(*(_as_batch(t) for t in (q, k, v)), (window_left, window_right), scale, softcap, alibi_slopes,
                        kernel, packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p=dropout_p,
                        dropout_key=dropout_key)
    return _as_packed(o), _as_packed(L)


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, scale, softcap,
      alibi_slopes, kernel, dropout_p=0.0, dropout_key=None, deterministic=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[1::-1], dtype=torch.float32)


@torch.library.custom_op("flash::varlen_backward", mutates_args=())
def _varlen_backward(do: torch.Tensor, dL: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, L: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, window_left: int, window_right: int, scale: float,
                     softcap: float, alibi_slopes: Optional[torch.Tensor], kernel: str, dropout_p: float = 0.0,
                     dropout_key: Optional[torch.Tensor] = None,
                     deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of a packed batch, as _backward."""
    grads = _run_backward(*(None if t is None else _as_batch(t) for t in (do, dL, q, k, v, o, L)), window_left,
                          window_right, scale, softcap, alibi_slopes, kernel,
                          packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), dropout_p=dropout_p,
                          dropout_key=dropout_key, deterministic=deterministic)
    return tuple(_as_packed(g) for g in grads)


@_varlen_backward.register_fake
def _(do, dL, q, k, v, o, L, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
      scale, softcap, alibi_slopes, kernel, dropout_p=0.0, dropout_key=None, deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options
    ctx.set_materialize_grads(False)


def _varlen_autograd_backward(ctx, do, dL):
    q, k, v, o, L, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _varlen_backward(do, dL, q, k, v, o, L, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.options))


_varlen_forward.register_autograd(_varlen_autograd_backward, setup_context=_varlen_setup_context)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, kernel="auto", return_lse=False, window_size=(-1, -1),
                           alibi_slopes=None, softcap=0.0, dropout_p=0.0, deterministic=None, dropout_seed=None):
    """flash_attention on a packed batch of B sequences of different lengths, as FlashAttention's
    flash_attn_varlen_func: q (total_q, H_q, d), k, v (total_k, H_kv, d), the sequences one after another, with
    no padding. Sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q and cu_seqlens_k[b] ..
    cu_seqlens_k[b+1]-1 of k and v (cu_seqlens: int32 (B + 1,), from 0 to total, on q's device); max_seqlen_q,
    max_seqlen_k: at least the longest sequence's length (they size the grid). Every sequence attends to its
    own keys only, causal (bottom right), window_size and ALiBi aligned to its own lengths; alibi_slopes may be
    (H_q,) or (B, H_q). Returns o (total_q, H_q, d), and with return_lse L (H_q, total_q), float32, FlashAttention's
    layout. Differentiable, L included. dropout_p, deterministic, dropout_seed: as flash_attention's; sequence b
    draws the mask of batch b of a padded batch (reference.dropout_keep(..., first_batch=b)), its rows and keys
    counted from its own start."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be a packed tensor (total, H, d), got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q (total_q, H_q, d) and k, v (total_k, H_kv, d) must have the same d, and k and v one "
                         f"shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if (not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2
                or cu.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor (B + 1,) with B >= 1 on {q.device}, got "
                             + (f"{cu.dtype} {tuple(cu.shape)} on {cu.device}" if isinstance(cu, torch.Tensor)
                                else type(cu).__name__))
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences, got {cu_seqlens_q.numel()}"
                         f" and {cu_seqlens_k.numel()} entries")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2 ** 31:
            raise ValueError(f"{name} must be an integer in [0, 2^31), got {n!r}")
    B = cu_seqlens_q.numel() - 1
    if B > MAX_GRID:
        raise ValueError(f"B must be at most {MAX_GRID} sequences, got {B}")
    _check_dropout(dropout_p, deterministic, dropout_seed)
    _check_inputs(*(_as_batch(t) for t in (q, k, v)), causal, softmax_scale, kernel, return_lse, window_size,
                  alibi_slopes, softcap, B)
    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window, softcap, alibi_slopes = _options(causal, window_size, alibi_slopes, softcap)
    o, L = _varlen_forward(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                           *window, scale, softcap, alibi_slopes, kernel, float(dropout_p),
                           _dropout_key(dropout_p, dropout_seed, q.device), deterministic)
    return (o, L) if return_lse else o


# ---------------------------------------------------------------------------------------------------------
# 8-bit attention, forward only (inference): flash.cu's section 8. quantize() makes the 8-bit inputs, with one scale
# per QUANT_ROWS rows of a head; flash_attention_8bit runs the fp8 kernel (hopper_fp8: e4m3 wgmma, sm_90) or the int8
# one (ampere_int8: s8 mma.sync for S = Q K^T, P V in fp16/bf16, sm_80+). Each is its own extension per tile width
# (64, 128 or 256: d is padded up to it), built on first use.

EIGHT_BIT = {torch.float8_e4m3fn: "hopper_fp8", torch.int8: "ampere_int8"}
EIGHT_BIT_HEAD_DIMS = (64, 128, 256)
# The largest |x_hat| of each input (x = scale * x_hat): int8's 127; for fp8, e4m3's 448 for v, and for q and k,
# whose products the fp8 kernel sums in fp16, 16 up to D = 128 and 11 at 256 (by tile width D), so that D products
# stay within 128 * 16^2 = 32768 (256 * 11^2 = 30976; fp16 holds 65504).
FP8_MAX, INT8_MAX, FP8_QK_MAX = 448.0, 127.0, {64: 16.0, 128: 16.0, 256: 11.0}
QUANT_ROWS = int(re.search(r"constexpr int QUANT_ROWS = (\d+);", open(os.path.join(ROOT, "flash.cu")).read()).group(1))


class Quantized(NamedTuple):
    """8-bit q, k (and v, for fp8) with their scales, as quantize() returns them: x = scale * x_hat per block of
    QUANT_ROWS rows of a head, scale = max |x| / range over the block (range: FP8_QK_MAX[D], FP8_MAX or INT8_MAX).
    q, k: (B, H, N, D) int8 or float8_e4m3fn, D the tile width (64, 128 or 256, the columns past d zero); v: fp8, (B,
    H_kv, N_k, D), or (B, H_kv, D, N_pad) if v_transposed (keys in the kernel's order, flash.cu's key_position);
    int8, v itself (fp16/bf16). q_scale, k_scale, v_scale: (B, H, ceil(N / QUANT_ROWS)) float32 (v_scale None for
    int8). d: the head dim before padding; out_dtype: the output's dtype. (int8's v is kept as given, and padded
    where the kernel reads it.)"""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: Optional[torch.Tensor]
    v_transposed: bool
    d: int
    out_dtype: torch.dtype


def _eight_bit_kernel(dtype, device):
    """The 8-bit kernel of dtype (a key of EIGHT_BIT), if this GPU runs it."""
    kernel, arch = EIGHT_BIT[dtype], _arch(device)
    if dtype == torch.float8_e4m3fn and not (arch == 90 and _builds_sm90a()):
        raise ValueError(f"fp8 attention needs an sm_90 GPU (Hopper) and an sm_90a build; this is sm_{arch}")
    if dtype == torch.int8 and arch < 80:
        raise ValueError(f"int8 attention needs sm_80 or newer; this is sm_{arch}")
    return kernel


@torch.library.custom_op("flash::quantize", mutates_args=())
def _quantize(x: torch.Tensor, mean: Optional[torch.Tensor], signs: Optional[torch.Tensor], fp8: bool,
              transpose: bool, D: int, value_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, d) padded to (B, H, N, D) -> x_hat (|x_hat| <= value_range) and its scales (flash.cu's
    quantize). (The checks and the copies that need the GPU or the data's address run here, where torch.compile
    leaves them to run.)"""
    kernel = _eight_bit_kernel(torch.float8_e4m3fn if fp8 else torch.int8, x.device)
    with _on_device(x):
        return load(kernel, D).quantize(_readable(_padded(x, D)), mean, signs, transpose, value_range, _stream(x))


@_quantize.register_fake
def _(x, mean, signs, fp8, transpose, D, value_range):
    B, H, N, _ = x.shape
    T = (N + QUANT_ROWS - 1) // QUANT_ROWS
    dtype = torch.float8_e4m3fn if fp8 else torch.int8
    return x.new_empty((B, H, D, T * QUANT_ROWS) if transpose else (B, H, N, D), dtype=dtype), x.new_empty(
        (B, H, T), dtype=torch.float32)


@torch.library.custom_op("flash::forward_8bit", mutates_args=())
def _forward_8bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: Optional[torch.Tensor], v_transposed: bool, window_left: int, window_right: int,
                  scale: float, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, H_q, N_q, D) and L of quantized inputs (flash.cu's 8-bit forward)."""
    with _on_device(q):  # (int8: v as given, padded to q's tile width here)
        return load(EIGHT_BIT[q.dtype], q.shape[-1]).forward(
            q, k, v if v.dtype == q.dtype else _readable(_padded(v, q.shape[-1])), q_scale, k_scale, v_scale,
            v_transposed, window_left, window_right, scale, bf16, _stream(q))


@_forward_8bit.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, v_transposed, window_left, window_right, scale, bf16):
    return (q.new_empty(q.shape, dtype=torch.bfloat16 if bf16 else torch.float16),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


def rotation_signs(D, seed=0, device="cuda"):
    """The random signs (D,) float32 of quantize's rotation H = diag(signs) Hadamard / sqrt(D), from seed: the top
    bit of a multiplicative hash of (seed, column), plain tensor arithmetic that torch.compile traces."""
    x = (torch.arange(D, device=device, dtype=torch.int64) + seed * 0x10001) * 0x9E3779B1 % 2**32
    return 1.0 - 2.0 * (x >> 31).float()


def quantize(q, k, v, dtype=torch.float8_e4m3fn, rotate=False, smooth_k=None, transpose_v=None, seed=0):
    """q, k, v (fp16/bf16, flash_attention's shapes, d <= 256) as 8-bit inputs of flash_attention_8bit: a Quantized.
    dtype: torch.float8_e4m3fn (Hopper: q, k and v in e4m3) or torch.int8 (sm_80+: q and k in int8, v kept).
    rotate: q and k times one random orthogonal H = diag(signs) Hadamard / sqrt(D) (signs from seed), which leaves
    q k^T unchanged and spreads outlier channels (FlashAttention-3's incoherent processing). smooth_k (default: on
    for int8): k minus its mean over the keys, which the softmax cancels. transpose_v (default: on for fp8, which
    only fp8 takes): v written transposed, so that the kernel need not transpose it (the faster call end to end:
    README). One fused kernel per tensor (a second pass, for k's mean, if smoothed)."""
    if dtype not in EIGHT_BIT:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    transpose_v = dtype == torch.float8_e4m3fn if transpose_v is None else transpose_v
    smooth_k = dtype == torch.int8 if smooth_k is None else smooth_k
    for name, flag in (("rotate", rotate), ("smooth_k", smooth_k), ("transpose_v", transpose_v)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if transpose_v and dtype != torch.float8_e4m3fn:
        raise ValueError(f"transpose_v is for fp8 (the int8 kernel keeps v in fp16/bf16, read as stored), got dtype "
                         f"{dtype}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed must be an integer in [0, 2^32), got {seed!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # (the rest of flash_attention's checks follow)
        if isinstance(t, torch.Tensor) and t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"8-bit attention quantizes float16 or bfloat16 inputs; {name} is {t.dtype}")
    _check_inputs(q, k, v, False, None, "auto", False)
    if q.shape[-1] > max(EIGHT_BIT_HEAD_DIMS):
        raise ValueError(f"8-bit attention takes head dims up to {max(EIGHT_BIT_HEAD_DIMS)}, got d = {q.shape[-1]}")
    fp8, d = dtype == torch.float8_e4m3fn, q.shape[-1]
    D = min(D for D in EIGHT_BIT_HEAD_DIMS if D >= d)
    signs = rotation_signs(D, seed, q.device) if rotate else None
    mean = _padded(k.mean(2, dtype=torch.float32), D).contiguous() if smooth_k and k.shape[2] > 0 else None
    qk_range = FP8_QK_MAX[D] if fp8 else INT8_MAX
    q8, q_scale = _quantize(q, None, signs, fp8, False, D, qk_range)
    k8, k_scale = _quantize(k, mean, signs, fp8, False, D, qk_range)
    v8, v_scale = _quantize(v, None, None, True, transpose_v, D, FP8_MAX) if fp8 else (v, None)
    return Quantized(q8, k8, v8, q_scale, k_scale, v_scale, transpose_v, d, q.dtype)


def flash_attention_8bit(q, k=None, v=None, causal=False, softmax_scale=None, window_size=(-1, -1),
                         dtype=torch.float8_e4m3fn, rotate=False, smooth_k=None, transpose_v=None):
    """Attention with 8-bit products, forward only (inference): O (B, H_q, N_q, d) in q's dtype. q, k, v as
    flash_attention's (float16 or bfloat16, d <= 256, requires_grad off), quantized here by quantize(q, k, v, dtype,
    rotate, smooth_k, transpose_v); or q a Quantized from quantize() (k, v None), to quantize once and reuse.
    causal, softmax_scale, window_size: as flash_attention's (the default scale from the unpadded d;
    softmax_scale >= 0). dtype: torch.float8_e4m3fn (Hopper) or torch.int8 (sm_80+). Errors: docs/accuracy.md."""
    # The arguments first, so that bad ones raise before quantize launches anything. (A negative scale would reverse
    # the row maxima, which the fp8 kernel takes before scaling.)
    _check_window(window_size)
    _check_causal_and_scale(causal, softmax_scale)
    if softmax_scale is not None and softmax_scale < 0:
        raise ValueError(f"flash_attention_8bit takes softmax_scale >= 0, got {softmax_scale!r}")
    if isinstance(q, Quantized):
        if k is not None or v is not None:
            raise ValueError("pass either q, k, v or one Quantized (from quantize()), not both")
        if rotate or smooth_k is not None or transpose_v is not None:
            raise ValueError(f"a Quantized was made by quantize(), which took rotate, smooth_k and transpose_v; got "
                             f"rotate={rotate!r}, smooth_k={smooth_k!r}, transpose_v={transpose_v!r} with one")
        x = q
    else:
        _check_no_grad("flash_attention_8bit", q, k, v)
        x = quantize(q, k, v, dtype, rotate, smooth_k, transpose_v)
    scale = 1.0 / math.sqrt(x.d) if softmax_scale is None else float(softmax_scale)
    (left, right), _, _ = _options(causal, window_size, None, 0.0)
    if x.q.numel() == 0 or x.k.shape[2] == 0:  # (no keys: O = 0, as flash_attention)
        return x.q.new_zeros(x.q.shape[:-1] + (x.d,), dtype=x.out_dtype)
    o, _ = _forward_8bit(x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, x.v_transposed, left, right, scale,
                         x.out_dtype == torch.bfloat16)
    return o[..., :x.d] if o.shape[-1] != x.d else o


# ---------------------------------------------------------------------------------------------------------
# Measuring errors (the self-check below, tests/ and docs/make_accuracy.py), and python main.py.

# The self-check's bound on rel_err against float64 for a ragged causal problem, per input dtype.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}


def rel_err(x, ref):
    """||x - ref|| / ||ref||, with a tiny floor: some exact gradients are zero (N = 1: dQ = dK = 0)."""
    return ((x.double() - ref).norm() / (ref.norm() + 1e-6 * ref.numel() ** 0.5)).item()


def outputs(attention, q, k, v, do):
    """[O, dQ, dK, dV]: attention(q, k, v) and its gradients for the loss sum(O * dO), on fresh leaf copies."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v)
    return [o, *torch.autograd.grad(o, (q, k, v), do)]


def time_ms(fn, warmup_ms=25, rep_ms=100, group=100):
    """Median GPU time of fn() in ms after warm-up: CUDA events around each call, L2 emptied before each by a
    256 MB write, and the host kept ahead of the GPU. The last matters where a call's host side (Python, checks,
    launches) takes longer than its kernels, as in a decoding step of 15 us on the GPU and 25 on the host: had the
    GPU finished the write before the host launched the call, it would wait between the two events, and the
    timer would measure the host. So every `group` calls are queued behind a sleep on the GPU twice as long as the
    host takes to queue them. (bench.py --decode times the host's side apart.)"""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    queued = time.perf_counter()
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    host = (time.perf_counter() - queued) / 5  # seconds the host takes to queue a write and a call
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)  # ms the GPU takes for them
    for _ in range(int(warmup_ms / estimate)):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(5, int(rep_ms / estimate)))]
    for first in range(0, len(events), group):
        calls = events[first:first + group]
        torch.cuda._sleep(int(2 * len(calls) * host * 2e9))  # (in clock cycles, 2e9 a second at most)
        for start, end in calls:
            flush.zero_()
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


def _check_cpu():
    import reference
    print("No CUDA GPU found: checking the paper-notation reference (reference.py) on the CPU instead.")
    print(f"{'N':>5} {'d':>4} {'causal':>6} {'err O':>9} {'err dQ':>9} {'err dK':>9} {'err dV':>9}")
    worst = 0.0
    for N, d, causal in [(1, 16, False), (65, 32, True), (200, 64, False), (200, 64, True)]:
        q, k, v, do = (torch.randn(2, 3, N, d, dtype=torch.float64) for _ in range(4))
        exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal), q, k, v, do)
        o, L = reference.flash_forward(q, k, v, causal, B_r=32, B_c=48)
        grads = reference.flash_backward(q, k, v, o, L, do, causal, B_r=32, B_c=48)
        errs = [rel_err(x, e) for x, e in zip([o, *grads], exact)]
        worst = max(worst, *errs)
        print(f"{N:>5} {d:>4} {str(causal):>6} " + " ".join(f"{e:9.1e}" for e in errs))
    assert worst < 1e-9, f"reference.py disagrees with dense attention: relative error {worst:.1e}"
    print("reference.py matches dense attention in float64. (At N = 1 a query sees one key, so the exact dQ and dK\n"
          "are 0, and their error is measured against rel_err's floor of 1e-6 per element: hence 1e-10.)")


def _check_gpu():
    import reference
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{_arch()}), torch {torch.__version__}, CUDA {torch.version.cuda}")
    names = [kn["name"] for kn in list_kernels() if kn["available"]]
    # and the other builds the tests use, so that they compile here, all at once, and not one by one in the tests:
    # dropout (at 64 and 128; ampere also at 256), the deterministic backward with and without dropout, packed
    # batches with dropout, and the 8-bit kernels
    backward = [n for n in names if KERNELS[n]["backward_kernel"] == n]
    # (the 8-bit kernels run where their 16-bit kernels do: fp8 where hopper does, int8 where ampere does)
    eight_bit = [EIGHT_BIT[t] for t, on in ((torch.float8_e4m3fn, "hopper"), (torch.int8, "ampere")) if on in names]
    variants = ([(n, d, False, True) for n in names for d in (64, 128)]
                + ([("ampere", 256, False, True)] if "ampere" in names else [])
                + [(n, 64, False, p, True) for n in backward for p in (False, True)]
                + [(n, 64, True, True) for n in backward] + [(n, d) for n in eight_bit for d in EIGHT_BIT_HEAD_DIMS])
    t0 = time.time()
    print(f"Building (or loading) {', '.join(names)} at every tile width, for packed batches at 64 and 128, and "
          f"{len(variants)} builds more that the tests use (dropout, deterministic, 8-bit)...", flush=True)
    build(names, sorted({d for kn in KERNELS.values() for d in kn["head_dims"]}), (64, 128), variants)
    print(f"ready in {time.time() - t0:.1f} s")
    torch.backends.cuda.matmul.allow_tf32 = False
    # PyTorch warns when autograd's own thread makes the first cuBLAS call; it sets the context itself.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    print(f"{'kernel':<8} {'dtype':<9} {'err O':>8} {'err dQ':>8} {'err dK':>8} {'err dV':>8} "
          f"{'fwd ms':>7} {'vs manual':>9}")
    failed = []
    for kn in list_kernels():
        if not kn["available"]:
            print(f"{kn['name']:<8} not available on this GPU (needs {_gpus(kn)})")
            continue
        for dtype_name in kn["dtypes"]:
            dtype = getattr(torch, dtype_name)
            # correctness on a ragged causal problem: every error is relative to a float64 reference
            q, k, v, do = (torch.randn(2, 3, 200, 64, device="cuda", dtype=dtype) for _ in range(4))
            exact = outputs(lambda q, k, v: reference.attention(q, k, v, causal=True), *(t.double() for t in (q, k, v, do)))
            ours = outputs(lambda q, k, v: flash_attention(q, k, v, causal=True, kernel=kn["name"]), q, k, v, do)
            errs = [rel_err(x, e) for x, e in zip(ours, exact)]
            # speed on a larger problem, against manual attention in the same dtype
            q, k, v = (torch.randn(8, 8, 1024, 64, device="cuda", dtype=dtype) for _ in range(3))
            ms = time_ms(lambda: flash_attention(q, k, v, kernel=kn["name"]))
            ms_manual = time_ms(lambda: reference.attention(q, k, v))
            print(f"{kn['name']:<8} {dtype_name:<9} " + " ".join(f"{e:8.1e}" for e in errs)
                  + f" {ms:7.3f} {ms_manual / ms:8.2f}x")
            if not max(errs) < TOLERANCE[dtype_name]:
                failed.append(f"{kn['name']} {dtype_name}: relative error {max(errs):.1e}")
    assert not failed, "self-check failed: " + "; ".join(failed)
    print("All kernels agree with float64 (relative Frobenius error; 'vs manual' > 1 means faster).")


if __name__ == "__main__":
    t0 = time.time()
    _check_gpu() if torch.cuda.is_available() else _check_cpu()
    print(f"done in {time.time() - t0:.1f} s")
