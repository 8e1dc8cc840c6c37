"""Regenerate the whole-model parity fixtures: build/venv/bin/python tests/reference/make_fixtures.py (writes *.bin into its own directory; /usr/bin/python3 gives the same bytes without the transformers checks)."""

# PyTorch (float64) reference of keel's GPT model, written with plain functional
# ops so every formula is explicit. For each case it writes one KEELFIX1 file
# holding the config, inputs, float32 weights, float64 logits/losses and the
# float64 gradient of (ce + z-loss) with respect to every parameter.
# See README.md in this directory for the file format.
#
# The model: token embedding (+ a learned position table when position=LEARNED),
# n_layers blocks, a final norm and the LM head. A block is
#   PRE:            x = x + attn(ln1(x));  x = x + mlp(ln2(x))
#   POST_SUBLAYER:  x = x + ln1(attn(x));  x = x + ln2(mlp(x))     (OLMo 2)
# attn: qkv projection, QK-norm of q and k, then RoPE of q and k (position=ROPE,
# rotate-half convention, per head, positions 0..T-1 in every sequence), causal
# softmax attention, output projection. With kv_heads = Hkv below H
# (grouped-query; 1: multi-query) q and k/v are two projections, q.weight
# [H, D, C] and kv.weight [2, Hkv, D, C] (k heads, then v heads), and query
# head h attends to k/v head h // (H / Hkv), as keel (Note [gqa layouts] in
# layers/attention.h) and Hugging Face's repeat_kv do. head_dim = D may differ
# from C / H: q is H x D wide, k and v Hkv x D, and proj.weight is [C, H D]. mlp: GELU proj(gelu(fc(x))), or gated
# proj(act(gate(x)) * fc(x)) with act = SiLU (SWIGLU) or tanh-GELU (GEGLU).
# bias=False drops every bias: qkv, attention and MLP projections, the
# LayerNorm biases (ln1, ln2, ln_f) and the LAYER QK-norm biases.

import math
import os
import struct
import sys

import torch

torch.set_num_threads(1)

OUT_DIR = os.path.dirname(os.path.abspath(__file__))

# Dimensions of the original (GPT-2 block) cases: V C H F n_layers T P B.
# These module-level names are kept for code that imports this file.
V, C, H, F, N_LAYERS, T, P, B = 67, 32, 4, 96, 2, 8, 12, 2
D = C // H
BASE_DIMS = dict(V=V, C=C, H=H, F=F, L=N_LAYERS, T=T, P=P, B=B)
# The modern-block cases use a smaller model so each file stays under ~80 KB
# (every parameter is stored as f32 plus an f64 gradient): head_dim stays 8,
# so RoPE has four frequencies, and there are still two heads and two layers.
SMALL_DIMS = dict(V=41, C=16, H=2, F=24, L=2, T=8, P=12, B=2)
# The grouped-query cases need four query heads (2 or 1 k/v heads); C=24 keeps
# the files near 100 KB and gives head_dim 6 (three RoPE frequencies).
GQA_DIMS = dict(V=41, C=24, H=4, F=24, L=2, T=8, P=12, B=2)
Z_COEF = 1e-2
EPS_NORM = 1e-5
EPS_L2 = 1e-6
DEFAULT_ROPE_THETA = 10000.0

QK_CODES = {"NONE": 1, "RMS": 2, "LAYER": 3, "L2": 4}
SCOPE_CODES = {"HEAD_SHARED": 1, "HEAD": 2, "PROJECTION": 3}
NORM_CODES = {"LAYERNORM": 1, "RMSNORM": 2}
POSITION_CODES = {"LEARNED": 1, "ROPE": 2}
MLP_CODES = {"GELU": 1, "SWIGLU": 2, "GEGLU": 3}
PLACEMENT_CODES = {"PRE": 1, "POST_SUBLAYER": 2}

DT_F32, DT_I32, DT_F64 = 0, 1, 2


# ----------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------

def gpt2_block(**kw):
    """A case with the GPT-2 block (the defaults of the new options), updated by kw."""
    case = dict(dims=BASE_DIMS, position="LEARNED", rope_theta=DEFAULT_ROPE_THETA, mlp="GELU",
                bias=True, placement="PRE", kv_heads=0, head_dim=0)
    case.update(kw)
    return case


def modern(**kw):
    case = gpt2_block(dims=SMALL_DIMS)
    case.update(kw)
    return case


def qk_combos():
    """NONE, then {RMS, LAYER, L2} x {HEAD_SHARED, HEAD, PROJECTION}."""
    combos = [("NONE", "HEAD_SHARED")]
    for qk in ("RMS", "LAYER", "L2"):
        for scope in ("HEAD_SHARED", "HEAD", "PROJECTION"):
            combos.append((qk, scope))
    return combos


def qk_name(qk, scope):
    return "qk_none" if qk == "NONE" else f"qk_{qk.lower()}_{scope.lower()}"


def make_cases():
    cases = []
    # The original cases (GPT-2 block): unchanged names, seeds and draws.
    for i, (qk, scope) in enumerate(qk_combos()):
        cases.append(gpt2_block(
            name=qk_name(qk, scope),
            qk_norm=qk,
            scope=scope,
            # Alternate both switches so every combination appears.
            norm="LAYERNORM" if i % 2 == 0 else "RMSNORM",
            tie=(i // 2) % 2 == 0,
            seed=1000 + 17 * i,
        ))
    # RoPE under every QK-norm mode and scope. The other switches rotate so the
    # sweep also meets every MLP kind, bias on and off under both norms (and
    # under LAYER QK-norm, whose q/k norm biases go with bias), both
    # placements, tied and untied, and two RoPE bases (a wrong theta fails).
    for i, (qk, scope) in enumerate(qk_combos()):
        cases.append(modern(
            name="rope_" + qk_name(qk, scope),
            qk_norm=qk,
            scope=scope,
            norm="LAYERNORM" if i % 2 == 0 else "RMSNORM",
            tie=(i // 2) % 2 == 0,
            position="ROPE",
            rope_theta=DEFAULT_ROPE_THETA if i % 2 == 0 else 500000.0,
            mlp=("GELU", "SWIGLU", "GEGLU")[i % 3],
            bias=(i % 4) in (0, 3),
            placement="POST_SUBLAYER" if i % 5 == 3 else "PRE",
            seed=2000 + 17 * i,
        ))
    # Gated MLPs, bias-free layers and POST_SUBLAYER with learned positions.
    singles = [
        dict(name="mlp_swiglu", qk_norm="RMS", scope="HEAD_SHARED", norm="LAYERNORM", tie=True,
             mlp="SWIGLU"),
        dict(name="mlp_swiglu_nobias", qk_norm="RMS", scope="HEAD", norm="RMSNORM", tie=False,
             mlp="SWIGLU", bias=False),
        dict(name="mlp_geglu", qk_norm="LAYER", scope="PROJECTION", norm="LAYERNORM", tie=False,
             mlp="GEGLU"),
        dict(name="mlp_geglu_nobias", qk_norm="LAYER", scope="HEAD_SHARED", norm="LAYERNORM",
             tie=True, mlp="GEGLU", bias=False),
        dict(name="gelu_nobias", qk_norm="NONE", scope="HEAD_SHARED", norm="LAYERNORM", tie=True,
             bias=False),
        dict(name="post_sublayer", qk_norm="NONE", scope="HEAD_SHARED", norm="LAYERNORM",
             tie=True, placement="POST_SUBLAYER"),
        dict(name="post_sublayer_swiglu", qk_norm="L2", scope="HEAD", norm="RMSNORM", tie=False,
             mlp="SWIGLU", placement="POST_SUBLAYER"),
        # OLMo 2: RMSNorm after each sublayer, RMS QK-norm over the whole q / k
        # projection, RoPE base 500000, SwiGLU, no biases, untied head.
        dict(name="olmo2", qk_norm="RMS", scope="PROJECTION", norm="RMSNORM", tie=False,
             position="ROPE", rope_theta=500000.0, mlp="SWIGLU", bias=False,
             placement="POST_SUBLAYER"),
        # Qwen3: pre-norm, RMS QK-norm per head with one gain shared by all
        # heads, RoPE base 1000000, SwiGLU, no biases, tied head.
        dict(name="qwen3", qk_norm="RMS", scope="HEAD_SHARED", norm="RMSNORM", tie=True,
             position="ROPE", rope_theta=1000000.0, mlp="SWIGLU", bias=False, placement="PRE"),
    ]
    for j, kw in enumerate(singles):
        cases.append(modern(seed=3000 + 17 * j, **kw))
    # Grouped-query (4 query heads on 2 k/v heads) and multi-query (on 1) attention
    # in the Qwen3 and OLMo 2 blocks above, and model.head_dim apart from C / H.
    qwen3 = dict(qk_norm="RMS", scope="HEAD_SHARED", norm="RMSNORM", tie=True, position="ROPE",
                 rope_theta=1000000.0, mlp="SWIGLU", bias=False, placement="PRE")
    olmo2 = dict(qk_norm="RMS", scope="PROJECTION", norm="RMSNORM", tie=False, position="ROPE",
                 rope_theta=500000.0, mlp="SWIGLU", bias=False, placement="POST_SUBLAYER")
    grouped = [
        dict(name="gqa_qwen3", kv_heads=2, **qwen3),
        dict(name="mqa_qwen3", kv_heads=1, **qwen3),
        # PROJECTION: q normalised over its 4 x 6 values, k over its 2 x 6 (1 x 6 for MQA).
        dict(name="gqa_olmo2", kv_heads=2, **olmo2),
        dict(name="mqa_olmo2", kv_heads=1, **olmo2),
        # Qwen3's shape of head (16 heads of 128 at d_model 1024): 4 heads of 8 at C=24, so q
        # is 32 wide and proj.weight [24, 32]; per-head gains ([4, 8] for q, [2, 8] for k).
        dict(name="gqa_head_dim", kv_heads=2, head_dim=8,
             **{**qwen3, "scope": "HEAD", "tie": False}),
        # Narrower heads on a width the heads do not divide (4 heads of 4 at C=26), with
        # every bias: q.bias [4, 4], kv.bias [2, 1, 4] and LAYER QK-norm's k_norm.bias
        # [1, 4]; learned positions, GELU, LayerNorm.
        dict(name="mqa_head_dim_bias", kv_heads=1, head_dim=4, dims={**GQA_DIMS, "C": 26},
             qk_norm="LAYER", scope="PROJECTION", norm="LAYERNORM", tie=False),
        # L2 QK-norm with a scale per query head ([4]) on 2 k/v heads; biases, GEGLU and
        # POST_SUBLAYER norms.
        dict(name="gqa_l2_head", kv_heads=2, qk_norm="L2", scope="HEAD", norm="LAYERNORM",
             tie=True, position="ROPE", mlp="GEGLU", placement="POST_SUBLAYER"),
    ]
    for j, kw in enumerate(grouped):
        kw.setdefault("dims", GQA_DIMS)
        cases.append(gpt2_block(seed=4000 + 17 * j, **kw))
    return cases


def dims(case):
    """V C H D F L T P B, with D = head_dim (C // H when the case leaves it 0)."""
    d = case["dims"]
    Dc = case["head_dim"] or d["C"] // d["H"]
    return d["V"], d["C"], d["H"], Dc, d["F"], d["L"], d["T"], d["P"], d["B"]


def kv_heads(case):
    """Hkv: k/v heads (H for multi-head attention, the case's 0)."""
    return case["kv_heads"] or case["dims"]["H"]


def grouped_query(case):
    return kv_heads(case) != case["dims"]["H"]


def gated(case):
    return case["mlp"] in ("SWIGLU", "GEGLU")


# ----------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------

def param_specs(case):
    """Ordered list of (name, shape, kind) with kind in {mat, normw, bias, qkscale}."""
    Vc, Cc, Hc, Dc, Fc, Lc, Tc, Pc, Bc = dims(case)
    bias = case["bias"]
    ln_bias = case["norm"] == "LAYERNORM" and bias
    qk, scope = case["qk_norm"], case["scope"]
    specs = [("wte", (Vc, Cc), "mat")]
    if case["position"] == "LEARNED":
        specs.append(("wpe", (Pc, Cc), "mat"))
    Hkv = kv_heads(case)
    # HEAD_SHARED: one [D] gain for every head; HEAD and PROJECTION: [heads, D], with k's
    # heads the k/v heads.
    q_shape = (Dc,) if scope == "HEAD_SHARED" else (Hc, Dc)
    k_shape = (Dc,) if scope == "HEAD_SHARED" else (Hkv, Dc)
    for l in range(Lc):
        p = f"blocks.{l}."
        specs.append((p + "ln1.weight", (Cc,), "normw"))
        if ln_bias:
            specs.append((p + "ln1.bias", (Cc,), "bias"))
        if grouped_query(case):
            specs.append((p + "attn.q.weight", (Hc, Dc, Cc), "mat"))
            specs.append((p + "attn.kv.weight", (2, Hkv, Dc, Cc), "mat"))
            if bias:
                specs.append((p + "attn.q.bias", (Hc, Dc), "bias"))
                specs.append((p + "attn.kv.bias", (2, Hkv, Dc), "bias"))
        else:
            specs.append((p + "attn.qkv.weight", (3, Hc, Dc, Cc), "mat"))
            if bias:
                specs.append((p + "attn.qkv.bias", (3, Hc, Dc), "bias"))
        if qk in ("RMS", "LAYER"):
            specs.append((p + "attn.q_norm.weight", q_shape, "normw"))
            if qk == "LAYER" and bias:
                specs.append((p + "attn.q_norm.bias", q_shape, "bias"))
            specs.append((p + "attn.k_norm.weight", k_shape, "normw"))
            if qk == "LAYER" and bias:
                specs.append((p + "attn.k_norm.bias", k_shape, "bias"))
        if qk == "L2":
            specs.append((p + "attn.qk_scale", (Hc,) if scope == "HEAD" else (1,), "qkscale"))
        specs.append((p + "attn.proj.weight", (Cc, Hc * Dc), "mat"))
        if bias:
            specs.append((p + "attn.proj.bias", (Cc,), "bias"))
        specs.append((p + "ln2.weight", (Cc,), "normw"))
        if ln_bias:
            specs.append((p + "ln2.bias", (Cc,), "bias"))
        specs.append((p + "mlp.fc.weight", (Fc, Cc), "mat"))
        if bias:
            specs.append((p + "mlp.fc.bias", (Fc,), "bias"))
        if gated(case):
            specs.append((p + "mlp.gate.weight", (Fc, Cc), "mat"))
            if bias:
                specs.append((p + "mlp.gate.bias", (Fc,), "bias"))
        specs.append((p + "mlp.proj.weight", (Cc, Fc), "mat"))
        if bias:
            specs.append((p + "mlp.proj.bias", (Cc,), "bias"))
    specs.append(("ln_f.weight", (Cc,), "normw"))
    if ln_bias:
        specs.append(("ln_f.bias", (Cc,), "bias"))
    if not case["tie"]:
        specs.append(("lm_head.weight", (Vc, Cc), "mat"))
    return specs


def init_params(case, gen):
    """Generic (non-default) init, rounded to float32. Returns dict name -> float32 tensor."""
    Tc = dims(case)[6]
    params = {}
    qk_scale_init = math.log2(Tc * Tc - Tc)  # Henry et al. 2020, T_train = seq_len
    for name, shape, kind in param_specs(case):
        if kind == "mat":
            w = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1
        elif kind == "normw":
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif kind == "bias":
            w = 0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif kind == "qkscale":
            # +-10% random perturbation of the initial value.
            u = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.2 - 0.1
            w = qk_scale_init * (1.0 + u)
        else:
            raise ValueError(kind)
        params[name] = w.to(torch.float32)
    return params


# ----------------------------------------------------------------------------
# Model (float64, plain functional ops)
# ----------------------------------------------------------------------------

def layer_norm(x, w, b, eps=EPS_NORM):
    """b may be None (bias-free LayerNorm: still centred, no shift)."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased
    y = (x - mean) / torch.sqrt(var + eps) * w
    return y if b is None else y + b


def rms_norm(x, w, eps=EPS_NORM):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def block_norm(case, prm, prefix, x):
    if case["norm"] == "LAYERNORM":
        return layer_norm(x, prm[prefix + ".weight"], prm.get(prefix + ".bias"))
    return rms_norm(x, prm[prefix + ".weight"])


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1.0 + torch.exp(-x))


def linear(x, prm, prefix):
    """x @ W^T (+ b when the case has biases)."""
    y = x @ prm[prefix + ".weight"].t()
    b = prm.get(prefix + ".bias")
    return y if b is None else y + b


def qk_normalize(case, prm, prefix, which, x):
    """x: [B, T, Hx, D] with Hx = H (q) or Hkv (k); which in {'q', 'k'}. Returns normalised
    [B, T, Hx, D]; PROJECTION normalises q and k each over its own Hx * D values."""
    qk, scope = case["qk_norm"], case["scope"]
    if qk == "NONE":
        return x
    Bx, Tx, Hc, Dc = x.shape
    if scope == "PROJECTION":
        y = x.reshape(Bx, Tx, Hc * Dc)  # normalise over the whole H*D vector
    else:
        y = x  # normalise each head over its D values
    if qk == "L2":
        y = y / torch.sqrt((y * y).sum(dim=-1, keepdim=True) + EPS_L2)
    else:
        w = prm[f"{prefix}.{which}_norm.weight"]
        if scope == "PROJECTION":
            w = w.reshape(Hc * Dc)
        if qk == "RMS":
            y = rms_norm(y, w)
        else:
            b = prm.get(f"{prefix}.{which}_norm.bias")
            if b is not None and scope == "PROJECTION":
                b = b.reshape(Hc * Dc)
            y = layer_norm(y, w, b)
    return y.reshape(Bx, Tx, Hc, Dc)


def rope_cos_sin(Tx, Dc, theta):
    """cos, sin [T, D] of the rotate-half convention: pair (i, i + D/2) turns by
    t * theta^(-2i/D) at position t (HF Llama / OLMo 2 / Qwen3)."""
    half = Dc // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / Dc)
    angle = torch.arange(Tx, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    return torch.cat([angle.cos(), angle.cos()], dim=-1), torch.cat([angle.sin(), angle.sin()], dim=-1)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope(x, theta):
    """x: [B, T, H, D]; every sequence starts at position 0."""
    cos, sin = rope_cos_sin(x.shape[1], x.shape[3], theta)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def project_qkv(case, prm, p, x):
    """q [B, T, H, D], k and v [B, T, Hkv, D] (Hkv = H for multi-head attention)."""
    if not grouped_query(case):
        qkv = torch.einsum("btc,jhdc->btjhd", x, prm[p + ".qkv.weight"])  # [B, T, 3, H, D]
        if p + ".qkv.bias" in prm:
            qkv = qkv + prm[p + ".qkv.bias"]  # [3, H, D]
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = torch.einsum("btc,hdc->bthd", x, prm[p + ".q.weight"])  # [B, T, H, D]
    kv = torch.einsum("btc,jhdc->btjhd", x, prm[p + ".kv.weight"])  # [B, T, 2, Hkv, D]
    if p + ".q.bias" in prm:
        q = q + prm[p + ".q.bias"]  # [H, D]
        kv = kv + prm[p + ".kv.bias"]  # [2, Hkv, D]
    return q, kv[:, :, 0], kv[:, :, 1]


def kv_head_of(case):
    """[H]: the k/v head each query head reads, h // (H / Hkv) (contiguous groups)."""
    Hc = case["dims"]["H"]
    return torch.arange(Hc) // (Hc // kv_heads(case))


def attention(case, prm, l, x):
    _, _, Hc, Dc, _, _, _, _, _ = dims(case)
    p = f"blocks.{l}.attn"
    q, k, v = project_qkv(case, prm, p, x)
    q = qk_normalize(case, prm, p, "q", q)
    k = qk_normalize(case, prm, p, "k", k)
    if case["position"] == "ROPE":
        # After QK-norm, as OLMo 2 and Qwen3 do.
        q = rope(q, case["rope_theta"])
        k = rope(k, case["rope_theta"])
    # Each query head's k/v head; autograd sums a k/v head's gradient over its group.
    k, v = k[:, :, kv_head_of(case)], v[:, :, kv_head_of(case)]  # [B, T, H, D]
    if case["qk_norm"] == "L2":
        s = prm[p + ".qk_scale"]
        scale = s.reshape(1, Hc, 1, 1) if s.numel() == Hc and case["scope"] == "HEAD" else s.reshape(1, 1, 1, 1)
    else:
        scale = 1.0 / math.sqrt(Dc)
    Tx = x.shape[1]
    scores = torch.einsum("bthd,buhd->bhtu", q, k) * scale  # [B, H, T, T]
    causal = torch.ones(Tx, Tx, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    m = scores.max(dim=-1, keepdim=True).values.detach()
    e = torch.exp(scores - m)
    probs = e / e.sum(dim=-1, keepdim=True)
    o = torch.einsum("bhtu,buhd->bthd", probs, v)  # [B, T, H, D]
    o = o.reshape(x.shape[0], Tx, Hc * Dc)  # heads concatenated h = 0..H-1
    return linear(o, prm, p + ".proj")


def mlp(case, prm, l, x):
    p = f"blocks.{l}.mlp"
    up = linear(x, prm, p + ".fc")
    if case["mlp"] == "GELU":
        h = gelu_tanh(up)
    else:
        act = silu if case["mlp"] == "SWIGLU" else gelu_tanh
        h = act(linear(x, prm, p + ".gate")) * up
    return linear(h, prm, p + ".proj")


def forward(case, prm, tokens, targets):
    """prm: dict name -> float64 tensor. Returns (logits, ce, zl)."""
    Vc, _, _, _, _, Lc, _, _, _ = dims(case)
    Tx = tokens.shape[1]
    x = prm["wte"][tokens.long()]
    if case["position"] == "LEARNED":
        x = x + prm["wpe"][:Tx]
    for l in range(Lc):
        n1, n2 = f"blocks.{l}.ln1", f"blocks.{l}.ln2"
        if case["placement"] == "PRE":
            x = x + attention(case, prm, l, block_norm(case, prm, n1, x))
            x = x + mlp(case, prm, l, block_norm(case, prm, n2, x))
        else:  # POST_SUBLAYER (OLMo 2): normalise each sublayer's output
            x = x + block_norm(case, prm, n1, attention(case, prm, l, x))
            x = x + block_norm(case, prm, n2, mlp(case, prm, l, x))
    x = block_norm(case, prm, "ln_f", x)
    head = prm["wte"] if case["tie"] else prm["lm_head.weight"]
    logits = x @ head.t()  # [B, T, V]
    mx = logits.max(dim=-1, keepdim=True).values.detach()
    lse = (mx + torch.log(torch.exp(logits - mx).sum(dim=-1, keepdim=True))).squeeze(-1)
    tgt = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    ce = (lse - tgt).mean()
    zl = Z_COEF * (lse * lse).mean()
    return logits, ce, zl


# ----------------------------------------------------------------------------
# Self-checks
# ----------------------------------------------------------------------------

def rope_complex(x, theta):
    """RoPE as a complex product, written independently of rope(): element i
    and i + D/2 are the real and imaginary parts of z_i, multiplied by
    exp(1j * t * theta^(-2i/D))."""
    Dc = x.shape[-1]
    half = Dc // 2
    z = torch.complex(x[..., :half], x[..., half:])
    freqs = 1.0 / (theta ** (torch.arange(0, Dc, 2, dtype=torch.float64) / Dc))
    t = torch.arange(x.shape[1], dtype=torch.float64)
    rot = torch.polar(torch.ones(x.shape[1], half, dtype=torch.float64), torch.outer(t, freqs))
    z = z * rot[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def check_rope_hf(theta, x):
    """Against Hugging Face's own Llama RoPE when transformers is installed
    (its inverse frequencies are float32, hence the 1e-5 tolerance; the
    rotation itself is compared exactly). Returns the error or None."""
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    Bx, Tx, Hx, Dx = x.shape
    cfg = LlamaConfig(hidden_size=Hx * Dx, num_attention_heads=Hx, rope_theta=theta,
                      max_position_embeddings=max(Tx, 16))
    emb = LlamaRotaryEmbedding(config=cfg)
    pos = torch.arange(Tx)[None, :].expand(Bx, Tx)
    cos_hf, sin_hf = emb(x, pos)  # [B, T, D]
    cos, sin = rope_cos_sin(Tx, Dx, theta)
    table_err = max((cos_hf[0] - cos).abs().max().item(), (sin_hf[0] - sin).abs().max().item())
    assert table_err < 1e-5, ("HF cos/sin", theta, table_err)
    xt = x.transpose(1, 2)  # HF layout [B, H, T, D]
    q_hf, _ = apply_rotary_pos_emb(xt, xt, cos[None].expand(Bx, Tx, Dx), sin[None].expand(Bx, Tx, Dx))
    return max(table_err, (q_hf.transpose(1, 2) - rope(x, theta)).abs().max().item())


def check_repeat_kv_hf(case):
    """The query-to-k/v-head map against Hugging Face's repeat_kv (Llama, Qwen3 and OLMo 2
    attention use it) when transformers is installed. Returns the error or None."""
    try:
        from transformers.models.llama.modeling_llama import repeat_kv
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    Hc, Hkv = case["dims"]["H"], kv_heads(case)
    kv = torch.randn(2, 3, Hkv, 5, dtype=torch.float64)  # [B, T, Hkv, D]
    hf = repeat_kv(kv.transpose(1, 2), Hc // Hkv).transpose(1, 2)  # HF layout [B, H, T, D]
    return (hf - kv[:, :, kv_head_of(case)]).abs().max().item()


def check_against_builtins(case, prm64, tokens, targets, logits, ce, zl):
    """Cross-check loss pieces, norms, activations and RoPE against torch
    built-ins or independent formulas. Returns (max error, HF RoPE error or None)."""
    import torch.nn.functional as Fn
    Vc, Cc, Hc, Dc, _, _, Tc, _, _ = dims(case)
    ce_ref = Fn.cross_entropy(logits.reshape(-1, Vc), targets.long().reshape(-1))
    lse_ref = torch.logsumexp(logits, dim=-1)
    zl_ref = Z_COEF * (lse_ref ** 2).mean()
    x = torch.randn(5, Cc, dtype=torch.float64)
    w = torch.randn(Cc, dtype=torch.float64)
    b = torch.randn(Cc, dtype=torch.float64)
    errs = [
        abs(ce_ref.item() - ce.item()),
        abs(zl_ref.item() - zl.item()),
        (Fn.layer_norm(x, (Cc,), w, b, EPS_NORM) - layer_norm(x, w, b)).abs().max().item(),
        (Fn.layer_norm(x, (Cc,), w, None, EPS_NORM) - layer_norm(x, w, None)).abs().max().item(),
        (Fn.gelu(x, approximate="tanh") - gelu_tanh(x)).abs().max().item(),
        (Fn.silu(x) - silu(x)).abs().max().item(),
    ]
    hf_err = None
    if case["position"] == "ROPE":
        xr = torch.randn(2, Tc, Hc, Dc, dtype=torch.float64)
        errs.append((rope_complex(xr, case["rope_theta"]) - rope(xr, case["rope_theta"])).abs().max().item())
        hf_err = check_rope_hf(case["rope_theta"], xr)
    if grouped_query(case):
        kv_err = check_repeat_kv_hf(case)
        assert kv_err is None or kv_err == 0.0, ("HF repeat_kv", kv_err)
    assert max(errs) < 1e-12, errs
    return max(errs), hf_err


def finite_difference_check(case, prm64, grads, tokens, targets, gen, n=3, h=1e-6):
    """Central differences of ce+zl on random single entries; returns max relative error."""
    names = list(prm64.keys())
    worst = 0.0
    details = []
    picked = set()
    # The n random entries, plus one drawn from the QK-norm / qk_scale
    # parameters, one from the MLP gate and one from the grouped k/v projection
    # when the case has them (so those paths are always probed).
    pools = [[k for k in names if "_norm." in k or k.endswith("qk_scale")],
             [k for k in names if ".mlp.gate." in k],
             [k for k in names if ".attn.kv." in k]]
    pools = [pl for pl in pools if pl]
    want = n + len(pools)
    while len(details) < want:
        pool = names if len(details) < n else pools[len(details) - n]
        name = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        idx = int(torch.randint(prm64[name].numel(), (1,), generator=gen))
        # Skip repeats and structurally-zero entries (e.g. k biases, whose
        # gradient vanishes by softmax shift invariance); the relative error of
        # an exact zero is meaningless against finite-difference round-off.
        if name in picked or abs(grads[name].reshape(-1)[idx].item()) < 1e-6:
            continue
        picked.add(name)

        def total_at(delta):
            p2 = {k: v.detach().clone() for k, v in prm64.items()}
            p2[name].view(-1)[idx] += delta  # clone() is contiguous
            with torch.no_grad():
                _, ce_, zl_ = forward(case, p2, tokens, targets)
            return (ce_ + zl_).item()

        fd = (total_at(h) - total_at(-h)) / (2 * h)
        ad = grads[name].reshape(-1)[idx].item()
        rel = abs(fd - ad) / max(abs(fd), abs(ad), 1e-10)
        worst = max(worst, rel)
        details.append(f"{name}[{idx}] ad={ad:.6e} fd={fd:.6e} rel={rel:.2e}")
    return worst, details


# ----------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------

def encode_entry(name, tensor, dtype):
    np_fmt = {DT_F32: torch.float32, DT_I32: torch.int32, DT_F64: torch.float64}[dtype]
    t = tensor.detach().to(np_fmt).contiguous()
    nb = name.encode("ascii")
    out = struct.pack("<I", len(nb)) + nb + struct.pack("<II", dtype, t.dim())
    out += struct.pack("<" + "q" * t.dim(), *t.shape)
    fmt = {DT_F32: "f", DT_I32: "i", DT_F64: "d"}[dtype]
    out += struct.pack("<%d%s" % (t.numel(), fmt), *t.reshape(-1).tolist())
    return out


def write_fixture(path, entries):
    blob = b"KEELFIX1" + struct.pack("<I", len(entries))
    for name, tensor, dtype in entries:
        blob += encode_entry(name, tensor, dtype)
    with open(path, "wb") as f:
        f.write(blob)
    return len(blob)


def config_record(case):
    Vc, Cc, Hc, _, Fc, Lc, Tc, Pc, Bc = dims(case)
    return torch.tensor([
        Vc, Cc, Hc, Fc, Lc, Tc, Pc, Bc,
        QK_CODES[case["qk_norm"]],
        SCOPE_CODES[case["scope"]] if case["qk_norm"] != "NONE" else 1,
        NORM_CODES[case["norm"]],
        1 if case["tie"] else 0,
        POSITION_CODES[case["position"]],
        MLP_CODES[case["mlp"]],
        1 if case["bias"] else 0,
        PLACEMENT_CODES[case["placement"]],
        case["kv_heads"],  # model.n_kv_heads (0: n_heads)
        case["head_dim"],  # model.head_dim (0: d_model / n_heads)
    ], dtype=torch.int32)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def run_case(case):
    Vc, _, _, _, _, _, Tc, _, Bc = dims(case)
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    params32 = init_params(case, gen)
    tokens = torch.randint(0, Vc, (Bc, Tc), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, Vc, (Bc, Tc), generator=gen, dtype=torch.int32)

    prm64 = {k: v.to(torch.float64).requires_grad_(True) for k, v in params32.items()}
    logits, ce, zl = forward(case, prm64, tokens, targets)
    total = ce + zl
    gl = torch.autograd.grad(total, list(prm64.values()))
    grads = {k: g.detach().contiguous() for k, g in zip(prm64.keys(), gl)}

    builtin_err, hf_err = check_against_builtins(case, prm64, tokens, targets, logits.detach(),
                                                 ce.detach(), zl.detach())
    fd_worst, fd_details = finite_difference_check(case, prm64, grads, tokens, targets, gen)
    # Parameters whose whole gradient is (numerically) zero. Expected only for
    # biases added to k *after* which nothing is normalised or rotated: a
    # constant added to every key shifts each score row by a constant, which
    # softmax ignores (RoPE turns it by the key's position, so not with ROPE).
    zero_grads = [k for k, g in grads.items() if g.abs().max().item() < 1e-12]

    entries = [
        ("config", config_record(case), DT_I32),
        ("rope_theta", torch.tensor([case["rope_theta"]], dtype=torch.float64), DT_F64),
        ("z_loss", torch.tensor([Z_COEF], dtype=torch.float64), DT_F64),
        ("tokens", tokens, DT_I32),
        ("targets", targets, DT_I32),
    ]
    entries += [(k, v, DT_F32) for k, v in params32.items()]
    entries += [
        ("loss", ce.detach().reshape(1), DT_F64),
        ("z_loss_value", zl.detach().reshape(1), DT_F64),
        ("logits", logits.detach(), DT_F64),
    ]
    entries += [("grad/" + k, g, DT_F64) for k, g in grads.items()]

    path = os.path.join(OUT_DIR, case["name"] + ".bin")
    size = write_fixture(path, entries)
    extra = ""
    if case["kv_heads"] or case["head_dim"]:
        extra += f" kv_heads={kv_heads(case)} head_dim={dims(case)[3]}"
    if case["position"] == "ROPE":
        extra += f" theta={case['rope_theta']:g} hf_rope_err=" + ("skipped" if hf_err is None else f"{hf_err:.1e}")
    print(f"{case['name']:<26} norm={case['norm']:<9} tie={int(case['tie'])} pos={case['position']:<7} "
          f"mlp={case['mlp']:<6} bias={int(case['bias'])} {case['placement']:<13} "
          f"ce={ce.item():.6f} zl={zl.item():.6f} bytes={size} "
          f"builtin_err={builtin_err:.1e} fd_max_rel_err={fd_worst:.2e}{extra}")
    for d in fd_details:
        print("    " + d)
    if zero_grads:
        print("    structurally-zero gradients (softmax shift invariance): " + ", ".join(zero_grads))
    return fd_worst, size


def main():
    worst, total_size = 0.0, 0
    for case in make_cases():
        w, s = run_case(case)
        worst, total_size = max(worst, w), total_size + s
    print(f"finite-difference max relative error over all cases: {worst:.2e}")
    print(f"total fixture bytes: {total_size}")
    if worst > 1e-5:
        print("FAIL: finite-difference check", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
