#!/usr/bin/env python3
"""Checks a `keel-ckpt export` directory against keel's own view of the checkpoint.

usage: export_check.py gpt2|olmo2|qwen3|llama|keel OUT_DIR REF_DIR

OUT_DIR is what keel-ckpt export wrote. REF_DIR is what tests/launch/ckpt_export_test.cc wrote
from the checkpoint loaded into a one-process keel model:
  ref.txt        "vocab V", then "param NAME DIMS..." per parameter in order, then "tokens B T"
  param_<i>.f32  the i-th parameter, raw little-endian float32
  tokens.i32     [B, T] token ids
  logits.f32     [B, T, V] keel's logits on those tokens
  logits_qk_small.f32
                 with QK-norm: the same with the q and k rows of every qkv weight (grouped-query:
                 every q weight and the k half of every kv weight) multiplied by the "qk_scale" of
                 ref.txt (a power of two, so exact), which makes the QK-norm epsilon matter
                 (mean(q^2) comparable to it)

Checks, for both namings:
  - the file against the safetensors format itself (8-byte little-endian header length, a JSON
    header padded with spaces to a multiple of 8, string-only __metadata__, F32 tensors whose
    data_offsets tile the data exactly), then loaded by the real `safetensors` library;
  - every tensor bit for bit against keel's parameter, mapped here independently of keel's code
    (keel names: as stored, vocabulary padding dropped; GPT-2 names: Conv1D weights transposed;
    OLMo 2 / Qwen3 / Llama names: q, k, v split out of the fused qkv weight, or with grouped-query
    attention q as it is and k, v the halves of the kv weight);
  - the vocabulary padding is gone (the reference has more rows than vocab_size).
gpt2 also: config.json's fields, GPT2LMHeadModel.from_pretrained(OUT_DIR) with no missing,
unexpected or mismatched weights and the LM head tied to wte, and its logits on the same tokens
against keel's: max absolute difference <= 1e-5 (printed). As a control that the comparison can
tell, the same weights with the erf GELU must differ by more than that.
olmo2 and qwen3 also: config.json's fields (num_key_value_heads and Qwen3's head_dim included),
and the logits of tests/launch/hf_reference.py (an independent float64 implementation of
Olmo2ForCausalLM / Qwen3ForCausalLM reading only OUT_DIR) against keel's: max absolute difference
<= 1e-5 (printed), on the trained weights and on the small-q/k weights. Controls that each
comparison can tell, each by more than 10x the bound: interleaved RoPE pairs instead of
rotate-half, another rope_theta, with two or more k/v heads the k/v heads in reverse order, and
(small q/k) a QK-norm epsilon of 1e-6 instead of rms_norm_eps (keel's QK-norm and block-norm
epsilons are separate constants; Hugging Face has one).
llama also: config.json's fields, AutoModelForCausalLM.from_pretrained(OUT_DIR) is transformers'
own LlamaForCausalLM with no missing, unexpected or mismatched weights, and its logits against
keel's: max absolute difference <= 1e-5 (printed); controls: another rope_theta and, with two or
more k/v heads, the k/v heads in reverse order.
Any naming, when OUT_DIR has a tokenizer.json: AutoTokenizer.from_pretrained(OUT_DIR) loads it
with vocab_size tokens and round-trips a sentence, and (Hugging Face namings) the model takes
the ids it gives.
Exit status 0 when every check holds, 1 otherwise (each failure printed).
"""
import json
import os
import struct
import sys

import numpy as np

TOLERANCE = 1e-5  # absolute, on logits
QK_SCALE = None  # ref.txt's qk_scale, when keel wrote logits_qk_small.f32
failures = []


def check(cond, message):
    if not cond:
        failures.append(message)
        print("FAIL: " + message)
    return cond


def read_reference(ref_dir):
    params, vocab, tokens_shape = {}, None, None
    global QK_SCALE
    with open(os.path.join(ref_dir, "ref.txt")) as f:
        index = 0
        for line in f:
            parts = line.split()
            if parts[0] == "vocab":
                vocab = int(parts[1])
            elif parts[0] == "qk_scale":
                QK_SCALE = float(parts[1])
            elif parts[0] == "tokens":
                tokens_shape = (int(parts[1]), int(parts[2]))
            elif parts[0] == "param":
                shape = tuple(int(d) for d in parts[2:])
                data = np.fromfile(os.path.join(ref_dir, "param_%d.f32" % index), dtype="<f4")
                params[parts[1]] = data.reshape(shape)
                index += 1
    return vocab, tokens_shape, params


def check_format(path):
    """The file against the format (github.com/huggingface/safetensors README, "Format")."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n]
    data = raw[8 + n :]
    check(n % 8 == 0, "header length %d is not a multiple of 8" % n)
    check(header[:1] == b"{", "header does not begin with '{'")
    text = header.decode("utf-8")
    check(text.rstrip(" ").endswith("}"), "header padding is not spaces")
    h = json.loads(text)
    meta = h.pop("__metadata__", None)
    check(isinstance(meta, dict), "no __metadata__")
    meta = meta or {}
    check(all(isinstance(v, str) for v in meta.values()), "__metadata__ values must be strings")
    for key in ("format", "keel.step", "keel.checkpoint_format_version", "keel.source"):
        check(key in meta, "__metadata__ lacks %s" % key)
    check(meta.get("format") == "pt", "__metadata__ format is not 'pt' (transformers wants it)")
    end = 0
    for name, e in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = e["data_offsets"]
        check(e["dtype"] == "F32", "%s: dtype %s" % (name, e["dtype"]))
        check(begin == end, "%s: data_offsets start at %d, not %d" % (name, begin, end))
        size = 4 * int(np.prod(e["shape"]))
        check(stop - begin == size, "%s: %d bytes for shape %s" % (name, stop - begin, e["shape"]))
        end = stop
    check(end == len(data), "tensors cover %d bytes of %d of data" % (end, len(data)))
    return meta


def expected_keel(vocab, ref):
    out = {}
    for name, t in ref.items():
        out[name] = t[:vocab] if name in ("wte", "lm_head.weight") else t
    return out


def expected_gpt2(vocab, ref):
    out = {"transformer.wte.weight": ref["wte"][:vocab], "transformer.wpe.weight": ref["wpe"]}
    layers = count_layers(ref)
    for l in range(layers):
        k, h = "blocks.%d." % l, "transformer.h.%d." % l
        qkv = ref[k + "attn.qkv.weight"]  # [3, H, D, C]
        out[h + "ln_1.weight"] = ref[k + "ln1.weight"]
        out[h + "ln_1.bias"] = ref[k + "ln1.bias"]
        out[h + "attn.c_attn.weight"] = qkv.reshape(-1, qkv.shape[-1]).T  # Conv1D: [in, out]
        out[h + "attn.c_attn.bias"] = ref[k + "attn.qkv.bias"].reshape(-1)
        out[h + "attn.c_proj.weight"] = ref[k + "attn.proj.weight"].T
        out[h + "attn.c_proj.bias"] = ref[k + "attn.proj.bias"]
        out[h + "ln_2.weight"] = ref[k + "ln2.weight"]
        out[h + "ln_2.bias"] = ref[k + "ln2.bias"]
        out[h + "mlp.c_fc.weight"] = ref[k + "mlp.fc.weight"].T
        out[h + "mlp.c_fc.bias"] = ref[k + "mlp.fc.bias"]
        out[h + "mlp.c_proj.weight"] = ref[k + "mlp.proj.weight"].T
        out[h + "mlp.c_proj.bias"] = ref[k + "mlp.proj.bias"]
    out["transformer.ln_f.weight"] = ref["ln_f.weight"]
    out["transformer.ln_f.bias"] = ref["ln_f.bias"]
    return out, layers


def count_layers(ref):
    layers = 0
    while "blocks.%d.ln1.weight" % layers in ref:
        layers += 1
    return layers


def attention_dims(ref):
    """(heads, k/v heads, head_dim, d_model) of keel's first attention layer."""
    if "blocks.0.attn.qkv.weight" in ref:
        _, heads, head_dim, hidden = ref["blocks.0.attn.qkv.weight"].shape  # [3, H, D, C]
        return heads, heads, head_dim, hidden
    heads, head_dim, hidden = ref["blocks.0.attn.q.weight"].shape  # [H, D, C]
    return heads, ref["blocks.0.attn.kv.weight"].shape[1], head_dim, hidden  # [2, Hkv, D, C]


def expected_llama(naming, vocab, ref):
    """OLMo 2 / Qwen3 / Llama names: nn.Linear's [out, in] is keel's layout; q, k, v are the
    thirds of qkv [3, H, D, C], or (grouped-query) q [H, D, C] and the halves of kv
    [2, Hkv, D, C]; OLMo 2's QK gains are keel's [H, D] and [Hkv, D] PROJECTION gains flattened;
    Llama has none."""
    out = {"model.embed_tokens.weight": ref["wte"][:vocab], "model.norm.weight": ref["ln_f.weight"]}
    if "lm_head.weight" in ref:
        out["lm_head.weight"] = ref["lm_head.weight"][:vocab]
    if naming == "olmo2":
        ln1, ln2 = "post_attention_layernorm", "post_feedforward_layernorm"
    else:
        ln1, ln2 = "input_layernorm", "post_attention_layernorm"
    layers = count_layers(ref)
    for l in range(layers):
        k, h = "blocks.%d." % l, "model.layers.%d." % l
        if k + "attn.qkv.weight" in ref:
            qkv = ref[k + "attn.qkv.weight"]  # [3, H, D, C]
            q, kk, v = qkv[0], qkv[1], qkv[2]
        else:
            q, kv = ref[k + "attn.q.weight"], ref[k + "attn.kv.weight"]  # [H, D, C], [2, Hkv, D, C]
            kk, v = kv[0], kv[1]
        for name, w in (("q_proj", q), ("k_proj", kk), ("v_proj", v)):
            out[h + "self_attn.%s.weight" % name] = w.reshape(-1, w.shape[-1])
        out[h + "self_attn.o_proj.weight"] = ref[k + "attn.proj.weight"]
        if naming != "llama":
            out[h + "self_attn.q_norm.weight"] = ref[k + "attn.q_norm.weight"].reshape(-1)
            out[h + "self_attn.k_norm.weight"] = ref[k + "attn.k_norm.weight"].reshape(-1)
        out[h + "mlp.gate_proj.weight"] = ref[k + "mlp.gate.weight"]
        out[h + "mlp.up_proj.weight"] = ref[k + "mlp.fc.weight"]
        out[h + "mlp.down_proj.weight"] = ref[k + "mlp.proj.weight"]
        out[h + ln1 + ".weight"] = ref[k + "ln1.weight"]
        out[h + ln2 + ".weight"] = ref[k + "ln2.weight"]
    return out, layers


def check_tensors(got, want):
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    check(not extra and not missing, "tensor names differ: extra %s, missing %s" % (extra, missing))
    for name in sorted(set(got) & set(want)):
        g, w = got[name], np.ascontiguousarray(want[name])
        same_kind = g.dtype == np.float32 and g.shape == w.shape
        if check(same_kind, "%s: %s %s, want float32 %s" % (name, g.dtype, g.shape, w.shape)):
            same = np.array_equal(g.view(np.uint32), w.view(np.uint32))
            check(same, "%s: values differ from keel's (bitwise)" % name)


def check_transformers(out_dir, vocab, tokens_shape, ref, layers, ref_dir):
    import torch
    from transformers import GPT2LMHeadModel

    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = ref["blocks.0.attn.qkv.weight"].shape[1]
    want = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
        "n_positions": ref["wpe"].shape[0], "n_embd": ref["wpe"].shape[1], "n_layer": layers,
        "n_head": heads, "n_inner": ref["blocks.0.mlp.fc.weight"].shape[0],
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
    }
    for key, value in want.items():
        check(cfg.get(key) == value, "config.json %s = %r, want %r" % (key, cfg.get(key), value))

    model, info = GPT2LMHeadModel.from_pretrained(out_dir, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info.get(key), "from_pretrained %s: %s" % (key, info.get(key)))
    tied = model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    check(tied, "lm_head is not tied to wte")
    model.eval()
    tokens = np.fromfile(os.path.join(ref_dir, "tokens.i32"), dtype="<i4")
    tokens = tokens.reshape(tokens_shape)
    keel_logits = np.fromfile(os.path.join(ref_dir, "logits.f32"), dtype="<f4")
    keel_logits = keel_logits.reshape(tokens_shape + (vocab,))

    def logits(m):
        with torch.no_grad():
            return m(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()

    hf = logits(model)
    check(hf.shape == keel_logits.shape, "logits %s, keel's %s" % (hf.shape, keel_logits.shape))
    diff = float(np.max(np.abs(hf - keel_logits)))
    largest = float(np.max(np.abs(keel_logits)))
    print("max |logit difference| = %.3g (absolute; bound %g; max |logit| = %.3g)"
          % (diff, TOLERANCE, largest))
    check(diff <= TOLERANCE, "logits differ from keel's by %.3g > %g" % (diff, TOLERANCE))
    # Control: the comparison tells the tanh GELU (keel's) from the erf one.
    erf = GPT2LMHeadModel.from_pretrained(out_dir, activation_function="gelu")
    erf.eval()
    erf_diff = float(np.max(np.abs(logits(erf) - keel_logits)))
    print("control: erf GELU differs by %.3g" % erf_diff)
    check(erf_diff > 10 * TOLERANCE,
          "the erf GELU's logits differ by only %.3g: the comparison cannot tell" % erf_diff)


ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM"}


def check_llama_config(naming, out_dir, vocab, ref, layers):
    """config.json of an OLMo 2, Qwen3 or Llama export; returns it."""
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads, head_dim, hidden = attention_dims(ref)
    want = {
        "model_type": naming,
        "architectures": [ARCHITECTURES[naming]],
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": ref["blocks.0.mlp.fc.weight"].shape[0],
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in ref, "torch_dtype": "float32",
    }
    if naming == "qwen3":
        want.update({"head_dim": head_dim, "use_sliding_window": False})
    if naming == "llama":
        want.update({"head_dim": head_dim, "mlp_bias": False, "rope_scaling": None})
    if naming == "olmo2":  # Olmo2Config derives the head width from hidden_size
        check("head_dim" not in cfg and head_dim * heads == hidden,
              "OLMo 2 with head_dim %d, %d heads, hidden_size %d" % (head_dim, heads, hidden))
    for key, value in want.items():
        check(cfg.get(key) == value, "config.json %s = %r, want %r" % (key, cfg.get(key), value))
    theta = cfg.get("rope_theta")
    check(isinstance(theta, float) and theta > 1, "config.json rope_theta = %r" % theta)
    check(cfg.get("rope_parameters") == {"rope_type": "default", "rope_theta": theta},
          "config.json rope_parameters = %r" % cfg.get("rope_parameters"))
    return cfg


def reversed_kv_heads(weight, kv_heads):
    """k_proj or v_proj [Hkv D, C] with its k/v heads in reverse order (a control)."""
    return weight.reshape(kv_heads, -1, weight.shape[-1]).flip(0).reshape(weight.shape)


def read_tokens(ref_dir, tokens_shape):
    return np.fromfile(os.path.join(ref_dir, "tokens.i32"), dtype="<i4").reshape(tokens_shape)


def read_logits(ref_dir, name, tokens_shape, vocab):
    logits = np.fromfile(os.path.join(ref_dir, name), dtype="<f4")
    return logits.reshape(tokens_shape + (vocab,)).astype(np.float64)


def report(d, logits, what="max |logit difference|"):
    print("%s = %.3g (absolute; bound %g; max |logit| = %.3g)"
          % (what, d, TOLERANCE, float(np.max(np.abs(logits)))))
    check(d <= TOLERANCE, "%s: %.3g > %g" % (what, d, TOLERANCE))


def control(label, d):
    print("control: %s differs by %.3g" % (label, d))
    check(d > 10 * TOLERANCE, "%s differs by only %.3g: the comparison cannot tell" % (label, d))


def check_llama(naming, out_dir, vocab, tokens_shape, ref, layers, ref_dir):
    """OLMo 2 and Qwen3: keel's logits against hf_reference.py's."""
    import hf_reference

    cfg = check_llama_config(naming, out_dir, vocab, ref, layers)
    theta = cfg.get("rope_theta")
    config, tensors = hf_reference.load(out_dir)
    tokens = read_tokens(ref_dir, tokens_shape)

    def diff(logits, variant, weights=tensors):
        ref_logits = hf_reference.forward(config, weights, tokens, variant).numpy()
        check(ref_logits.shape == logits.shape, "logits %s, keel's %s" % (ref_logits.shape,
                                                                          logits.shape))
        return float(np.max(np.abs(ref_logits - logits)))

    trained = read_logits(ref_dir, "logits.f32", tokens_shape, vocab)
    report(diff(trained, hf_reference.Variant()), trained)
    other_theta = 10000.0 if theta != 10000.0 else 1e6
    control("(trained weights) interleaved RoPE",
            diff(trained, hf_reference.Variant(interleaved_rope=True)))
    control("(trained weights) rope_theta %g" % other_theta,
            diff(trained, hf_reference.Variant(rope_theta=other_theta)))
    kv_heads = config["num_key_value_heads"]
    if kv_heads > 1:
        swapped = dict(tensors)
        for name in tensors:
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                swapped[name] = reversed_kv_heads(tensors[name], kv_heads)
        control("(trained weights) k/v heads in reverse order",
                diff(trained, hf_reference.Variant(), swapped))

    # Small q and k: mean(q^2) near the epsilon, so the QK-norm epsilon shows in the logits.
    check(QK_SCALE is not None, "ref.txt has no qk_scale")
    small = read_logits(ref_dir, "logits_qk_small.f32", tokens_shape, vocab)
    report(diff(small, hf_reference.Variant(qk_scale=QK_SCALE)), small,
           "small q/k (x%g): max |logit difference|" % QK_SCALE)
    control("(small q/k) QK-norm epsilon 1e-6",
            diff(small, hf_reference.Variant(qk_scale=QK_SCALE, qk_norm_eps=1e-6)))


def check_transformers_llama(out_dir, vocab, tokens_shape, ref, layers, ref_dir):
    """Llama: keel's logits against transformers' own LlamaForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = check_llama_config("llama", out_dir, vocab, ref, layers)
    # Eager attention: the plain softmax(q k^T / sqrt(D)) v, in float32.
    model, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True,
                                                       attn_implementation="eager")
    check(type(model) is LlamaForCausalLM, "AutoModelForCausalLM gave %s" % type(model).__name__)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info.get(key), "from_pretrained %s: %s" % (key, info.get(key)))
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    check(tied == cfg["tie_word_embeddings"], "lm_head tied: %s, config.json says %s"
          % (tied, cfg["tie_word_embeddings"]))
    attn = model.model.layers[0].self_attn
    heads, kv_heads, head_dim, _ = attention_dims(ref)
    check((attn.num_heads, attn.num_key_value_heads, attn.head_dim) == (heads, kv_heads, head_dim),
          "transformers built %d heads, %d k/v heads of %d"
          % (attn.num_heads, attn.num_key_value_heads, attn.head_dim))
    model.eval()
    tokens = torch.from_numpy(read_tokens(ref_dir, tokens_shape).astype(np.int64))
    keel_logits = read_logits(ref_dir, "logits.f32", tokens_shape, vocab)

    def diff(m):
        with torch.no_grad():
            hf = m(tokens).logits.double().numpy()
        check(hf.shape == keel_logits.shape, "logits %s, keel's %s" % (hf.shape, keel_logits.shape))
        return float(np.max(np.abs(hf - keel_logits)))

    report(diff(model), keel_logits)
    other_theta = 10000.0 if cfg["rope_theta"] != 10000.0 else 1e6
    control("rope_theta %g" % other_theta,
            diff(AutoModelForCausalLM.from_pretrained(out_dir, rope_theta=other_theta,
                                                      attn_implementation="eager").eval()))
    if kv_heads > 1:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.weight.copy_(reversed_kv_heads(proj.weight, kv_heads))
        control("k/v heads in reverse order", diff(model))


def check_tokenizer(naming, out_dir, vocab):
    """The run's tokenizer beside the model: AutoTokenizer loads it, and the model takes its ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    check(len(tok) == vocab, "the tokenizer has %d tokens, the model %d" % (len(tok), vocab))
    text = "kaven lo quadorith."
    ids = tok(text)["input_ids"]
    check(tok.decode(ids) == text, "the tokenizer gives back %r for %r" % (tok.decode(ids), text))
    check(all(0 <= i < vocab for i in ids), "token ids %s outside the vocabulary" % ids)
    print("tokenizer: %d tokens, %r -> %s" % (len(tok), text, ids))
    if naming in ("keel", "olmo2", "qwen3"):
        return  # transformers 4.46 has neither model; the logits are checked above
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    check(tuple(logits.shape) == (1, len(ids), vocab), "logits of shape %s" % (logits.shape,))


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("gpt2", "olmo2", "qwen3", "llama", "keel"):
        sys.exit(__doc__)
    naming, out_dir, ref_dir = sys.argv[1:]
    vocab, tokens_shape, ref = read_reference(ref_dir)
    check(ref["wte"].shape[0] > vocab, "the reference has no vocabulary padding to drop")
    path = os.path.join(out_dir, "model.safetensors")
    meta = check_format(path)
    check(meta.get("keel.naming") == naming, "keel.naming = %r" % meta.get("keel.naming"))
    from safetensors.numpy import load_file

    got = load_file(path)
    if naming == "keel":
        config = os.path.join(out_dir, "config.json")
        check(not os.path.exists(config), "config.json written with keel names")
        check_tensors(got, expected_keel(vocab, ref))
    elif naming in ("olmo2", "qwen3"):
        want, layers = expected_llama(naming, vocab, ref)
        check_tensors(got, want)
        check_llama(naming, out_dir, vocab, tokens_shape, ref, layers, ref_dir)
    elif naming == "llama":
        want, layers = expected_llama(naming, vocab, ref)
        check_tensors(got, want)
        check_transformers_llama(out_dir, vocab, tokens_shape, ref, layers, ref_dir)
    else:
        want, layers = expected_gpt2(vocab, ref)
        check_tensors(got, want)
        check_transformers(out_dir, vocab, tokens_shape, ref, layers, ref_dir)
    if os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        check_tokenizer(naming, out_dir, vocab)
    print("%d tensors checked, %d failures" % (len(got), len(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
