"""PyTorch CPU training-speed reference for keel's GPT benchmark.

What it measures
----------------
Wall-clock time of one full fp32 training step of a GPT-2 style model on the
CPU, with PyTorch, so keel's own benchmark can be compared with it on the same
machine. One timed step is:

    zero_grad -> forward -> loss -> backward -> clip_grad_norm(1.0) -> AdamW.step

Model (the same maths as keel's GPT with per-head shared RMS QK-norm):
  * token embedding wte [V, C] + learned positions wpe [T, C]
  * n_layers pre-norm blocks:
      x = x + proj(attn(qk_rmsnorm(qkv(LayerNorm(x)))))
          qkv: Linear(C, 3C, bias); q and k get an RMSNorm over head_dim
          (eps 1e-5, one learned gain [head_dim] shared by all heads);
          causal softmax attention with scale 1/sqrt(head_dim); proj: Linear(C, C)
      x = x + Linear(4C, C)(GELU_tanh(Linear(C, 4C)(LayerNorm(x))))
  * final LayerNorm, tied LM head (logits = x @ wte^T)
  * loss = cross_entropy + 1e-4 * mean(logsumexp(logits)^2)   (z-loss)
  * torch.optim.AdamW(lr=3e-4, weight_decay=0.1), global grad-norm clip 1.0

Configs (tokens/step = batch * seq):
  S: vocab 256,  d_model 384, 6 layers, 6 heads,  seq 256, batch 8 (2048 tok)
  M: vocab 8192, d_model 768, 4 layers, 12 heads, seq 512, batch 4 (2048 tok)

Inputs and targets are random tokens (speed does not depend on the data).

How it is made fast
-------------------
This is meant to be PyTorch at its best in eager mode on torch 1.13, which has
neither torch.compile nor F.scaled_dot_product_attention (its
torch._C._nn._scaled_dot_product_attention is the same matmul + softmax on the
CPU, and no faster). The maths is unchanged; only how it is evaluated:

  * malloc: glibc is told (mallopt) never to serve allocations with mmap and
    never to trim its heap. By default every activation over the mmap threshold
    (up to 32 MiB; all of M's score and logit buffers) is mmapped, page-faulted
    in and unmapped again on every step: ~34,000 page faults per step on S.
    With this, the step reuses heap memory (under 1,000 faults per step). It is the
    malloc half of PyTorch's CPU tuning advice (jemalloc/tcmalloc), without a
    preload. --malloc default turns it off.
  * attention: q, k, v are laid out once as [3, B*H, T, D] (one copy) for
    bmm. The scores come from one baddbmm per layer that applies the
    1/sqrt(D) scale (alpha) and the causal mask (an additive 0/-inf bias)
    inside the GEMM, where matmul + scale + masked_fill cost three extra passes
    over the [B, H, T, T] scores in the forward and three more in the backward
    (masked_fill is out of place: a clone, then the fill). The softmax
    backward already gives zero gradient to masked scores.
  * QK-norm: q and k are normalised in one call (gains stacked) by an
    autograd.Function with the backward written out, instead of autograd
    running pow/mean/add/rsqrt/mul/mul and their ~12 backward ops on q and
    again on k.
  * loss: cross-entropy and z-loss share one logsumexp in an
    autograd.Function whose backward is one pass over the logits
    (softmax * (1 + 2 z lse) / N, minus 1/N at the targets), instead of
    log_softmax + nll + a second logsumexp and their three backwards.
  * token embedding with F.embedding (backward: index_add) rather than
    wte[idx] (backward: index_put with accumulate).
  * AdamW(foreach=True); gradient clipping with torch._foreach_norm and
    torch._foreach_mul_ (same maths as torch.nn.utils.clip_grad_norm_).
GELU stays F.gelu(approximate="tanh"): this build's tanh is scalar libm
(~10 ms for a [8, 256, 1536] tensor on one thread, against ~2 ms for exp or
sigmoid), but rewriting it as x * sigmoid(2u) in an autograd.Function was no
faster end to end.

--check verifies all this: it runs the plain autograd formulation (what this
script used to time) and the fast one from the same initial weights on the same
batch, and compares the loss (to ~1e-6), every gradient, and the loss after a
few AdamW steps; it also gradchecks the two autograd.Functions in float64.

--profile runs torch.profiler over two more steps and prints the ops that take
the time (self CPU time by op, and by op and input shapes).

How to run
----------
Use Debian's torch (python3-torch 1.13), not a pyenv/venv python:

    /usr/bin/python3 tests/reference/bench_torch.py --threads 2 --steps 5 \
        --warmup 2 --config all

It prints, per config, the per-step times, s/step (mean of the timed steps),
tokens/s, GFLOP/s by keel-bench's PaLM count, and one summary line

    config=S torch_tokens_per_s=... threads=2

The machine is shared: wait until the 1-min load average (`uptime`) is low
before running, and repeat the run; the script prints the load average at its
start and end.

BLAS
----
Debian's torch is built with BLAS_INFO=generic and links libblas.so.3, which
/etc/alternatives resolves to one of the system BLAS builds. For a fair number
it must be the OpenMP OpenBLAS (/usr/lib/x86_64-linux-gnu/openblas-openmp/),
so that sgemm shares libgomp's thread pool with torch's own OpenMP kernels and
torch.set_num_threads() (omp_set_num_threads) also sets the BLAS thread count.
A pthreads OpenBLAS would run its own pool and oversubscribe the cores. The
script reads /proc/self/maps after a matmul, asks OpenBLAS for its build
config (openblas_get_config / openblas_get_parallel: 2 = OpenMP), its thread
count and the kernel set it chose (openblas_get_corename), and prints what it
found; it warns if it is not the OpenMP one.

OpenBLAS 0.3.21 (bookworm) is DYNAMIC_ARCH: it picks its kernels from CPUID at
load time, and on CPUs it does not know (e.g. Intel family 6 model 207) it
falls back to "Prescott", SSE3 kernels, ~4.7x slower than its SkylakeX ones on
an AVX-512 core (31 against 147 GFLOP/s for a 2048x384x1536 sgemm on one
thread). The script warns when that happens. keel-bench loads the same library
and gets the same kernels, so compare the two with the same OPENBLAS_CORETYPE
in the environment of both, e.g. OPENBLAS_CORETYPE=SkylakeX (AVX-512) or
Haswell (AVX2).
"""

import argparse
import ctypes
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "S": dict(vocab=256, d_model=384, n_layers=6, n_heads=6, seq=256, batch=8),
    "M": dict(vocab=8192, d_model=768, n_layers=4, n_heads=12, seq=512, batch=4),
}

EPS = 1e-5
Z_COEF = 1e-4
HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")


def flops_per_token(cfg):
    """keel-bench's count (PaLM's convention, full T x T attention)."""
    C, L, V, T = cfg["d_model"], cfg["n_layers"], cfg["vocab"], cfg["seq"]
    return 6 * (L * (4 * C * C + 2 * C * 4 * C) + V * C) + 12 * L * T * C


# ----------------------------------------------------------------------------
# Fused pieces (autograd.Functions with the backward written out)
# ----------------------------------------------------------------------------

class RMSNormFn(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2, -1) + EPS) * w, w broadcast over all but the last dim.

    Backward, with xh = x * r, r = rsqrt(mean(x^2) + EPS):
      dw = sum(g * xh) over the broadcast dims
      dx = r * (g w - xh * mean(g w * xh, -1))
    """

    @staticmethod
    def forward(ctx, x, w):
        r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True).add_(EPS))
        xh = x * r
        ctx.save_for_backward(xh, r, w)
        return xh * w

    @staticmethod
    def backward(ctx, g):
        xh, r, w = ctx.saved_tensors
        gw = (g * xh).sum_to_size(w.shape)
        gxh = g * w
        dot = (gxh * xh).mean(dim=-1, keepdim=True)
        gx = torch.addcmul(gxh, xh, dot, value=-1).mul_(r)
        return gx, gw


class CrossEntropyZLossFn(torch.autograd.Function):
    """mean(lse - x[target]) + Z_COEF * mean(lse^2) over the rows of logits x [N, V].

    One logsumexp serves both terms; the backward is one pass over the logits:
      dx = softmax(x) * (1 + 2 Z_COEF lse) / N - onehot(target) / N.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        m = logits.amax(dim=1, keepdim=True)
        e = torch.sub(logits, m).exp_()
        s = e.sum(dim=1, keepdim=True)
        lse = s.log().add_(m)  # [N, 1]
        tgt = targets.unsqueeze(1)
        ce = (lse - logits.gather(1, tgt)).mean()
        z = lse.square().mean()
        ctx.save_for_backward(e, s, lse, tgt)
        return ce + Z_COEF * z

    @staticmethod
    def backward(ctx, g):
        e, s, lse, tgt = ctx.saved_tensors
        n = e.shape[0]
        coef = (lse * (2 * Z_COEF)).add_(1).div_(s).mul_(g / n)  # [N, 1]
        grad = e * coef
        grad.scatter_add_(1, tgt, (-g / n).reshape(1, 1).expand(n, 1))
        return grad, None


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, C, H, attn_impl):
        super().__init__()
        self.H, self.D = H, C // H
        self.attn_impl = attn_impl
        self.ln1 = nn.LayerNorm(C, eps=EPS)
        self.qkv = nn.Linear(C, 3 * C, bias=True)
        self.q_norm = nn.Parameter(torch.ones(self.D))  # shared by all heads
        self.k_norm = nn.Parameter(torch.ones(self.D))
        self.proj = nn.Linear(C, C, bias=True)
        self.ln2 = nn.LayerNorm(C, eps=EPS)
        self.fc = nn.Linear(C, 4 * C, bias=True)
        self.fc_proj = nn.Linear(4 * C, C, bias=True)

    def attention(self, x, attn_bias):
        B, T, C = x.shape
        H, D = self.H, self.D
        # [B, T, 3, H, D] -> [3, B*H, T, D]: the one copy bmm needs.
        qkv = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).reshape(3, B * H, T, D)
        qk, v = qkv.split([2, 1])
        gain = torch.stack([self.q_norm, self.k_norm]).view(2, 1, 1, D)
        q, k = RMSNormFn.apply(qk, gain).unbind(0)  # [B*H, T, D] each
        v = v[0]
        if self.attn_impl == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Scale and causal mask inside the GEMM: beta * bias + alpha * q k^T.
            s = torch.baddbmm(attn_bias, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(D))
            o = torch.bmm(torch.softmax(s, dim=-1), v)  # [B*H, T, D]
        o = o.view(B, H, T, D).transpose(1, 2).reshape(B, T, C)
        return self.proj(o)

    def forward(self, x, attn_bias):
        x = x + self.attention(self.ln1(x), attn_bias)
        h = F.gelu(self.fc(self.ln2(x)), approximate="tanh")
        return x + self.fc_proj(h)

    # The plain autograd formulation (what this script timed before it was
    # optimised); --check compares the two.
    @staticmethod
    def rms_reference(x, w):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w

    def forward_reference(self, x, mask):
        h = self.ln1(x)
        B, T, C = h.shape
        H, D = self.H, self.D
        q, k, v = self.qkv(h).view(B, T, 3, H, D).unbind(dim=2)  # [B, T, H, D]
        q = self.rms_reference(q, self.q_norm).transpose(1, 2)  # [B, H, T, D]
        k = self.rms_reference(k, self.k_norm).transpose(1, 2)
        v = v.transpose(1, 2)
        s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        o = torch.matmul(p, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(o)
        h = F.gelu(self.fc(self.ln2(x)), approximate="tanh")
        return x + self.fc_proj(h)


class GPT(nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, seq, attn_impl):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, d_model) * 0.02)
        self.wpe = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, attn_impl) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=EPS)
        # Causal mask as an additive bias: 0 on and below the diagonal, -inf above.
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        self.register_buffer("attn_bias", torch.zeros(seq, seq).masked_fill(future, float("-inf")),
                             persistent=False)
        self.register_buffer("mask", future, persistent=False)  # forward_reference only

    def forward(self, idx, targets):
        B, T = idx.shape
        x = F.embedding(idx, self.wte) + self.wpe[:T]
        bias = self.attn_bias[:T, :T]
        for blk in self.blocks:
            x = blk(x, bias)
        x = self.ln_f(x).view(B * T, -1)
        logits = F.linear(x, self.wte)  # tied LM head, [B*T, V]
        return CrossEntropyZLossFn.apply(logits, targets.view(-1))

    def forward_reference(self, idx, targets):
        B, T = idx.shape
        x = self.wte[idx] + self.wpe[:T]
        mask = self.mask[:T, :T]
        for blk in self.blocks:
            x = blk.forward_reference(x, mask)
        x = self.ln_f(x)
        flat = (x @ self.wte.t()).view(B * T, -1)
        ce = F.cross_entropy(flat, targets.view(-1))
        z = torch.logsumexp(flat, dim=-1).pow(2).mean()
        return ce + Z_COEF * z


def clip_grad_norm_(params, max_norm):
    """torch.nn.utils.clip_grad_norm_(params, max_norm) (L2), with foreach ops."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:  # torch multiplies by min(coef, 1): a no-op when coef >= 1
        torch._foreach_mul_(grads, coef)
    return total


# ----------------------------------------------------------------------------
# Process setup: malloc, BLAS report
# ----------------------------------------------------------------------------

def tune_malloc():
    """Keep freed activations in glibc's heap: no mmap for big blocks, no trimming."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    ok = libc.mallopt(M_TOP_PAD, 64 << 20) == 1 and ok
    return ok


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def blas_report():
    """Which BLAS/OpenMP libraries the process actually mapped, and OpenBLAS's view."""
    a = torch.randn(256, 256)
    (a @ a).sum().item()  # make sure sgemm has run
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6:
                continue
            path = parts[5]
            name = os.path.basename(path)
            if any(k in name for k in ("blas", "lapack", "mkl", "gomp", "iomp", "omp", "dnnl")):
                libs.add(path)
    info = {"mapped": sorted(libs), "openblas_config": None, "openblas_core": None,
            "openblas_parallel": None, "openblas_threads": None, "omp_max_threads": None}
    gomp = next((p for p in sorted(libs) if "omp" in os.path.basename(p)
                 and "blas" not in os.path.basename(p)), None)
    if gomp is not None:
        try:
            info["omp_max_threads"] = ctypes.CDLL(gomp).omp_get_max_threads()
        except (OSError, AttributeError):
            pass
    ob = next((p for p in sorted(libs) if "openblas" in os.path.basename(p)), None)
    if ob is not None:
        try:
            lib = ctypes.CDLL(ob)
            lib.openblas_get_config.restype = ctypes.c_char_p
            info["openblas_config"] = lib.openblas_get_config().decode()
            info["openblas_parallel"] = {0: "sequential", 1: "pthreads", 2: "OpenMP"}.get(
                lib.openblas_get_parallel(), "unknown")
            info["openblas_threads"] = lib.openblas_get_num_threads()
            lib.openblas_get_corename.restype = ctypes.c_char_p
            info["openblas_core"] = lib.openblas_get_corename().decode()
        except (OSError, AttributeError) as e:
            info["openblas_config"] = f"(query failed: {e})"
    return info


def print_blas(info):
    print("BLAS / OpenMP libraries mapped after a matmul:")
    for p in info["mapped"]:
        print(f"  {p}")
    print(f"OpenBLAS config: {info['openblas_config']}")
    print(f"OpenBLAS kernels (corename): {info['openblas_core']}  "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}")
    # With USE_OPENMP, OpenBLAS uses omp_get_max_threads() at each call (it
    # returns early when that is 1 without updating its own counter, so
    # openblas_get_num_threads() can show a stale value then).
    print(f"OpenBLAS parallel: {info['openblas_parallel']}  "
          f"omp_get_max_threads(): {info['omp_max_threads']}  "
          f"(openblas_get_num_threads(): {info['openblas_threads']})")
    if info["openblas_parallel"] != "OpenMP":
        print("WARNING: torch is not using the OpenMP OpenBLAS; numbers are not "
              "comparable (separate BLAS thread pool).", file=sys.stderr)
    flags = cpu_flags()
    if (info["openblas_core"] or "").lower() == "prescott" and "avx2" in flags:
        want = "SkylakeX" if "avx512f" in flags else "Haswell"
        print(f"WARNING: OpenBLAS did not recognise this CPU and fell back to its SSE3 "
              f"'Prescott' kernels (~4.7x slower sgemm here). keel-bench loads the same "
              f"library: run both with OPENBLAS_CORETYPE={want} for numbers that mean "
              f"anything.", file=sys.stderr)


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------

def make(cfg, attn_impl):
    torch.manual_seed(1234)
    model = GPT(cfg["vocab"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                cfg["seq"], attn_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    return model, opt


def make_step(model, opt, reference=False):
    params = list(model.parameters())
    fwd = model.forward_reference if reference else model

    def step(idx, tgt):
        opt.zero_grad(set_to_none=True)
        loss = fwd(idx, tgt)
        loss.backward()
        if reference:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()
    return step


def profile_steps(step, batch, n=2, top=25):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            step(*batch())
    ka = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ka)
    print(f"  profile over {n} steps (profiler overhead included): "
          f"{total / n / 1e3:.1f} ms self CPU per step, "
          f"{sum(e.count for e in ka) // n} op calls per step")
    print(f"  {'op':<48} {'share':>6} {'ms/step':>9} {'calls/step':>10}")
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.key[:48]:<48} {100 * e.self_cpu_time_total / total:5.1f}% "
              f"{e.self_cpu_time_total / n / 1e3:9.1f} {e.count // n:10d}")
    print("  by op and input shapes:")
    ka = prof.key_averages(group_by_input_shape=True)
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.key[:30]:<30} {100 * e.self_cpu_time_total / total:5.1f}% "
              f"{e.self_cpu_time_total / n / 1e3:9.1f} ms x{e.count // n:<4d} "
              f"{str(e.input_shapes)[:80]}")


def bench(name, cfg, args, attn_impl):
    model, opt = make(cfg, attn_impl)
    step = make_step(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    B, T = cfg["batch"], cfg["seq"]
    tokens = B * T
    gen = torch.Generator().manual_seed(42)

    def batch():
        idx = torch.randint(cfg["vocab"], (B, T), generator=gen)
        tgt = torch.randint(cfg["vocab"], (B, T), generator=gen)
        return idx, tgt

    print(f"\n== config {name}: V={cfg['vocab']} C={cfg['d_model']} L={cfg['n_layers']} "
          f"H={cfg['n_heads']} T={T} B={B} tokens/step={tokens} params={n_params} "
          f"attn={attn_impl}")
    for i in range(args.warmup):
        idx, tgt = batch()
        t0 = time.perf_counter()
        loss = step(idx, tgt)
        print(f"  warmup {i}: {time.perf_counter() - t0:.3f} s  loss {loss:.4f}")
    times = []
    for i in range(args.steps):
        idx, tgt = batch()
        t0 = time.perf_counter()
        loss = step(idx, tgt)
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"  step {i}: {dt:.3f} s  loss {loss:.4f}")
    mean = statistics.mean(times)
    med = statistics.median(times)
    print(f"  s/step: mean {mean:.4f}  median {med:.4f}  min {min(times):.4f}  "
          f"max {max(times):.4f}")
    print(f"  tokens/s: {tokens / mean:.1f} (mean)  {tokens / med:.1f} (median)  "
          f"{tokens / min(times):.1f} (best)")
    print(f"  GFLOP/s (keel-bench's count, {flops_per_token(cfg) / 1e6:.1f} MFLOP/token): "
          f"{flops_per_token(cfg) * tokens / mean / 1e9:.1f} (mean)")
    if args.profile:
        profile_steps(step, batch)
    return tokens / mean


# ----------------------------------------------------------------------------
# --check: the fast formulation against the plain autograd one
# ----------------------------------------------------------------------------

def check(names):
    ok = True
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 1, 1, 8, dtype=torch.float64, requires_grad=True)
    ok &= torch.autograd.gradcheck(RMSNormFn.apply, (x, w))
    logits = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(11, (7,))
    ok &= torch.autograd.gradcheck(lambda a: CrossEntropyZLossFn.apply(a, tgt), (logits,))
    print(f"gradcheck (float64) RMSNormFn, CrossEntropyZLossFn: {'ok' if ok else 'FAILED'}")

    for name in names:
        cfg = CONFIGS[name]
        fast, fast_opt = make(cfg, "matmul")
        ref, ref_opt = make(cfg, "matmul")  # same seed: same initial weights
        fast_step, ref_step = make_step(fast, fast_opt), make_step(ref, ref_opt, reference=True)
        gen = torch.Generator().manual_seed(42)
        B, T = cfg["batch"], cfg["seq"]
        idx = torch.randint(cfg["vocab"], (B, T), generator=gen)
        tgt = torch.randint(cfg["vocab"], (B, T), generator=gen)
        lf, lr = fast(idx, tgt), ref.forward_reference(idx, tgt)
        lf.backward()
        lr.backward()
        worst = max(((pf.grad - pr.grad).abs().max() / pr.grad.abs().max()).item()
                    for pf, pr in zip(fast.parameters(), ref.parameters()))
        d0 = abs(lf.item() - lr.item())
        # A few full steps (new batches), then compare the losses.
        losses_f, losses_r = [], []
        for _ in range(3):
            i2 = torch.randint(cfg["vocab"], (B, T), generator=gen)
            t2 = torch.randint(cfg["vocab"], (B, T), generator=gen)
            losses_f.append(fast_step(i2, t2))
            losses_r.append(ref_step(i2, t2))
        d3 = max(abs(a - b) for a, b in zip(losses_f, losses_r))
        good = d0 < 1e-5 and worst < 1e-4 and d3 < 1e-4
        ok &= good
        print(f"config {name}: initial loss fast {lf.item():.7f} reference {lr.item():.7f} "
              f"(|diff| {d0:.1e}); max over params of max|dgrad|/max|grad| {worst:.1e}; "
              f"losses over 3 AdamW steps fast {['%.6f' % v for v in losses_f]} "
              f"reference {['%.6f' % v for v in losses_r]} (max |diff| {d3:.1e}): "
              f"{'ok' if good else 'MISMATCH'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", choices=["S", "M", "all"], default="all")
    ap.add_argument("--attn", choices=["auto", "matmul", "sdpa"], default="matmul",
                    help="attention: bmm + softmax with the scale and causal mask in a "
                         "baddbmm (default), F.scaled_dot_product_attention (torch >= 2.0), "
                         "or sdpa if available")
    ap.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                    help="tuned (default): glibc keeps freed activations in its heap "
                         "(no mmap, no trim); default: leave malloc alone")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, profile two more and print the top ops")
    ap.add_argument("--check", action="store_true",
                    help="compare the fast model with the plain autograd formulation "
                         "(same weights, same batch) and gradcheck the fused pieces; no timing")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --threads >= 1")

    if args.attn == "sdpa" and not HAVE_SDPA:
        sys.exit(f"torch {torch.__version__} has no F.scaled_dot_product_attention")
    attn_impl = "sdpa" if args.attn == "sdpa" or (args.attn == "auto" and HAVE_SDPA) \
        else "matmul"

    malloc_tuned = tune_malloc() if args.malloc == "tuned" else False
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__} ({torch.__file__})  python {sys.executable}")
    print(f"threads: torch.get_num_threads()={torch.get_num_threads()}  "
          f"interop={torch.get_num_interop_threads()}  os.cpu_count()={os.cpu_count()}  "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"F.scaled_dot_product_attention available: {HAVE_SDPA}; using {attn_impl}")
    print(f"malloc: {'tuned (mallopt: no mmap, no trim)' if malloc_tuned else 'default'}")
    print_blas(blas_report())
    names = ["S", "M"] if args.config == "all" else [args.config]
    if args.check:
        sys.exit(0 if check(names) else 1)
    print("loadavg at start: %.2f %.2f %.2f" % os.getloadavg())

    results = {n: bench(n, CONFIGS[n], args, attn_impl) for n in names}

    print("\nloadavg at end: %.2f %.2f %.2f" % os.getloadavg())
    for n in names:
        print(f"config={n} torch_tokens_per_s={results[n]:.1f} threads={args.threads}")


if __name__ == "__main__":
    main()
