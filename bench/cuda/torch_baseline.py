#!/usr/bin/env python3
"""PyTorch eager baseline for bench/cuda/perf.sh: the models and batches cuda_bench's step
section trains, in plain PyTorch as a user would write them, on the same GPU.

Per model: one training step = m microbatches of b sequences of s tokens (random tokens),
forward + backward of each (loss scaled by 1/m, gradients accumulated), gradient clipping at
1.0, AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices). Mixed precision
like vocabpipe: fp32 parameters (the master weights), fp32 gradients and fp32 AdamW state,
bf16 compute through torch.autocast(device_type="cuda", dtype=torch.bfloat16) (weights are
cast per forward, the cast cache keeps one bf16 copy per step); attention is
F.scaled_dot_product_attention(is_causal=True) (Llama: enable_gqa=True); the cross-entropy
runs in fp32 (autocast's rule). AdamW is torch's fused implementation. Untied input and
output embeddings, as in cuda_bench.

Timing: --warmup untimed steps, then --iters steps, each between torch.cuda.synchronize()
calls; tokens/s and MFU from the mean step time (the median is printed too), the FLOP count of
worker/runtime/flops.cc (flops() below; `--print-flops` prints it without torch). Memory:
torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps (peaks reset after
the warm-up; model state included, CUDA context not).

Output: one line per model, `TORCH model=NAME key=value ...`, or `TORCH model=NAME FAIL why`;
then, unless --no-profile, where PyTorch's step spends its device time and how fast its
attention is, to set beside cuda_bench's BREAKDOWN and attention lines:
  TORCH_BREAKDOWN model=NAME STEP_MS ms: FAMILY SHARE% ...   one more step under
      torch.profiler (CUDA kernels only), each kernel's time charged to the first family of
      KERNEL_FAMILIES whose words its name contains, largest first, and the kernels' sum
      against the step's wall time ("busy");
  TORCH_KERNELS model=NAME: the five longest kernels, ms and name (shortened);
  TORCH_ATTENTION model=NAME backend=B fwd_ms= bwd_ms= fwd_tflops= bwd_tflops= kernel=K
      F.scaled_dot_product_attention alone at the model's shape (b, heads, s, head_dim, causal;
      q, k, v as views of (b, s, heads, head_dim) projections, as the model has them) with
      PyTorch's own choice of backend (default) and with each of flash, cudnn and efficient
      forced (a FAIL line where one cannot run the shape); 2 untimed calls, then 10 between
      CUDA events; FLOPs as cuda_bench's attention section counts them (causal: 4·b·heads·
      s(s+1)/2·head_dim forward, 2.5x that backward); K the longest kernel of one forward.

Usage:
  torch_baseline.py [--models gpt2-50k,gpt2-256k,llama] [--warmup 2] [--iters 3]
                    [--peak-tflops X] [--quick] [--no-profile]
  torch_baseline.py --print-flops [--models ...]      (no torch needed)
  torch_baseline.py --cuda-bench-flags MODEL          (no torch needed)

Nothing here needs anything beyond the standard library, torch and numpy; torch is imported
only when a model is trained, so the configurations and FLOP formulas import without it.
"""
import argparse
import math
import statistics
import sys
import time

# The configurations perf.sh measures (cuda_bench flags in perf.sh must match): name ->
# architecture, layers L, hidden h, heads, kv_heads, ffn f, sequence s, vocabulary V,
# microbatch size b, microbatches m (b·m·s = 8192 tokens per step for each).
MODELS = {
    "gpt2-50k": dict(arch="gpt2", layers=8, hidden=2048, heads=16, kv_heads=16, ffn=8192,
                     seq=2048, vocab=50304, batch=2, microbatches=2),
    "gpt2-256k": dict(arch="gpt2", layers=8, hidden=2048, heads=16, kv_heads=16, ffn=8192,
                      seq=2048, vocab=256000, batch=2, microbatches=2),
    "llama": dict(arch="llama", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                  seq=2048, vocab=128256, batch=1, microbatches=4),
}


# Where a kernel's time goes in TORCH_BREAKDOWN: the first family one of whose words the
# lower-cased kernel name contains (attention before gemm: the fused attention kernels carry
# "cutlass" or "gemm"-like words too; the optimizer before norm: clip_grad_norm_'s kernels).
KERNEL_FAMILIES = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "fprop", "bprop",
                   "dot_product")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabeta")),
    ("softmax", ("softmax", "nll_loss", "cross_entropy")),
    ("embedding", ("embedding", "indexing_backward", "index_select", "radix", "segment",
                   "scatter", "gather")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "sm80_")),
    ("copy", ("copy", "cast", "memcpy", "memset", "fill")),
    ("eltwise", ("elementwise", "vectorized", "gelu", "silu", "mul", "add", "reduce")),
]


def kernel_family(name):
    low = name.lower()
    for family, words in KERNEL_FAMILIES:
        if any(w in low for w in words):
            return family
    return "other"


def breakdown_text(kernel_us, wall_s):
    """TORCH_BREAKDOWN's body from {kernel name: device µs} and the step's wall time:
    'STEP_MS ms: family share% ... (busy B%)' over families >= 0.5%, largest first."""
    families = {}
    for name, us in kernel_us.items():
        family = kernel_family(name)
        families[family] = families.get(family, 0.0) + us
    total = sum(families.values())
    parts = [f"{f} {100 * us / total:.1f}%"
             for f, us in sorted(families.items(), key=lambda kv: -kv[1])
             if total > 0 and us >= 0.005 * total]
    busy = 100 * total / 1e6 / wall_s if wall_s > 0 else 0.0
    return f"{total / 1e3:.2f} ms: {' '.join(parts)} (kernels {busy:.1f}% of the wall time)"


def attention_flops(c):
    """cuda_bench's attention-section convention: forward, backward FLOPs (causal)."""
    b, s, heads, hd = c["batch"], c["seq"], c["heads"], c["hidden"] // c["heads"]
    fwd = 4.0 * b * heads * (0.5 * s * (s + 1.0)) * hd
    return fwd, 2.5 * fwd


def layer_flops(c, b):
    """One transformer layer, forward + backward, one microbatch (proto/plan/flops.h)."""
    s, h, f = c["seq"], c["hidden"], c["ffn"]
    if c["arch"] == "llama":
        kv = c["kv_heads"] * (h // c["heads"])
        fwd = 2 * b * s * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * b * s * s * h
    else:
        fwd = 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h
    return 3 * fwd


def flops(c):
    """Model FLOPs of one step: m × (L·layer + 6bshV + 3bsh), flops.cc's
    ModelFlopsPerMicrobatch times the microbatches."""
    b, s, h, v = c["batch"], c["seq"], c["hidden"], c["vocab"]
    per_mb = c["layers"] * layer_flops(c, b) + 6 * b * s * h * v + 3 * b * s * h
    return c["microbatches"] * per_mb


def param_count(c):
    """Parameters of the model below (= cuda_bench's step model, untied embeddings)."""
    h, f, v, s = c["hidden"], c["ffn"], c["vocab"], c["seq"]
    if c["arch"] == "llama":
        kv = c["kv_heads"] * (h // c["heads"])
        layer = 2 * h + (h + 2 * kv) * h + h * h + 3 * f * h
        return 2 * v * h + c["layers"] * layer + h
    layer = 4 * h + h * 3 * h + 3 * h + h * h + h + h * f + f + f * h + h
    return 2 * v * h + s * h + c["layers"] * layer + 2 * h


def tokens_per_step(c):
    return c["microbatches"] * c["batch"] * c["seq"]


def cuda_bench_flags(c):
    """cuda_bench's flags for the same model and batch (perf.sh takes them from here, so the
    two programs cannot drift apart)."""
    flags = [f"--arch={c['arch']}", f"--layers={c['layers']}", f"--hidden={c['hidden']}",
             f"--heads={c['heads']}", f"--ffn={c['ffn']}", f"--seq={c['seq']}",
             f"--rows={c['vocab']}", f"--batch={c['batch']}",
             f"--microbatches={c['microbatches']}"]
    if c["arch"] == "llama":
        flags.append(f"--kv-heads={c['kv_heads']}")
    return flags


def build(c, torch):
    """The model (fp32 parameters on the GPU, initialised there: N(0, 0.02) matrices and
    embeddings, norms at 1, biases at 0)."""
    nn = torch.nn
    F = torch.nn.functional
    h, heads, s = c["hidden"], c["heads"], c["seq"]
    hd = h // heads
    llama = c["arch"] == "llama"
    kvh = c["kv_heads"] if llama else heads

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(h, h + 2 * kvh * hd, bias=not llama)
            self.proj = nn.Linear(h, h, bias=not llama)

        def forward(self, x, rope):
            bsz, t, _ = x.shape
            q, k, v = self.qkv(x).split([h, kvh * hd, kvh * hd], dim=-1)
            q = q.view(bsz, t, heads, hd).transpose(1, 2)  # (b, heads, t, hd)
            k = k.view(bsz, t, kvh, hd).transpose(1, 2)
            v = v.view(bsz, t, kvh, hd).transpose(1, 2)
            if rope is not None:
                q, k = apply_rope(q, rope), apply_rope(k, rope)
            if kvh != heads:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(bsz, t, h))

    def apply_rope(x, rope):  # rotate-half RoPE, x (b, heads, t, hd)
        cos, sin = rope
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            if llama:
                self.gate = nn.Linear(h, c["ffn"], bias=False)
                self.up = nn.Linear(h, c["ffn"], bias=False)
                self.down = nn.Linear(c["ffn"], h, bias=False)
            else:
                self.fc = nn.Linear(h, c["ffn"])
                self.proj = nn.Linear(c["ffn"], h)

        def forward(self, x):
            if llama:
                return self.down(F.silu(self.gate(x)) * self.up(x))
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    def norm():
        return nn.RMSNorm(h, eps=1e-5) if llama else nn.LayerNorm(h)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn, self.ln2, self.mlp = norm(), Attention(), norm(), Mlp()

        def forward(self, x, rope):
            x = x + self.attn(self.ln1(x), rope)
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(c["vocab"], h)
            self.wpe = None if llama else nn.Embedding(s, h)
            self.blocks = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.ln_f = norm()
            self.lm_head = nn.Linear(h, c["vocab"], bias=False)
            if llama:
                inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
                ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # (s, hd/2)
                ang = torch.cat((ang, ang), dim=-1)
                self.register_buffer("cos", ang.cos(), persistent=False)
                self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.wte(idx)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(t, device=idx.device))
            rope = (self.cos[:t], self.sin[:t]) if llama else None
            for blk in self.blocks:
                x = blk(x, rope)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    with torch.device("cuda"):
        model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "ln" in name or "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    return model


def measure(name, c, args, torch):
    model = build(c, torch)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != param_count(c):
        raise RuntimeError(f"{n_params} parameters, expected {param_count(c)}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    m, b, s, v = c["microbatches"], c["batch"], c["seq"], c["vocab"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(31)
    inputs = torch.randint(0, v, (m, b, s), device="cuda", generator=gen)
    targets = torch.randint(0, v, (m, b, s), device="cuda", generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(m):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(inputs[j], targets[j]) / m
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return total

    times = []
    loss = None
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    loss = float(loss)
    mean = sum(times) / len(times)
    tokens = tokens_per_step(c)
    fl = flops(c)
    mfu = f"{100 * fl / mean / (args.peak_tflops * 1e12):.1f}" if args.peak_tflops else "n/a"
    gib = 1024.0 ** 3
    print(f"TORCH model={name} tokens_per_step={tokens} step_s={mean:.4f} "
          f"median_s={statistics.median(times):.4f} tokens_per_s={tokens / mean:.0f} mfu={mfu} "
          f"tflops={fl / mean / 1e12:.1f} peak_alloc_gib={torch.cuda.max_memory_allocated() / gib:.2f} "
          f"peak_reserved_gib={torch.cuda.max_memory_reserved() / gib:.2f} loss={loss:.4f} "
          f"ln_v={math.log(v):.3f} params={n_params} precision=autocast-bf16+fp32-master "
          f"attention=sdpa", flush=True)
    if args.profile:
        guarded("TORCH_BREAKDOWN", name, lambda: profile_step(name, step, torch))
    del opt, model


def guarded(tag, name, fn):
    """Runs fn; an exception becomes one 'TAG model=NAME FAIL why' line (the profile lines
    are extras: they never fail the baseline)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (any failure is reported, not raised)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"{tag} model={name} FAIL {type(e).__name__}: {first[:200]}", flush=True)


def kernel_times(prof, torch):
    """{kernel name: device µs} of a torch.profiler run (device events only)."""
    cuda = torch.autograd.DeviceType.CUDA
    out = {}
    for evt in prof.events():
        if getattr(evt, "device_type", cuda) != cuda:
            continue
        out[evt.name] = out.get(evt.name, 0.0) + evt.time_range.elapsed_us()
    return out


def profile_step(name, step, torch):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = kernel_times(prof, torch)
    print(f"TORCH_BREAKDOWN model={name} {breakdown_text(kernels, wall)}", flush=True)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    print(f"TORCH_KERNELS model={name}: " +
          "; ".join(f"{us / 1e3:.2f} ms {n[:70]}" for n, us in top), flush=True)


def attention(name, c, torch):
    """TORCH_ATTENTION lines: SDPA alone at the model's shape, per backend."""
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    F = torch.nn.functional
    b, s, heads = c["batch"], c["seq"], c["heads"]
    hd = c["hidden"] // heads
    kvh = c["kv_heads"] if c["arch"] == "llama" else heads
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)

    def projection(n_heads):  # (b, n_heads, s, hd) view of a (b, s, n_heads, hd) leaf
        leaf = torch.randn(b, s, n_heads, hd, device="cuda", dtype=torch.bfloat16,
                           generator=gen, requires_grad=True)
        return leaf.transpose(1, 2)

    q, k, v = projection(heads), projection(kvh), projection(kvh)
    dout = torch.randn(b, heads, s, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    extra = {"enable_gqa": True} if kvh != heads else {}

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)

    def fwd_bwd():
        fwd().backward(dout)

    def seconds(fn, reps=10):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    fwd_flops, bwd_flops = attention_flops(c)
    for label, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                           ("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run():
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                f = seconds(fwd)
                fb = seconds(fwd_bwd)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fwd()
                    torch.cuda.synchronize()
            kernels = kernel_times(prof, torch)
            longest = max(kernels.items(), key=lambda kv: kv[1])[0] if kernels else "?"
            bwd = max(fb - f, 1e-9)
            print(f"TORCH_ATTENTION model={name} backend={label} fwd_ms={f * 1e3:.3f} "
                  f"bwd_ms={bwd * 1e3:.3f} fwd_tflops={fwd_flops / f / 1e12:.1f} "
                  f"bwd_tflops={bwd_flops / bwd / 1e12:.1f} "
                  f"kernel={longest.replace(' ', '')[:100]}", flush=True)
        guarded(f"TORCH_ATTENTION backend={label}", name, run)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="bf16 peak for MFU (perf.sh passes cuda_bench's measured one)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up step, 2 timed")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the TORCH_BREAKDOWN/KERNELS/ATTENTION lines")
    ap.add_argument("--print-flops", action="store_true",
                    help="print FLOPs, tokens and parameters per model; no torch, no GPU")
    ap.add_argument("--cuda-bench-flags", metavar="MODEL",
                    help="print cuda_bench's flags for MODEL and exit; no torch, no GPU")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = 1, 2
    if args.cuda_bench_flags:
        if args.cuda_bench_flags not in MODELS:
            ap.error(f"unknown model {args.cuda_bench_flags}; known: {', '.join(MODELS)}")
        print(" ".join(cuda_bench_flags(MODELS[args.cuda_bench_flags])))
        return 0
    names = [n for n in args.models.split(",") if n]
    for n in names:
        if n not in MODELS:
            ap.error(f"unknown model {n}; known: {', '.join(MODELS)}")
    if args.print_flops:
        for n in names:
            c = MODELS[n]
            print(f"FLOPS model={n} layer_per_microbatch={layer_flops(c, c['batch'])} "
                  f"step={flops(c)} tokens_per_step={tokens_per_step(c)} params={param_count(c)}")
        return 0
    try:
        import torch  # noqa: E402 (only here: the formulas above import without torch)
    except ImportError as e:
        print(f"TORCH FAIL torch not importable: {e}", flush=True)
        return 1
    if not torch.cuda.is_available():
        print("TORCH no CUDA device")
        return 0
    print(f"TORCH torch={torch.__version__} cuda={torch.version.cuda} "
          f"gpu=\"{torch.cuda.get_device_name(0)}\"", flush=True)
    failures = 0
    for n in names:
        try:
            measure(n, MODELS[n], args, torch)
        except Exception as e:  # keep going: report the first line of the error
            failures += 1
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"TORCH model={n} FAIL {type(e).__name__}: {first[:200]}", flush=True)
        finally:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
    # Attention alone last, after every model's step line (perf.sh may stop this program when its
    # time is up); a failure here is one FAIL line.
    for n in names if args.profile else []:
        guarded("TORCH_ATTENTION", n, lambda: attention(n, MODELS[n], torch))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
