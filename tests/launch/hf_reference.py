#!/usr/bin/env python3
"""An independent float64 PyTorch forward of Hugging Face's Olmo2ForCausalLM and Qwen3ForCausalLM.

usage: hf_reference.py OUT_DIR TOKENS...     prints the logits of one sequence, one row per token

It reads only OUT_DIR/config.json and OUT_DIR/model.safetensors (what `keel-ckpt export` writes)
and shares no code with keel: it is written from the architectures as transformers defines them
(transformers/models/{olmo2,qwen3}/modeling_*.py), because the transformers in tests/run's venv
(< 4.47) has neither model. tests/launch/export_check.py compares its logits with keel's.

Both architectures, for tokens x of length T:
  h = embed_tokens[x]                                         (no embedding scale)
  per layer: q, k, v = h Wq^T, h Wk^T, h Wv^T                  (nn.Linear, [out, in]; no bias)
    q has num_attention_heads heads of head_dim, k and v num_key_value_heads (transformers'
    repeat_kv: query head j attends with k/v head j // (num_attention_heads / num_key_value_heads))
    head_dim: config.json's (Qwen3), else hidden_size / num_attention_heads (OLMo 2)
    OLMo 2: q, k = RMSNorm over the whole projection (num_heads * head_dim for q,
            num_key_value_heads * head_dim for k) with q_norm / k_norm, then split into heads
    Qwen3:  split into heads, then RMSNorm over head_dim with the [head_dim] q_norm / k_norm
    q, k = RoPE(q), RoPE(k): rotate-half, inv_freq_i = rope_theta^(-2i / head_dim), i < head_dim/2,
           cos/sin of position * inv_freq repeated twice: x cos + rotate_half(x) sin with
           rotate_half([x1, x2]) = [-x2, x1]
    a = softmax(q k^T / sqrt(head_dim) + causal mask) v, heads concatenated, then o_proj
    MLP(y) = down_proj(silu(gate_proj(y)) * up_proj(y))
    OLMo 2 (norms after each sublayer): h = h + post_attention_layernorm(attn(h));
                                         h = h + post_feedforward_layernorm(MLP(h))
    Qwen3 (pre-norm):                   h = h + attn(input_layernorm(h));
                                         h = h + MLP(post_attention_layernorm(h))
  logits = norm(h) lm_head^T, lm_head = embed_tokens when tie_word_embeddings
  RMSNorm(y) = y / sqrt(mean(y^2) + rms_norm_eps) * weight, one epsilon for every norm.

`Variant` changes one thing on purpose, for the controls that show a comparison can tell a right
implementation from a near miss (interleaved RoPE, another theta, another QK-norm epsilon).
"""
import dataclasses
import json
import os
import sys

import numpy as np
import torch

ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass
class Variant:
    interleaved_rope: bool = False  # pairs (2i, 2i+1) (GPT-J, Meta's Llama) instead of (i, i+D/2)
    rope_theta: float = None        # instead of config.json's
    qk_norm_eps: float = None       # for q_norm / k_norm only, instead of rms_norm_eps
    qk_scale: float = 1.0           # multiplies q_proj and k_proj (exact for a power of two)


def load(out_dir):
    """config.json and the tensors (float64) of an export."""
    from safetensors.numpy import load_file

    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    return config, {name: torch.from_numpy(t.astype(np.float64)) for name, t in tensors.items()}


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, theta, interleaved):
    """x [B, H, T, D] at positions 0..T-1."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    angle = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x2 * cos + x1 * sin
        return out
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def check_config(config):
    """The options this reference implements; anything else is refused, not approximated."""
    arch = config["model_type"]
    if arch not in ARCHITECTURES or config["architectures"] != [ARCHITECTURES[arch]]:
        raise ValueError("not an OLMo 2 or Qwen3 export: %r" % config.get("architectures"))
    if config["hidden_act"] != "silu":
        raise ValueError("hidden_act %r (only silu)" % config["hidden_act"])
    if config.get("attention_bias", False):
        raise ValueError("attention_bias is not implemented here")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError("num_key_value_heads %r does not divide num_attention_heads %r"
                         % (kv_heads, heads))
    if arch == "olmo2" and "head_dim" in config:
        raise ValueError("Olmo2Config has no head_dim")
    if config.get("rope_scaling") is not None or config.get("use_sliding_window", False):
        raise ValueError("RoPE scaling and sliding windows are not implemented here")
    return arch


def forward(config, tensors, tokens, variant=Variant()):
    """Logits [B, T, vocab_size] (float64) of tokens [B, T] (int)."""
    arch = check_config(config)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"] if arch == "qwen3" else config["hidden_size"] // n_heads
    eps = config["rms_norm_eps"]
    qk_eps = eps if variant.qk_norm_eps is None else variant.qk_norm_eps
    theta = config["rope_theta"] if variant.rope_theta is None else variant.rope_theta
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
    B, T = tokens.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def attention(x, p):
        q = x @ (variant.qk_scale * tensors[p + "q_proj.weight"]).T
        k = x @ (variant.qk_scale * tensors[p + "k_proj.weight"]).T
        v = x @ tensors[p + "v_proj.weight"].T
        if arch == "olmo2":  # over the whole projection
            q = rms_norm(q, tensors[p + "q_norm.weight"], qk_eps)
            k = rms_norm(k, tensors[p + "k_norm.weight"], qk_eps)
        heads = lambda y, n: y.view(B, T, n, head_dim).transpose(1, 2)  # [B, n, T, D]
        q, k, v = heads(q, n_heads), heads(k, n_kv), heads(v, n_kv)
        if arch == "qwen3":  # per head, over head_dim
            q = rms_norm(q, tensors[p + "q_norm.weight"], qk_eps)
            k = rms_norm(k, tensors[p + "k_norm.weight"], qk_eps)
        q, k = rope(q, theta, variant.interleaved_rope), rope(k, theta, variant.interleaved_rope)
        # Each k/v head serves n_heads / n_kv consecutive query heads.
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        a = torch.softmax(scores, -1) @ v  # [B, H, T, D]
        a = a.transpose(1, 2).reshape(B, T, n_heads * head_dim)
        return a @ tensors[p + "o_proj.weight"].T

    def mlp(x, p):
        gate = x @ tensors[p + "gate_proj.weight"].T
        up = x @ tensors[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ tensors[p + "down_proj.weight"].T

    h = tensors["model.embed_tokens.weight"][tokens]
    for layer in range(config["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        norm = lambda x, name: rms_norm(x, tensors[p + name + ".weight"], eps)
        if arch == "olmo2":
            h = h + norm(attention(h, p + "self_attn."), "post_attention_layernorm")
            h = h + norm(mlp(h, p + "mlp."), "post_feedforward_layernorm")
        else:
            h = h + attention(norm(h, "input_layernorm"), p + "self_attn.")
            h = h + mlp(norm(h, "post_attention_layernorm"), p + "mlp.")
    h = rms_norm(h, tensors["model.norm.weight"], eps)
    if config["tie_word_embeddings"]:
        head = tensors["model.embed_tokens.weight"]
    else:
        head = tensors["lm_head.weight"]
    return h @ head.T


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    config, tensors = load(sys.argv[1])
    logits = forward(config, tensors, [[int(t) for t in sys.argv[2:]]])[0]
    for row in logits.numpy():
        print(" ".join("%.6g" % v for v in row))


if __name__ == "__main__":
    main()
