#!/usr/bin/env python3
"""Device-free check (ctest cuda_bench.TorchProfileLinesWithAFakeTorch): torch_baseline.py's
profile lines — TORCH_BREAKDOWN / TORCH_KERNELS from one profiled step and TORCH_ATTENTION per
SDPA backend — run end to end against a small stand-in for the parts of torch they call, so a
slip in that code (a name, an argument, a format) fails here instead of costing a GPU run's
line. The stand-in keeps a device clock: a forward attention call takes 0.1 ms, its backward
0.2 ms, and CUDA events read that clock; the cuDNN backend refuses, as a real one may.

Usage: test_torch_profile.py
"""
import contextlib
import io
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb  # noqa: E402 (imports without torch)


def fake_torch():
    clock = {"ms": 0.0}
    active = []  # open profilers
    state = {"backend": None}

    class DeviceType:
        CPU, CUDA = "cpu", "cuda"

    class Interval:
        def __init__(self, us):
            self.us = us

        def elapsed_us(self):
            return self.us

    class Event:  # a profiler event
        def __init__(self, name, us, device_type):
            self.name, self.time_range, self.device_type = name, Interval(us), device_type

    def kernel(name, ms):
        clock["ms"] += ms
        for prof in active:
            prof.evts.append(Event(name, ms * 1e3, DeviceType.CUDA))
            prof.evts.append(Event("aten::" + name, ms * 1e3, DeviceType.CPU))  # not counted

    class Tensor:
        def transpose(self, a, b):
            return self

        def backward(self, grad=None):
            kernel("flash_bwd_kernel", 0.2)

    class Profile:
        def __init__(self, activities):
            assert activities == ["CUDA"], activities
            self.evts = []

        def __enter__(self):
            active.append(self)
            return self

        def __exit__(self, *exc):
            active.remove(self)
            return False

        def events(self):
            return self.evts

    class CudaEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, end):
            return end.at - self.at

    class Generator:
        def __init__(self, device):
            assert device == "cuda"

        def manual_seed(self, seed):
            return self

    def randn(*shape, device=None, dtype=None, generator=None, requires_grad=False):
        assert device == "cuda" and dtype == "bf16" and isinstance(generator, Generator)
        return Tensor()

    def sdpa(q, k, v, is_causal=False, enable_gqa=False):
        assert is_causal
        if state["backend"] == "CUDNN_ATTENTION":
            raise RuntimeError("No available kernel. Aborting execution.")
        kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 0.1)
        return Tensor()

    class SDPBackend:
        FLASH_ATTENTION = "FLASH_ATTENTION"
        CUDNN_ATTENTION = "CUDNN_ATTENTION"
        EFFICIENT_ATTENTION = "EFFICIENT_ATTENTION"

    @contextlib.contextmanager
    def sdpa_kernel(backends):
        state["backend"] = backends[0]
        try:
            yield
        finally:
            state["backend"] = None

    torch = types.ModuleType("torch")
    torch.bfloat16 = "bf16"
    torch.Generator, torch.randn = Generator, randn
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None, Event=CudaEvent)
    torch.autograd = types.SimpleNamespace(DeviceType=DeviceType)
    nn = types.ModuleType("torch.nn")
    nn.functional = types.SimpleNamespace(scaled_dot_product_attention=sdpa)
    attention = types.ModuleType("torch.nn.attention")
    attention.SDPBackend, attention.sdpa_kernel = SDPBackend, sdpa_kernel
    profiler = types.ModuleType("torch.profiler")
    profiler.profile = Profile
    profiler.ProfilerActivity = types.SimpleNamespace(CUDA="CUDA")
    torch.nn, torch.profiler = nn, profiler
    sys.modules.update({"torch": torch, "torch.nn": nn, "torch.nn.attention": attention,
                        "torch.profiler": profiler})

    def step():  # a training step's kernels: 6 ms of GEMMs, 3 of attention, 1 of AdamW
        kernel("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", 6.0)
        kernel("pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel", 3.0)
        kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 1.0)

    return torch, step


def main():
    torch, step = fake_torch()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tb.profile_step("gpt2-50k", step, torch)
        tb.guarded("TORCH_ATTENTION", "gpt2-50k",
                   lambda: tb.attention("gpt2-50k", tb.MODELS["gpt2-50k"], torch))
    text = out.getvalue()
    print(text, end="")
    fwd_flops, bwd_flops = tb.attention_flops(tb.MODELS["gpt2-50k"])
    want = [
        "TORCH_BREAKDOWN model=gpt2-50k 10.00 ms: gemm 60.0% attention 30.0% optimizer 10.0%",
        "TORCH_KERNELS model=gpt2-50k: 6.00 ms nvjet_hsh_256x128",
        f"TORCH_ATTENTION model=gpt2-50k backend=default fwd_ms=0.100 bwd_ms=0.200 "
        f"fwd_tflops={fwd_flops / 1e-4 / 1e12:.1f} bwd_tflops={bwd_flops / 2e-4 / 1e12:.1f} "
        f"kernel=pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128,128>>",
        "TORCH_ATTENTION model=gpt2-50k backend=flash fwd_ms=0.100",
        "TORCH_ATTENTION model=gpt2-50k backend=efficient fwd_ms=0.100",
        "TORCH_ATTENTION backend=cudnn model=gpt2-50k FAIL RuntimeError: No available kernel.",
    ]
    missing = [w for w in want if w not in text]
    for w in missing:
        print(f"missing: {w}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
