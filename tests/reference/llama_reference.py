#!/usr/bin/python3
"""Independent reference forward pass for Llama-family checkpoints.

Written from the Hugging Face transformers modelling code's *semantics*
(LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Qwen3ForCausalLM /
Phi3ForCausalLM, RoPE default / llama3 / linear / yarn / dynamic / longrope,
partial rotary), sharing no code
with pdworker's C++: its own config.json reading, its own safetensors parser,
numpy only (Debian's python3-numpy), run with /usr/bin/python3.

Precision: every weight is converted to float64 and the whole forward runs in
float64 (numpy), so the reference's own rounding error (~1e-15 relative) is
negligible next to the fp32 CPU and bf16 CUDA backends under test.

The forward is the simplest correct one: no KV cache, every sequence is run
from scratch over positions 0..n-1 with a full causal mask:

  h = embed_tokens[tokens]
  per layer:
    x = RMSNorm(h) * input_layernorm
    q, k, v = x @ Wq^T (+bq), x @ Wk^T (+bk), x @ Wv^T (+bv)
    q, k = RMSNorm(q) * q_norm, RMSNorm(k) * k_norm
                                   # Qwen3 only: per head, over head_dim
                                   # (Qwen3Attention: q_norm(q_proj(x).view(
                                   # ..., head_dim)) before the rotation)
    q, k = RoPE(q), RoPE(k)        # rotate_half convention, positions 0..n-1
    attn = softmax(q k^T / sqrt(head_dim) + causal mask) v
                                   # query head h reads KV head h // (H / KVH)
    h = h + attn @ Wo^T (+bo)
    x = RMSNorm(h) * post_attention_layernorm
    h = h + (silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T
  logits = (RMSNorm(h) * norm) @ lm_head^T   # lm_head = embed_tokens if tied

Usage:
  llama_reference.py --model DIR --tokens "1,2,3;4,5" --out FILE
      Writes logits for every position of every ';'-separated sequence.
  llama_reference.py --model DIR --tokens "1,2,3" --greedy N
      Appends N argmax tokens (ties -> lowest id) one at a time, re-running the
      full forward each step, and prints them comma-separated on stdout.

Output file format (--out), little-endian, sequences in input order:
  for each sequence:
    int32   n_positions           (= the sequence's token count)
    int32   vocab                 (= config vocab_size)
    float32 logits[n_positions * vocab]   row-major [position][token id];
                                          row p is the next-token logits after
                                          tokens[0..p]
(float64 results are rounded to float32 only when written.)

Exit status 0 on success; 1 with a message on stderr for any error (bad
config, malformed safetensors, token out of range, ...).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np


class ReferenceError(Exception):
    pass


# ----------------------------------------------------------------------------
# config.json


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM",
                           "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM")


class Config:
    def __init__(self, raw):
        archs = raw.get("architectures") or []
        found = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not found:
            raise ReferenceError("unsupported architectures %r" % (archs,))
        self.architecture = found[0]
        self.hidden_size = int(raw["hidden_size"])
        self.intermediate_size = int(raw["intermediate_size"])
        self.num_layers = int(raw["num_hidden_layers"])
        self.num_heads = int(raw["num_attention_heads"])
        kv = raw.get("num_key_value_heads")
        self.num_kv_heads = int(kv) if kv is not None else self.num_heads
        hd = raw.get("head_dim")
        self.head_dim = (int(hd) if hd is not None else
                         self.hidden_size // self.num_heads)
        self.rms_norm_eps = float(raw["rms_norm_eps"])
        theta = raw.get("rope_theta")
        self.rope_scaling = raw.get("rope_scaling")
        # transformers 5 moves the RoPE base and scaling into
        # "rope_parameters" (the old fields may be absent or null).
        params = raw.get("rope_parameters")
        if params is not None:
            if params.get("rope_theta") is not None:
                theta = params["rope_theta"]
            self.rope_scaling = params
        self.rope_theta = float(theta) if theta is not None else 10000.0
        # Phi-4-mini: RoPE on int(head_dim * partial_rotary_factor) values
        # of each head (transformers' rope init reads it for every model).
        self.rotary_dim = int(self.head_dim *
                              float(raw.get("partial_rotary_factor") or 1.0))
        # Phi-3's original context for longrope, at the config's top level.
        self.original_max_position_embeddings = raw.get(
            "original_max_position_embeddings")
        self.vocab_size = int(raw["vocab_size"])
        self.max_position_embeddings = int(raw["max_position_embeddings"])
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        # Gemma2 (transformers' Gemma2ForCausalLM): embeddings times
        # sqrt(hidden), x * (1 + w) norms, four per layer, GeGLU (tanh gelu),
        # softmax scale query_pre_attn_scalar^-1/2, attention and final
        # logits soft-capped, even layers windowed; Gemma2Config's defaults
        # where a key is absent.
        # Gemma3 (Gemma3ForCausalLM): Gemma 2's layer, no caps by default,
        # (1 + w) q/k norms, sliding layers by layer_types or
        # sliding_window_pattern, their RoPE base rope_local_base_freq.
        self.gemma3 = self.architecture == "Gemma3ForCausalLM"
        self.gemma2 = self.architecture == "Gemma2ForCausalLM" or self.gemma3
        act = raw.get("hidden_activation", raw.get("hidden_act", "silu"))
        if act != ("gelu_pytorch_tanh" if self.gemma2 else "silu"):
            raise ReferenceError("unsupported hidden_act %r" % (act,))
        if self.gemma2:
            if hd is None:
                self.head_dim = 256
            self.query_pre_attn_scalar = float(
                raw.get("query_pre_attn_scalar", 256))
            cap = None if self.gemma3 else 50.0
            self.attn_softcap = raw.get("attn_logit_softcapping", cap)
            cap = None if self.gemma3 else 30.0
            self.final_softcap = raw.get("final_logit_softcapping", cap)
            self.local_rope_theta = (float(raw.get("rope_local_base_freq",
                                                   10000.0))
                                     if self.gemma3 else None)
            self.sliding_window = raw.get("sliding_window", 4096)
            self.tie_word_embeddings = bool(raw.get("tie_word_embeddings",
                                                    True))
        # Qwen3Attention: q_norm / k_norm (Qwen3RMSNorm(head_dim)) per head;
        # Gemma3Attention likewise with Gemma3RMSNorm (1 + w).
        self.qk_norm = self.architecture in ("Qwen3ForCausalLM",
                                             "Gemma3ForCausalLM")
        # Phi3Attention: one qkv_proj, sliced q | k | v; Phi3MLP: one
        # gate_up_proj, chunked gate | up; no biases.
        self.fused = self.architecture == "Phi3ForCausalLM"
        if self.architecture in ("Qwen2ForCausalLM",):
            # Qwen2Attention: q/k/v always biased, o never.
            self.qkv_bias, self.o_bias = True, False
        elif self.architecture in ("MistralForCausalLM", "Phi3ForCausalLM",
                                   "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            self.qkv_bias, self.o_bias = False, False
        else:
            # LlamaAttention and Qwen3Attention: bias=config.attention_bias
            # on q, k, v and o.
            bias = bool(raw.get("attention_bias", False))
            self.qkv_bias, self.o_bias = bias, bias
        if self.num_heads % self.num_kv_heads != 0:
            raise ReferenceError("num_attention_heads % num_key_value_heads")
        # Sliding windows, per layer, as transformers decides them.
        layers = range(self.num_layers)
        window = None
        slides = [False] * self.num_layers
        if self.architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
            window = raw.get("sliding_window")
            slides = [True] * self.num_layers
        elif self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if raw.get("use_sliding_window", False):
                window = raw.get("sliding_window")
                first = raw.get("max_window_layers", 28)
                slides = [i >= first for i in layers]
        elif self.gemma3:
            window = self.sliding_window
            pattern = raw.get("sliding_window_pattern", 6)
            slides = [(i + 1) % pattern != 0 for i in layers]
        elif self.gemma2:
            window = self.sliding_window
            slides = [i % 2 == 0 for i in layers]
        if raw.get("layer_types") is not None:
            slides = [t == "sliding_attention" for t in raw["layer_types"]]
        self.window = int(window) if window else None
        self.sliding_layers = slides if self.window else [False] * len(slides)


# transformers' Gemma3TextConfig defaults, for a Gemma3ForConditionalGeneration
# checkpoint's text_config (which leaves most keys out).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
}


def load_config(model_dir):
    """(Config, tensor name prefix)."""
    with open(os.path.join(model_dir, "config.json"), "r") as f:
        raw = json.load(f)
    if "Gemma3ForConditionalGeneration" in (raw.get("architectures") or []):
        # The text model of a multimodal checkpoint: its keys under
        # text_config, its tensors under language_model.
        text = dict(GEMMA3_TEXT_DEFAULTS)
        text.update(raw["text_config"])
        for key in ("eos_token_id", "bos_token_id", "pad_token_id",
                    "torch_dtype", "tie_word_embeddings"):
            if key not in text and key in raw:
                text[key] = raw[key]
        text["architectures"] = ["Gemma3ForCausalLM"]
        return Config(text), "language_model."
    return Config(raw), ""


# ----------------------------------------------------------------------------
# safetensors: [u64 LE header length][JSON header][data]


def _bf16_to_float64(raw):
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


_DECODERS = {
    "F32": (4, lambda raw: np.frombuffer(raw, dtype="<f4").astype(np.float64)),
    "F16": (2, lambda raw: np.frombuffer(raw, dtype="<f2").astype(np.float64)),
    "BF16": (2, _bf16_to_float64),
}


def read_safetensors(path):
    """Returns {name: float64 ndarray} for every tensor in the file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ReferenceError("%s: shorter than 8 bytes" % path)
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise ReferenceError("%s: header length past end of file" % path)
    header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    data = blob[8 + header_len:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry["dtype"]
        if dtype not in _DECODERS:
            raise ReferenceError("%s: %s has unsupported dtype %s" %
                                 (path, name, dtype))
        size, decode = _DECODERS[dtype]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= begin <= end <= len(data) or end - begin != numel * size:
            raise ReferenceError("%s: %s has bad data_offsets" % (path, name))
        tensors[name] = decode(data[begin:end]).reshape(shape)
    return tensors


def load_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        raise ReferenceError("%s: no model.safetensors or index" % model_dir)
    with open(index_path, "r") as f:
        weight_map = json.load(f)["weight_map"]
    shards = {}
    weights = {}
    for name, shard in sorted(weight_map.items()):
        if shard not in shards:
            shards[shard] = read_safetensors(os.path.join(model_dir, shard))
        if name not in shards[shard]:
            raise ReferenceError("%s: %s not in %s" % (model_dir, name, shard))
        weights[name] = shards[shard][name]
    return weights


# ----------------------------------------------------------------------------
# The model


def yarn_inv_freq(cfg, scaling, inv_freq):
    """transformers' _compute_yarn_parameters: (inv_freq, attention_factor).

    The explicit "factor" (what vLLM and transformers 5 use); the original
    context from "original_max_position_embeddings", else the config's.
    """
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings")
    original = float(original if original is not None else
                     cfg.max_position_embeddings)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = (get_mscale(factor, mscale) /
                                get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi)) /
                (2 * math.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) /
                   (high - low), 0.0, 1.0)
    extrapolation_factor = 1.0 - ramp
    interpolation = inv_freq / factor
    return (interpolation * (1 - extrapolation_factor) +
            inv_freq * extrapolation_factor), float(attention_factor)


def longrope_inv_freq(cfg, scaling, inv_freq, max_model_len):
    """transformers' _compute_longrope_parameters: (inv_freq,
    attention_factor). The list: transformers takes long_factor for a
    forward over more than the original context, short_factor otherwise;
    vLLM (and pdworker) fix it once from max_model_len, so that cached K/V
    keep their meaning. This follows vLLM's rule with `max_model_len`; the
    two agree for every sequence longer than the original context."""
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        original = cfg.original_max_position_embeddings
    if original is not None:
        original = float(original)
        factor = cfg.max_position_embeddings / original
    else:
        original = float(cfg.max_position_embeddings)
        factor = float(scaling.get("factor") or 1.0)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1.0 + math.log(factor) /
                                      math.log(original)))
    key = "long_factor" if max_model_len > original else "short_factor"
    ext = np.asarray(scaling[key], dtype=np.float64)
    if ext.shape != inv_freq.shape:
        raise ReferenceError("%s has %d entries, expected %d" %
                             (key, ext.size, inv_freq.size))
    return inv_freq / ext, float(attention_factor)


def rope_inv_freq(cfg, max_model_len=None):
    """(inv_freq, attention_factor): inv_freq[i] for the pairs
    (i, i + rotary_dim/2), shape [rotary_dim/2]; cos and sin are multiplied
    by attention_factor (1 but for yarn and longrope), as transformers does.
    max_model_len (default max_position_embeddings, as the worker's
    default) picks longrope's list."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2,
                                                   dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "dynamic":
        # transformers raises the base only past max_position_embeddings,
        # which no sequence here reaches.
        return inv_freq, 1.0
    if kind in ("longrope", "su"):
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        return longrope_inv_freq(cfg, scaling, inv_freq, max_model_len)
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return yarn_inv_freq(cfg, scaling, inv_freq)
    if kind != "llama3":
        raise ReferenceError("unsupported rope_scaling type %r" % (kind,))
    # Llama 3.1: keep high frequencies (short wavelengths), divide low ones by
    # `factor`, interpolate smoothly in between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    out = np.empty_like(inv_freq)
    for i, freq in enumerate(inv_freq):
        wavelen = 2.0 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out[i] = freq
        elif wavelen > low_freq_wavelen:
            out[i] = freq / factor
        else:
            smooth = ((old_context / wavelen - low_freq_factor) /
                      (high_freq_factor - low_freq_factor))
            out[i] = (1.0 - smooth) * freq / factor + smooth * freq
    return out, 1.0


def rms_norm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def apply_rope(x, cos, sin):
    """x: [n, heads, head_dim]; cos/sin: [n, rotary_dim]. HF rotate_half
    on the first rotary_dim values; the rest pass (apply_rotary_pos_emb's
    partial rotary)."""
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = np.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return np.concatenate(
        [x_rot * cos[:, None, :] + rotated * sin[:, None, :], x_pass], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    """torch.nn.functional.gelu(x, approximate="tanh")."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) *
                                    (x + 0.044715 * x ** 3)))


def softcap(x, cap):
    return x if not cap else np.tanh(x / cap) * cap


class Model:
    def __init__(self, model_dir):
        self.cfg, self.prefix = load_config(model_dir)
        self.w = load_weights(model_dir)
        cfg = self.cfg
        self.embed = self._get("model.embed_tokens.weight",
                               (cfg.vocab_size, cfg.hidden_size))
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = self._get("lm_head.weight",
                                     (cfg.vocab_size, cfg.hidden_size))
        self.final_norm = self._get("model.norm.weight", (cfg.hidden_size,))
        self.inv_freq, self.attention_factor = rope_inv_freq(cfg)

    def _get(self, name, shape):
        name = self.prefix + name
        if name not in self.w:
            raise ReferenceError("missing tensor %s" % name)
        t = self.w[name]
        if tuple(t.shape) != tuple(shape):
            raise ReferenceError("%s has shape %s, expected %s" %
                                 (name, t.shape, shape))
        return t

    def _linear(self, x, prefix, out_features, in_features, bias):
        y = x @ self._get(prefix + ".weight", (out_features, in_features)).T
        if bias:
            y = y + self._get(prefix + ".bias", (out_features,))
        return y

    def logits(self, tokens):
        """tokens: list of ints -> float64 logits [n, vocab]."""
        cfg = self.cfg
        n = len(tokens)
        for t in tokens:
            if not 0 <= t < cfg.vocab_size:
                raise ReferenceError("token %d outside vocab %d" %
                                     (t, cfg.vocab_size))
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden = cfg.hidden_size
        positions = np.arange(n, dtype=np.float64)
        freqs = np.outer(positions, self.inv_freq)          # [n, D/2]
        emb = np.concatenate([freqs, freqs], axis=-1)       # [n, D]
        cos = np.cos(emb) * self.attention_factor
        sin = np.sin(emb) * self.attention_factor
        if cfg.gemma2 and cfg.local_rope_theta is not None:
            # Gemma 3's sliding layers: plain RoPE on their own base.
            R = cfg.rotary_dim
            local = 1.0 / (cfg.local_rope_theta ** (
                np.arange(0, R, 2, dtype=np.float64) / R))
            local_emb = np.concatenate([np.outer(positions, local)] * 2,
                                       axis=-1)
            local_cos, local_sin = np.cos(local_emb), np.sin(local_emb)
        causal = np.triu(np.full((n, n), -np.inf), k=1)     # [q, k]
        group = H // KVH
        gemma = cfg.gemma2

        def norm(x, name):
            # Gemma2RMSNorm scales by (1 + w).
            w = self._get(name, (hidden,))
            return rms_norm(x, 1.0 + w if gemma else w, cfg.rms_norm_eps)

        h = self.embed[np.asarray(tokens, dtype=np.int64)]  # [n, hidden]
        if gemma:
            h = h * math.sqrt(hidden)
        for layer in range(cfg.num_layers):
            p = "model.layers.%d." % layer
            x = norm(h, p + "input_layernorm.weight")
            if cfg.fused:
                qkv = self._linear(x, p + "self_attn.qkv_proj",
                                   (H + 2 * KVH) * D, hidden, False)
                q = qkv[:, :H * D].reshape(n, H, D)
                k = qkv[:, H * D:(H + KVH) * D].reshape(n, KVH, D)
                v = qkv[:, (H + KVH) * D:].reshape(n, KVH, D)
            else:
                q = self._linear(x, p + "self_attn.q_proj", H * D, hidden,
                                 cfg.qkv_bias).reshape(n, H, D)
                k = self._linear(x, p + "self_attn.k_proj", KVH * D, hidden,
                                 cfg.qkv_bias).reshape(n, KVH, D)
                v = self._linear(x, p + "self_attn.v_proj", KVH * D, hidden,
                                 cfg.qkv_bias).reshape(n, KVH, D)
            if cfg.qk_norm:
                qw = self._get(p + "self_attn.q_norm.weight", (D,))
                kw = self._get(p + "self_attn.k_norm.weight", (D,))
                if gemma:
                    qw, kw = 1.0 + qw, 1.0 + kw
                q = rms_norm(q, qw, cfg.rms_norm_eps)
                k = rms_norm(k, kw, cfg.rms_norm_eps)
            if (gemma and cfg.local_rope_theta is not None and
                    cfg.sliding_layers[layer]):
                q = apply_rope(q, local_cos, local_sin)
                k = apply_rope(k, local_cos, local_sin)
            else:
                q = apply_rope(q, cos, sin)
                k = apply_rope(k, cos, sin)
            mask = causal
            scale = 1.0 / math.sqrt(D)
            if gemma:
                scale = cfg.query_pre_attn_scalar ** -0.5
            if cfg.sliding_layers[layer]:
                # Key j is visible to query i when i - j < window.
                mask = causal + np.tril(np.full((n, n), -np.inf),
                                        k=-cfg.window)
            attn = np.empty((n, H, D))
            for head in range(H):
                kv = head // group
                scores = (q[:, head, :] @ k[:, kv, :].T) * scale
                if gemma:
                    scores = softcap(scores, cfg.attn_softcap)
                scores = scores + mask
                scores = scores - scores.max(axis=-1, keepdims=True)
                probs = np.exp(scores)
                probs /= probs.sum(axis=-1, keepdims=True)
                attn[:, head, :] = probs @ v[:, kv, :]
            out = self._linear(attn.reshape(n, H * D), p + "self_attn.o_proj",
                               hidden, H * D, cfg.o_bias)
            if gemma:
                out = norm(out, p + "post_attention_layernorm.weight")
                x = norm(h + out, p + "pre_feedforward_layernorm.weight")
            else:
                x = norm(h + out, p + "post_attention_layernorm.weight")
            h = h + out
            inter = cfg.intermediate_size
            if cfg.fused:
                gate_up = self._linear(x, p + "mlp.gate_up_proj", 2 * inter,
                                       hidden, False)
                gate, up = gate_up[:, :inter], gate_up[:, inter:]
            else:
                gate = self._linear(x, p + "mlp.gate_proj", inter, hidden,
                                    False)
                up = self._linear(x, p + "mlp.up_proj", inter, hidden, False)
            act = gelu_tanh(gate) if gemma else silu(gate)
            out = self._linear(act * up, p + "mlp.down_proj", hidden, inter,
                               False)
            if gemma:
                out = norm(out, p + "post_feedforward_layernorm.weight")
            h = h + out
        h = rms_norm(h, 1.0 + self.final_norm if gemma else self.final_norm,
                     cfg.rms_norm_eps)
        logits = h @ self.lm_head.T
        return softcap(logits, cfg.final_softcap) if gemma else logits


# ----------------------------------------------------------------------------
# CLI


def parse_sequences(text):
    sequences = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            raise ReferenceError("empty sequence in --tokens %r" % text)
        sequences.append([int(t) for t in part.split(",")])
    return sequences


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--tokens", required=True,
                        help='sequences: "1,2,3;4,5"')
    parser.add_argument("--out", help="logits output file (see format)")
    parser.add_argument("--greedy", type=int,
                        help="append this many argmax tokens to the single "
                             "sequence and print them")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.greedy is None):
        parser.error("give exactly one of --out and --greedy")
    try:
        model = Model(args.model)
        sequences = parse_sequences(args.tokens)
        if args.greedy is not None:
            if len(sequences) != 1:
                raise ReferenceError("--greedy takes exactly one sequence")
            tokens = list(sequences[0])
            generated = []
            for _ in range(args.greedy):
                nxt = int(np.argmax(model.logits(tokens)[-1]))
                generated.append(nxt)
                tokens.append(nxt)
            print(",".join(str(t) for t in generated))
            return 0
        with open(args.out, "wb") as f:
            for seq in sequences:
                logits = model.logits(seq).astype("<f4")
                f.write(struct.pack("<ii", logits.shape[0], logits.shape[1]))
                f.write(logits.tobytes())
        return 0
    except (ReferenceError, KeyError, ValueError, OSError) as e:
        print("llama_reference: error: %s: %s" % (type(e).__name__, e),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
