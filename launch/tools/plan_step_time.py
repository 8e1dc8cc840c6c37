#!/usr/bin/env python3
"""On-paper step time of a TP x DP GPU run, to size a job before booking it (docs/distributed.md,
"Sizing a GPU run"). Compute: the PaLM FLOPs per token (launch/train/bench_configs.h), 6 N + 12 L T H D
with N the matmul weights (H query heads of head_dim D, whose q, k and v projections are
C x (H + 2 Hkv) D for Hkv k/v heads), at an assumed MFU of the GPU's dense bf16 peak. Communication: keel's bytes per step (docs/distributed.md,
"Communication volume per step": the TP activations and their gradients move in bf16,
parallel.tp_comm_dtype's default under train.precision=BF16, or in fp32 with --tp-comm-dtype FP32; the DP gradients in fp32) over NCCL
ring all-reduces, 2 (n - 1) / n x bytes per rank, at the link's published per-GPU bandwidth in
one direction: NVLink 4 inside a node for TP, the node's
InfiniBand NICs (one 400 Gb/s NDR NIC per GPU) across nodes for DP. Nothing is counted as
overlapped (the DP buckets can hide behind backward, but how much is a measurement), so the
estimate is an upper bound for a given MFU. Replace --mfu with keel-bench --device CUDA's measured figure.
The bf16 wire's own passes count in the TP time, at the HBM's published bandwidth: per micro-batch,
the embedding's fp32 output rounded and widened (12 bytes an element) and each of the 1 + 2L input
gradients widened after its all-reduce (6 bytes); the row-parallel outputs cost nothing extra (the
GEMMs write bf16, the residual adds read it).
Grouped-query attention with tp > Hkv replicates the k/v projection on every rank (Note [gqa layouts]
in layers/attention.h): each rank computes all of it, holds its whole gradient in the DP arena, and
all-reduces that gradient (fp32) over TP once per step.

usage: launch/tools/plan_step_time.py [--mfu 0.45] [--tp-comm-dtype BF16|FP32] [--sequence-parallel]
                                [--markdown]
"""
import argparse
from dataclasses import dataclass

H100_BF16_DENSE = 989e12  # FLOP/s, H100/H200 SXM, dense bf16 (NVIDIA's datasheet)
NVLINK_BYTES_S = 450e9    # NVLink 4: 900 GB/s per GPU in both directions together
IB_BYTES_S = 50e9         # 400 Gb/s NDR, one NIC per GPU
HBM_BYTES_S = 3.35e12     # H100 SXM HBM3 (H200: 4.8e12)


@dataclass(frozen=True)
class Model:
    """The model fields the estimate reads (keel.proto's names in the comments). Embeddings are
    tied; norm gains and biases (< 0.1% of the weights) are left out of N."""
    name: str
    V: int  # vocab_size
    C: int  # d_model
    L: int  # n_layers
    H: int  # n_heads
    kv_heads: int = 0  # n_kv_heads; 0: H (multi-head attention)
    head_dim: int = 0  # 0: C / H
    d_ff: int = 0  # 0: 4 C
    mlp: str = "GELU"  # GELU (two C x F matrices) or SWIGLU / GEGLU (three)
    position: str = "LEARNED"  # LEARNED adds a T x C table to the parameters; ROPE adds none
    norm_bias: bool = True  # LAYERNORM with model.bias (2 vectors a norm), else 1 (SP's reduce)

    @property
    def Hkv(self):
        return self.kv_heads or self.H

    @property
    def D(self):
        return self.head_dim or self.C // self.H

    @property
    def F(self):
        return self.d_ff or 4 * self.C


# TP splits whole heads (keel-train refuses parallel.tp not dividing model.n_heads), so the 124M
# row at TP8 uses 16 heads of 48 (GPT-2 small's 12 split 1, 2, 3, 4, 6 or 12 ways); the FLOPs and
# bytes of multi-head attention do not depend on the head count. Qwen3-0.6B's shape (596,049,920
# parameters with its 65,536 norm gains) and Gemma 3 1B's (999,885,952 with its four norms a
# layer; keel's block has two, and no sliding-window layers: it attends over all T) have
# grouped-query attention and heads wider than d_model / n_heads; Gemma's one k/v head is
# replicated at TP2.
GPT2_124M_16 = Model("124M", 50304, 768, 12, 16)
GPT2_124M = Model("124M", 50304, 768, 12, 12)
GPT_1B3 = Model("1.3B", 50304, 2048, 24, 16)
QWEN3_06B = Model("Qwen3-0.6B", 151936, 1024, 28, 16, kv_heads=8, head_dim=128, d_ff=3072,
                  mlp="SWIGLU", position="ROPE", norm_bias=False)
GEMMA3_1B = Model("Gemma3-1B", 262144, 1152, 26, 4, kv_heads=1, head_dim=256, d_ff=6912,
                  mlp="GEGLU", position="ROPE", norm_bias=False)

# model, seq, global batch (sequences), micro-batch, tp, dp.
CONFIGS = [
    (GPT2_124M_16, 1024, 512, 16, 8, 16),
    (GPT2_124M, 1024, 512, 4, 1, 128),
    (GPT_1B3, 2048, 512, 8, 8, 16),
    (GPT_1B3, 2048, 512, 4, 2, 64),
    (QWEN3_06B, 2048, 512, 8, 8, 16),
    (QWEN3_06B, 2048, 512, 4, 2, 64),
    (GEMMA3_1B, 2048, 512, 4, 2, 64),
]


def plan(m, T, global_batch, micro, tp, dp, mfu, tp_wire_bytes=2, sp=False):
    name, V, C, L, heads, Hkv, D, F = m.name, m.V, m.C, m.L, m.H, m.Hkv, m.D, m.F
    if (not m.head_dim and C % heads) or heads % tp:
        raise SystemExit(f"{name}: {heads} heads must divide d_model {C} (or set head_dim) and "
                         f"divide by tp {tp}")
    if heads % Hkv or (Hkv % tp and tp % Hkv):
        raise SystemExit(f"{name}: {Hkv} k/v heads must divide {heads} heads, and divide or be "
                         f"a multiple of tp {tp}")
    mlp_mats = 2 if m.mlp == "GELU" else 3
    # q, k, v: C x (H + 2 Hkv) D; attention output: H D x C.
    attn_mats = C * (heads + 2 * Hkv) * D + heads * D * C
    n_matmul = L * (attn_mats + mlp_mats * C * F) + V * C
    params = n_matmul + (T * C if m.position == "LEARNED" else 0)
    flops_token = 6 * n_matmul + 12 * L * T * heads * D
    # tp > Hkv: every rank projects every k/v head (forward and backward) and holds their weights
    # and gradients whole, instead of 1/tp of them.
    kv_replicated = Hkv % tp != 0
    kv_params = L * 2 * Hkv * D * C if kv_replicated else 0
    tokens = global_batch * T
    compute_s = ((flops_token + 6 * kv_params * (tp - 1)) * tokens / (tp * dp)
                 / (mfu * H100_BF16_DENSE))
    per_rank = global_batch // dp
    A = per_rank // micro  # micro-batches per step
    BT = micro * T
    # docs/distributed.md's TP formula (RMS QK-norm with HEAD_SHARED gains; their gradients are
    # negligible)
    w = tp_wire_bytes
    tp_elems = A * (2 + 4 * L) * BT * C if tp > 1 else 0  # activations and their gradients
    # ... plus, per step, the replicated k/v gradients' fp32 all-reduce (their biases and k's
    # gains, 1/C of it, are left out)
    kv_grad_bytes = 4 * kv_params
    tp_bytes = w * tp_elems + 4 * A * 3 * BT + kv_grad_bytes + 8 if tp > 1 else 0
    # bf16 on the wire: the embedding's round + widen and the input gradients' widen (docstring)
    cast_bytes = A * BT * C * (12 + 6 * (1 + 2 * L)) if w == 2 and tp > 1 else 0
    cast_s = cast_bytes / HBM_BYTES_S
    tp_s = 2 * (tp - 1) / tp * tp_bytes / NVLINK_BYTES_S + cast_s
    if sp and tp > 1:
        # Sequence parallelism (docs/distributed.md, "Sequence parallelism"): fp32 all-gathers and
        # reduce-scatters of [BT, C], each counted as the whole buffer and moving (n - 1) / n of it
        # per rank in a ring, replace the activation all-reduces; the loss statistics and each
        # block and final norm's weight (and, LAYERNORM with bias, bias) gradients stay
        # all-reduces, as do the replicated k/v gradients.
        gather_bytes = 4 * A * (4 + 10 * L) * BT * C
        nb = 2 if m.norm_bias else 1
        reduce_bytes = 4 * A * (3 * BT + (2 * L + 1) * nb * C) + kv_grad_bytes + 8
        tp_bytes = gather_bytes + reduce_bytes
        cast_s = 0.0
        tp_s = ((tp - 1) / tp * gather_bytes + 2 * (tp - 1) / tp * reduce_bytes) / NVLINK_BYTES_S
    dp_bytes = 4 * (params + kv_params * (tp - 1)) / tp  # this rank's fp32 gradient arena
    dp_s = 2 * (dp - 1) / dp * dp_bytes / IB_BYTES_S
    step_s = compute_s + tp_s + dp_s
    return {
        "name": name, "heads": heads, "params": params, "layout": f"TP{tp} x DP{dp}", "tokens": tokens,
        "compute_s": compute_s, "tp_bytes": tp_bytes, "tp_s": tp_s, "dp_bytes": dp_bytes,
        "dp_s": dp_s, "step_s": step_s, "tokens_s": tokens / step_s, "A": A, "micro": micro,
        "d_model": C, "kv_heads": Hkv, "head_dim": D, "flops_token": flops_token,
        "kv_replicated": int(kv_replicated),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mfu", type=float, default=0.45)
    p.add_argument("--tp-comm-dtype", choices=["BF16", "FP32"], default="BF16",
                   help="parallel.tp_comm_dtype (BF16: its default under train.precision=BF16)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="parallel.sequence_parallel=true (its collectives move fp32)")
    p.add_argument("--markdown", action="store_true", help="print the table in docs/distributed.md")
    a = p.parse_args()
    wire = 2 if a.tp_comm_dtype == "BF16" and not a.sequence_parallel else 4
    rows = [plan(*c, mfu=a.mfu, tp_wire_bytes=wire, sp=a.sequence_parallel) for c in CONFIGS]
    if a.markdown:
        print(f"| config | layout, micro-batch x accumulation | tokens/step | compute at "
              f"{a.mfu:.0%} MFU | TP bytes/rank | TP time | DP bytes/rank | DP time | step | tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            # Multi-head rows keep their label; grouped-query ones add the k/v heads and width.
            heads = f"{r['heads']} heads"
            if r["kv_heads"] != r["heads"] or r["head_dim"] * r["heads"] != r["d_model"]:
                heads += f" on {r['kv_heads']} k/v, head_dim {r['head_dim']}"
            print(f"| {r['name']} ({r['params'] / 1e6:.0f}M params, {heads}) | "
                  f"{r['layout']}, {r['micro']} x "
                  f"{r['A']} | {r['tokens']:,} | {r['compute_s'] * 1e3:.0f} ms | "
                  f"{r['tp_bytes'] / 1e9:.2f} GB | {r['tp_s'] * 1e3:.0f} ms | "
                  f"{r['dp_bytes'] / 1e6:.0f} MB | {r['dp_s'] * 1e3:.1f} ms | "
                  f"{r['step_s'] * 1e3:.0f} ms | {r['tokens_s'] / 1e6:.2f} M |")
    else:
        for r in rows:
            print(" ".join(f"{k}={v:.10g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in r.items()))


if __name__ == "__main__":
    main()
