"""Regenerate the whole-model parity fixtures: /usr/bin/python3 tests/reference/make_fixtures.py (writes *.bin into its own directory)."""

# PyTorch (float64) reference of keel's GPT model, written with plain functional
# ops so every formula is explicit. For each case it writes one KEELFIX1 file
# holding the config, inputs, float32 weights, float64 logits/losses and the
# float64 gradient of (ce + z-loss) with respect to every parameter.
# See README.md in this directory for the file format.

import math
import os
import struct
import sys

import torch

torch.set_num_threads(1)

OUT_DIR = os.path.dirname(os.path.abspath(__file__))

# Small config shared by all cases.
V, C, H, F, N_LAYERS, T, P, B = 67, 32, 4, 96, 2, 8, 12, 2
D = C // H
Z_COEF = 1e-2
EPS_NORM = 1e-5
EPS_L2 = 1e-6

QK_CODES = {"NONE": 1, "RMS": 2, "LAYER": 3, "L2": 4}
SCOPE_CODES = {"HEAD_SHARED": 1, "HEAD": 2, "PROJECTION": 3}
NORM_CODES = {"LAYERNORM": 1, "RMSNORM": 2}

DT_F32, DT_I32, DT_F64 = 0, 1, 2


# ----------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------

def make_cases():
    combos = [("NONE", "HEAD_SHARED")]
    for qk in ("RMS", "LAYER", "L2"):
        for scope in ("HEAD_SHARED", "HEAD", "PROJECTION"):
            combos.append((qk, scope))
    cases = []
    for i, (qk, scope) in enumerate(combos):
        name = "qk_none" if qk == "NONE" else f"qk_{qk.lower()}_{scope.lower()}"
        cases.append(dict(
            name=name,
            index=i,
            qk_norm=qk,
            scope=scope,
            # Alternate both switches so every combination appears.
            norm="LAYERNORM" if i % 2 == 0 else "RMSNORM",
            tie=(i // 2) % 2 == 0,
            seed=1000 + 17 * i,
        ))
    return cases


# ----------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------

def param_specs(case):
    """Ordered list of (name, shape, kind) with kind in {mat, normw, bias, qkscale}."""
    ln = case["norm"] == "LAYERNORM"
    qk, scope = case["qk_norm"], case["scope"]
    specs = [("wte", (V, C), "mat"), ("wpe", (P, C), "mat")]
    qk_shape = (D,) if scope == "HEAD_SHARED" else (H, D)
    for l in range(N_LAYERS):
        p = f"blocks.{l}."
        specs.append((p + "ln1.weight", (C,), "normw"))
        if ln:
            specs.append((p + "ln1.bias", (C,), "bias"))
        specs.append((p + "attn.qkv.weight", (3, H, D, C), "mat"))
        specs.append((p + "attn.qkv.bias", (3, H, D), "bias"))
        if qk in ("RMS", "LAYER"):
            specs.append((p + "attn.q_norm.weight", qk_shape, "normw"))
            if qk == "LAYER":
                specs.append((p + "attn.q_norm.bias", qk_shape, "bias"))
            specs.append((p + "attn.k_norm.weight", qk_shape, "normw"))
            if qk == "LAYER":
                specs.append((p + "attn.k_norm.bias", qk_shape, "bias"))
        if qk == "L2":
            specs.append((p + "attn.qk_scale", (H,) if scope == "HEAD" else (1,), "qkscale"))
        specs.append((p + "attn.proj.weight", (C, C), "mat"))
        specs.append((p + "attn.proj.bias", (C,), "bias"))
        specs.append((p + "ln2.weight", (C,), "normw"))
        if ln:
            specs.append((p + "ln2.bias", (C,), "bias"))
        specs.append((p + "mlp.fc.weight", (F, C), "mat"))
        specs.append((p + "mlp.fc.bias", (F,), "bias"))
        specs.append((p + "mlp.proj.weight", (C, F), "mat"))
        specs.append((p + "mlp.proj.bias", (C,), "bias"))
    specs.append(("ln_f.weight", (C,), "normw"))
    if ln:
        specs.append(("ln_f.bias", (C,), "bias"))
    if not case["tie"]:
        specs.append(("lm_head.weight", (V, C), "mat"))
    return specs


def init_params(case, gen):
    """Generic (non-default) init, rounded to float32. Returns dict name -> float32 tensor."""
    params = {}
    qk_scale_init = math.log2(T * T - T)  # Henry et al. 2020, T_train = seq_len
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
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased
    return (x - mean) / torch.sqrt(var + eps) * w + b


def rms_norm(x, w, eps=EPS_NORM):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def block_norm(case, prm, prefix, x):
    if case["norm"] == "LAYERNORM":
        return layer_norm(x, prm[prefix + ".weight"], prm[prefix + ".bias"])
    return rms_norm(x, prm[prefix + ".weight"])


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def qk_normalize(case, prm, prefix, which, x):
    """x: [B, T, H, D]; which in {'q', 'k'}. Returns normalised [B, T, H, D]."""
    qk, scope = case["qk_norm"], case["scope"]
    if qk == "NONE":
        return x
    Bx, Tx = x.shape[0], x.shape[1]
    if scope == "PROJECTION":
        y = x.reshape(Bx, Tx, H * D)  # normalise over the whole H*D vector
    else:
        y = x  # normalise each head over its D values
    if qk == "L2":
        y = y / torch.sqrt((y * y).sum(dim=-1, keepdim=True) + EPS_L2)
    else:
        w = prm[f"{prefix}.{which}_norm.weight"]
        if scope == "PROJECTION":
            w = w.reshape(H * D)
        if qk == "RMS":
            y = rms_norm(y, w)
        else:
            b = prm[f"{prefix}.{which}_norm.bias"]
            if scope == "PROJECTION":
                b = b.reshape(H * D)
            y = layer_norm(y, w, b)
    return y.reshape(Bx, Tx, H, D)


def attention(case, prm, l, x):
    p = f"blocks.{l}.attn"
    W = prm[p + ".qkv.weight"]  # [3, H, D, C]
    bias = prm[p + ".qkv.bias"]  # [3, H, D]
    qkv = torch.einsum("btc,jhdc->btjhd", x, W) + bias  # [B, T, 3, H, D]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, D]
    q = qk_normalize(case, prm, p, "q", q)
    k = qk_normalize(case, prm, p, "k", k)
    if case["qk_norm"] == "L2":
        s = prm[p + ".qk_scale"]
        scale = s.reshape(1, H, 1, 1) if s.numel() == H and case["scope"] == "HEAD" else s.reshape(1, 1, 1, 1)
    else:
        scale = 1.0 / math.sqrt(D)
    Tx = x.shape[1]
    scores = torch.einsum("bthd,buhd->bhtu", q, k) * scale  # [B, H, T, T]
    causal = torch.ones(Tx, Tx, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    m = scores.max(dim=-1, keepdim=True).values.detach()
    e = torch.exp(scores - m)
    probs = e / e.sum(dim=-1, keepdim=True)
    o = torch.einsum("bhtu,buhd->bthd", probs, v)  # [B, T, H, D]
    o = o.reshape(x.shape[0], Tx, H * D)  # heads concatenated h = 0..H-1
    return o @ prm[p + ".proj.weight"].t() + prm[p + ".proj.bias"]


def mlp(prm, l, x):
    p = f"blocks.{l}.mlp"
    h = gelu_tanh(x @ prm[p + ".fc.weight"].t() + prm[p + ".fc.bias"])
    return h @ prm[p + ".proj.weight"].t() + prm[p + ".proj.bias"]


def forward(case, prm, tokens, targets):
    """prm: dict name -> float64 tensor. Returns (logits, ce, zl)."""
    Tx = tokens.shape[1]
    x = prm["wte"][tokens.long()] + prm["wpe"][:Tx]
    for l in range(N_LAYERS):
        x = x + attention(case, prm, l, block_norm(case, prm, f"blocks.{l}.ln1", x))
        x = x + mlp(prm, l, block_norm(case, prm, f"blocks.{l}.ln2", x))
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

def check_against_builtins(case, prm64, tokens, targets, logits, ce, zl):
    """Cross-check loss pieces against torch built-ins (independent formulas)."""
    import torch.nn.functional as Fn
    ce_ref = Fn.cross_entropy(logits.reshape(-1, V), targets.long().reshape(-1))
    lse_ref = torch.logsumexp(logits, dim=-1)
    zl_ref = Z_COEF * (lse_ref ** 2).mean()
    x = torch.randn(5, C, dtype=torch.float64)
    w = torch.randn(C, dtype=torch.float64)
    b = torch.randn(C, dtype=torch.float64)
    errs = [
        abs(ce_ref.item() - ce.item()),
        abs(zl_ref.item() - zl.item()),
        (Fn.layer_norm(x, (C,), w, b, EPS_NORM) - layer_norm(x, w, b)).abs().max().item(),
        (Fn.gelu(x, approximate="tanh") - gelu_tanh(x)).abs().max().item(),
    ]
    assert max(errs) < 1e-12, errs
    return max(errs)


def finite_difference_check(case, prm64, grads, tokens, targets, gen, n=3, h=1e-6):
    """Central differences of ce+zl on random single entries; returns max relative error."""
    names = list(prm64.keys())
    worst = 0.0
    details = []
    picked = set()
    # The n random entries, plus one drawn from the QK-norm / qk_scale
    # parameters when the case has them (so those paths are always probed).
    qk_names = [k for k in names if "_norm." in k or k.endswith("qk_scale")]
    want = n + (1 if qk_names else 0)
    while len(details) < want:
        pool = names if len(details) < n else qk_names
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


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def run_case(case):
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    params32 = init_params(case, gen)
    tokens = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32)

    prm64 = {k: v.to(torch.float64).requires_grad_(True) for k, v in params32.items()}
    logits, ce, zl = forward(case, prm64, tokens, targets)
    total = ce + zl
    gl = torch.autograd.grad(total, list(prm64.values()))
    grads = {k: g.detach().contiguous() for k, g in zip(prm64.keys(), gl)}

    builtin_err = check_against_builtins(case, prm64, tokens, targets, logits.detach(), ce.detach(), zl.detach())
    fd_worst, fd_details = finite_difference_check(case, prm64, grads, tokens, targets, gen)
    # Parameters whose whole gradient is (numerically) zero. Expected only for
    # biases added to k *after* which nothing is normalised: a constant added to
    # every key shifts each score row by a constant, which softmax ignores.
    zero_grads = [k for k, g in grads.items() if g.abs().max().item() < 1e-12]

    config = torch.tensor([
        V, C, H, F, N_LAYERS, T, P, B,
        QK_CODES[case["qk_norm"]],
        SCOPE_CODES[case["scope"]] if case["qk_norm"] != "NONE" else 1,
        NORM_CODES[case["norm"]],
        1 if case["tie"] else 0,
    ], dtype=torch.int32)

    entries = [
        ("config", config, DT_I32),
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
    print(f"{case['name']:<24} norm={case['norm']:<9} tie={int(case['tie'])} "
          f"ce={ce.item():.6f} zl={zl.item():.6f} bytes={size} "
          f"builtin_err={builtin_err:.1e} fd_max_rel_err={fd_worst:.2e}")
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
