"""PyTorch CPU training-speed reference for keel's GPT benchmark.

What it measures
----------------
Wall-clock time of one full fp32 training step of a GPT-2 style model on the
CPU, with PyTorch, so keel's own benchmark can be compared with it on the same
machine. One timed step is:

    zero_grad -> forward -> loss -> backward -> clip_grad_norm_(1.0) -> AdamW.step

Model (the same maths as keel's GPT with per-head shared RMS QK-norm):
  * token embedding wte [V, C] + learned positions wpe [T, C]
  * n_layers pre-norm blocks:
      x = x + proj(attn(qk_rmsnorm(qkv(LayerNorm(x)))))
          qkv: Linear(C, 3C, bias); q and k get an RMSNorm over head_dim
          (eps 1e-5, one learned gain [head_dim] shared by all heads);
          causal attention written with matmuls + masked softmax (or
          F.scaled_dot_product_attention if this torch has it and --attn
          asks for it; torch 1.13 does not have it); proj: Linear(C, C)
      x = x + Linear(4C, C)(GELU_tanh(Linear(C, 4C)(LayerNorm(x))))
  * final LayerNorm, tied LM head (logits = x @ wte^T)
  * loss = cross_entropy + 1e-4 * mean(logsumexp(logits)^2)   (z-loss)
  * torch.optim.AdamW(lr=3e-4, weight_decay=0.1), global grad-norm clip 1.0

Configs (tokens/step = batch * seq):
  S: vocab 256,  d_model 384, 6 layers, 6 heads,  seq 256, batch 8 (2048 tok)
  M: vocab 8192, d_model 768, 4 layers, 12 heads, seq 512, batch 4 (2048 tok)

Inputs and targets are random tokens (speed does not depend on the data).

How to run
----------
Use Debian's torch (python3-torch 1.13), not a pyenv/venv python:

    /usr/bin/python3 tests/reference/bench_torch.py --threads 2 --steps 5 \
        --warmup 2 --config all

It prints, per config, the per-step times, s/step (mean of the timed steps),
tokens/s, and one summary line

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
config (openblas_get_config / openblas_get_parallel: 2 = OpenMP) and its
thread count, and prints what it found; it warns if it is not the OpenMP one.
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

    @staticmethod
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w

    def attention(self, x, mask):
        B, T, C = x.shape
        H, D = self.H, self.D
        qkv = self.qkv(x).view(B, T, 3, H, D)
        q, k, v = qkv.unbind(dim=2)  # [B, T, H, D]
        q = self.rms(q, self.q_norm).transpose(1, 2)  # [B, H, T, D]
        k = self.rms(k, self.k_norm).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.attn_impl == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
            s = s.masked_fill(mask, float("-inf"))
            p = torch.softmax(s, dim=-1)
            o = torch.matmul(p, v)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(B, T, C)
        return self.proj(o)

    def forward(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
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
        # True above the diagonal = masked out (future positions).
        self.register_buffer(
            "mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte[idx] + self.wpe[:T]
        mask = self.mask[:T, :T]
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln_f(x)
        logits = x @ self.wte.t()  # tied LM head, [B, T, V]
        flat = logits.view(B * T, -1)
        ce = F.cross_entropy(flat, targets.view(-1))
        z = torch.logsumexp(flat, dim=-1).pow(2).mean()
        return ce + Z_COEF * z


# ----------------------------------------------------------------------------
# BLAS report
# ----------------------------------------------------------------------------

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
    info = {"mapped": sorted(libs), "openblas_config": None,
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
        except (OSError, AttributeError) as e:
            info["openblas_config"] = f"(query failed: {e})"
    return info


def print_blas(info):
    print("BLAS / OpenMP libraries mapped after a matmul:")
    for p in info["mapped"]:
        print(f"  {p}")
    print(f"OpenBLAS config: {info['openblas_config']}")
    # With USE_OPENMP, OpenBLAS uses omp_get_max_threads() at each call (it
    # returns early when that is 1 without updating its own counter, so
    # openblas_get_num_threads() can show a stale value then).
    print(f"OpenBLAS parallel: {info['openblas_parallel']}  "
          f"omp_get_max_threads(): {info['omp_max_threads']}  "
          f"(openblas_get_num_threads(): {info['openblas_threads']})")
    if info["openblas_parallel"] != "OpenMP":
        print("WARNING: torch is not using the OpenMP OpenBLAS; numbers are not "
              "comparable (separate BLAS thread pool).", file=sys.stderr)


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------

def bench(name, cfg, args, attn_impl):
    torch.manual_seed(1234)
    model = GPT(cfg["vocab"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                cfg["seq"], attn_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    B, T = cfg["batch"], cfg["seq"]
    tokens = B * T
    gen = torch.Generator().manual_seed(42)

    def batch():
        idx = torch.randint(cfg["vocab"], (B, T), generator=gen)
        tgt = torch.randint(cfg["vocab"], (B, T), generator=gen)
        return idx, tgt

    def step(idx, tgt):
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

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
    return tokens / mean


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", choices=["S", "M", "all"], default="all")
    ap.add_argument("--attn", choices=["auto", "matmul", "sdpa"], default="matmul",
                    help="attention: matmul + masked softmax (default), "
                         "F.scaled_dot_product_attention, or sdpa if available")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --threads >= 1")

    if args.attn == "sdpa" and not HAVE_SDPA:
        sys.exit(f"torch {torch.__version__} has no F.scaled_dot_product_attention")
    attn_impl = "sdpa" if args.attn == "sdpa" or (args.attn == "auto" and HAVE_SDPA) \
        else "matmul"

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__} ({torch.__file__})  python {sys.executable}")
    print(f"threads: torch.get_num_threads()={torch.get_num_threads()}  "
          f"interop={torch.get_num_interop_threads()}  os.cpu_count()={os.cpu_count()}  "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"F.scaled_dot_product_attention available: {HAVE_SDPA}; using {attn_impl}")
    print_blas(blas_report())
    print("loadavg at start: %.2f %.2f %.2f" % os.getloadavg())

    names = ["S", "M"] if args.config == "all" else [args.config]
    results = {n: bench(n, CONFIGS[n], args, attn_impl) for n in names}

    print("\nloadavg at end: %.2f %.2f %.2f" % os.getloadavg())
    for n in names:
        print(f"config={n} torch_tokens_per_s={results[n]:.1f} threads={args.threads}")


if __name__ == "__main__":
    main()
