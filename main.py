"""The Python side of flash.cu: build on first use, validate inputs, autograd, and a self-check.

    from main import flash_attention, list_kernels
    o = flash_attention(q, k, v, causal=False, softmax_scale=None, kernel="auto")   # q, k, v: (B, H, N, d)

`python main.py` builds the kernels for this GPU, checks every available kernel forward and backward
against float64 and prints a table. Without a GPU it checks reference.py against dense attention instead.
"""
import math
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))

# One entry per kernel in flash.cu (its index at the top of that file says what each adds), from the most
# general to the most specialised. dtypes: input dtypes it takes; head_dims: values of d it is compiled
# for; min_arch: the oldest GPU it runs on, 10 * major + minor; sm90a: built for sm_90a only (wgmma,
# setmaxnreg), so it runs on sm_90 alone and only from a build that targets sm_90a; backward_kernel: the
# kernel that computes its gradients (volta and turing hand them to "fp32", on inputs upcast to float32).
KERNELS = {
    "fp32": dict(dtypes=("float32",), head_dims=(16, 32, 64, 96, 128), min_arch=70, backward_kernel="fp32",
                 about="FlashAttention-2 on CUDA cores, fp32"),
    "volta": dict(dtypes=("float16",), head_dims=(64, 128), min_arch=70, backward_kernel="fp32",
                  about="Volta tensor cores: mma.m8n8k4 in four quad pairs, P_ij through shared memory"),
    "turing": dict(dtypes=("float16",), head_dims=(64, 128), min_arch=75, backward_kernel="fp32",
                   about="Turing tensor cores: mma.m16n8k8, ldmatrix, synchronous loads, 64 KB of shared memory"),
    "ampere": dict(dtypes=("float16", "bfloat16"), head_dims=(64, 128), min_arch=80, backward_kernel="ampere",
                   about="FlashAttention-2 on tensor cores: mma.m16n8k16, ldmatrix, cp.async"),
    "hopper": dict(dtypes=("float16", "bfloat16"), head_dims=(64, 128), min_arch=90, sm90a=True,
                   backward_kernel="hopper", about="Hopper: TMA, wgmma, producer and consumer warpgroups (sm_90a)"),
}
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_GRID_Y = 65535  # B*H is the grid's y dimension


def _arch(device=None):
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _runs_on(kn, arch, sm90a=True):
    """Whether kernel kn runs on sm_<arch>; sm90a: the build targets sm_90a."""
    if kn.get("sm90a"):
        return arch == 90 and sm90a
    return arch >= kn["min_arch"]


def list_kernels():
    """One dict per kernel: name, dtypes, backward (has a backward kernel of its own), backward_kernel,
    head_dims, min_arch, sm90a (runs on sm_90 alone, from an sm_90a build), gpus (the GPUs in words),
    available (runs on this GPU), about."""
    arch = _arch() if torch.cuda.is_available() else 0
    return [dict(name=name, dtypes=list(k["dtypes"]), backward=k["backward_kernel"] == name,
                 backward_kernel=k["backward_kernel"], head_dims=list(k["head_dims"]), min_arch=k["min_arch"],
                 sm90a=k.get("sm90a", False), gpus=_gpus(k),
                 available=arch > 0 and _runs_on(k, arch, _builds_sm90a()), about=k["about"])
            for name, k in KERNELS.items()]


_extension = None


def _arch_list():
    """The targets flash.cu is built for: TORCH_CUDA_ARCH_LIST, else this GPU (9.0a on Hopper)."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_list:
        major, minor = torch.cuda.get_device_capability()
        arch_list = f"{major}.{minor}" + ("a" if major == 9 else "")  # sm_90a unlocks Hopper-only instructions
    return arch_list


def _builds_sm90a():
    return "9.0a" in _arch_list()


def load():
    """Compile flash.cu for the GPU present (or TORCH_CUDA_ARCH_LIST) once; later calls reuse the build."""
    global _extension
    if _extension is not None:
        return _extension
    from torch.utils.cpp_extension import load as load_extension
    arch_list = _arch_list()
    tag = "sm" + "_".join(a.replace(".", "").replace("+PTX", "ptx") for a in arch_list.replace(",", ";").split(";")
                          if a.strip())
    name = f"flash_{tag}".replace(" ", "")
    build_dir = os.path.join(ROOT, "build", name)
    os.makedirs(build_dir, exist_ok=True)
    if not any(f.endswith(".so") or f.endswith(".pyd") for f in os.listdir(build_dir)):
        print(f"Building flash.cu for {tag} (first use only; takes a minute or two)...", file=sys.stderr, flush=True)
    user_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list  # what torch's builder reads
    try:
        _extension = load_extension(
            name=name, sources=[os.path.join(ROOT, "flash.cu")], build_directory=build_dir,
            extra_cuda_cflags=["-O3", "-std=c++20", "-lineinfo", "-diag-suppress=3189,20013,20015"])
    finally:
        if user_arch_list is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
    return _extension


def _validate(q, k, v, causal, softmax_scale, kernel):
    """Check everything in Python before any launch; return the kernel name to run."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, N, d), got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape (B, H, N, d), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be None or a finite number, got {softmax_scale!r}")
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a string, got {type(kernel).__name__}")
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; valid: 'auto', " + ", ".join(repr(n) for n in KERNELS))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"B * H must be at most {MAX_GRID_Y}, got {q.shape[0]} * {q.shape[1]}")

    return pick_kernel(DTYPES[q.dtype], q.shape[-1], _arch(q.device), kernel, _builds_sm90a())


def pick_kernel(dtype, d, arch, kernel="auto", sm90a=True):
    """The kernel that runs dtype ("float16", ...) with head dim d on sm_<arch>: for "auto" the most specialised
    that fits (float16: volta on sm_70, turing on sm_75, ampere from sm_80 on, hopper on sm_90), else the one
    named if it fits. sm90a: flash.cu is built for sm_90a (the hopper kernel needs it)."""
    fits = [n for n, kn in KERNELS.items()
            if dtype in kn["dtypes"] and d in kn["head_dims"] and _runs_on(kn, arch, sm90a)]
    if kernel == "auto":
        if not fits:
            raise ValueError(f"no kernel takes dtype {dtype} with head dim {d} on sm_{arch}; kernels: "
                             + "; ".join(f"{n}: {kn['dtypes']}, d in {kn['head_dims']}, {_gpus(kn)}"
                                         for n, kn in KERNELS.items()))
        return fits[-1]  # KERNELS is ordered from the most general to the most specialised
    if kernel not in fits:
        kn = KERNELS[kernel]
        raise ValueError(f"kernel {kernel!r} takes dtypes {list(kn['dtypes'])}, head dims {list(kn['head_dims'])} "
                         f"and {_gpus(kn)}; got {dtype}, d={d}, sm_{arch}. "
                         f"Kernels that fit: {fits or 'none'}")
    return kernel


def _gpus(kn):
    return "sm_90 (built for sm_90a)" if kn.get("sm90a") else f"sm_{kn['min_arch']}+"


def _prepare(t):
    """Contiguous, 16-byte aligned (the kernels read 16 bytes at a time)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        q, k, v = _prepare(q), _prepare(k), _prepare(v)
        if q.numel() == 0:
            o, L = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        else:
            with torch.cuda.device(q.device):
                o, L = load().forward(kernel, q, k, v, causal, scale, torch.cuda.current_stream().cuda_stream)
        ctx.save_for_backward(q, k, v, o, L)
        ctx.causal, ctx.scale, ctx.kernel = causal, scale, kernel
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, L = ctx.saved_tensors
        if q.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
        kernel, dtype = KERNELS[ctx.kernel]["backward_kernel"], q.dtype
        tensors = (q, k, v, o, L, _prepare(do))
        if DTYPES[dtype] not in KERNELS[kernel]["dtypes"]:
            tensors = [t.float() for t in tensors]  # the fallback: the fp32 backward on upcast inputs
        with torch.cuda.device(q.device):
            grads = load().backward(kernel, *tensors, ctx.causal, ctx.scale, torch.cuda.current_stream().cuda_stream)
        return *(g.to(dtype) for g in grads), None, None, None


def flash_attention(q, k, v, causal=False, softmax_scale=None, kernel="auto"):
    """softmax(q k^T * softmax_scale) v for q, k, v of shape (B, H, N, d), without an N x N matrix.

    causal: query n sees keys 0..n only. softmax_scale: default 1/sqrt(d). kernel: "auto" picks the best
    for this dtype and GPU; a name from list_kernels() forces that kernel. Differentiable.
    """
    name = _validate(q, k, v, causal, softmax_scale, kernel)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return FlashAttention.apply(q, k, v, causal, scale, name)


# ---------------------------------------------------------------------------------------------------------
# Measuring errors (the self-check below, tests/ and docs/make_accuracy.py), and python main.py.

def rel_err(x, ref):
    """||x - ref|| / ||ref||, with a tiny floor: some exact gradients are zero (N = 1: dQ = dK = 0)."""
    return ((x.double() - ref).norm() / (ref.norm() + 1e-6 * ref.numel() ** 0.5)).item()


def outputs(attention, q, k, v, do):
    """[O, dQ, dK, dV]: attention(q, k, v) and its gradients for the loss sum(O * dO), on fresh leaf copies."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v)
    return [o, *torch.autograd.grad(o, (q, k, v), do)]


def _median_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


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
    print("reference.py matches dense attention in float64.")


def _check_gpu():
    import reference
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{_arch()}), torch {torch.__version__}, CUDA {torch.version.cuda}")
    load()
    torch.backends.cuda.matmul.allow_tf32 = False
    # PyTorch warns when autograd's own thread makes the first cuBLAS call; it sets the context itself.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    tolerance = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}
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
            ms = _median_ms(lambda: flash_attention(q, k, v, kernel=kn["name"]))
            ms_manual = _median_ms(lambda: reference.attention(q, k, v))
            print(f"{kn['name']:<8} {dtype_name:<9} " + " ".join(f"{e:8.1e}" for e in errs)
                  + f" {ms:7.3f} {ms_manual / ms:8.2f}x")
            if not max(errs) < tolerance[dtype_name]:
                failed.append(f"{kn['name']} {dtype_name}: relative error {max(errs):.1e}")
    assert not failed, "self-check failed: " + "; ".join(failed)
    print("All kernels agree with float64 (relative Frobenius error; 'vs manual' > 1 means faster).")


if __name__ == "__main__":
    t0 = time.time()
    _check_gpu() if torch.cuda.is_available() else _check_cpu()
    print(f"done in {time.time() - t0:.1f} s")
