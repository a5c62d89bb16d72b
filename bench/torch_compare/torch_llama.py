"""A gpt-fast-style Llama in plain PyTorch, for the PyTorch side of issue 10.

Why our own model and not transformers' LlamaForCausalLM: the benchmark needs
the decode step as one static-shape function over a static KV cache (what
gpt-fast and vLLM capture in a CUDA graph or hand to torch.compile), while
transformers' model grows a DynamicCache by concatenation. The *numerics*
follow transformers' Llama exactly, so on identical weights the two agree to
rounding (selftest.py checks this against tests/reference/llama_reference.py
in fp32 on the CPU):

  RMSNorm   x.float(); x * rsqrt(mean(x^2) + eps); cast back; weight * x
            (the multiply happens in the model dtype, as HF does)
  RoPE      inv_freq in fp32 (llama3 scaling as HF's
            _compute_llama3_parameters), cos/sin of pos * inv_freq in fp32,
            cast to the model dtype; q * cos + rotate_half(q) * sin
  attention GQA (query head h reads KV head h // (H / KVH)), scale
            head_dim^-0.5; softmax in fp32 (SDPA on CUDA, explicit math on
            the CPU and on torch < 2.0, which lacks SDPA)
  MLP       down(silu(gate(x)) * up(x))
  residual  in the model dtype; logits = lm_head(norm(h)) (tied: embedding)

Layout: q/k/v and gate/up are concatenated into one matrix each (wqkv, w13),
as gpt-fast does for speed; each output element is still one dot product.
KV cache: per layer [B_max, KVH, S_max, D] (gpt-fast layout), written at
(row, position) and read in full with a mask `key position <= position`.

Loading needs only torch and numpy-free stdlib: config.json in either the
transformers < 5 layout (rope_theta, rope_scaling) or the 5.x layout
(rope_parameters), and *.safetensors through the small reader below, so the
module runs where neither transformers nor safetensors is installed.
"""

import json
import math
import os
import struct

import torch
import torch.nn.functional as F
from torch import nn


class ModelError(Exception):
    """A checkpoint this module cannot load, with the reason."""


# ----------------------------------------------------------------------------
# config.json


class Args:
    """The shape of a checkpoint, read from its config.json."""

    def __init__(self, raw):
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        known = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
        if not any(a in known for a in archs):
            raise ModelError("unsupported architectures %r" % (archs,))
        if raw.get("mlp_bias"):
            raise ModelError("mlp_bias=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError("hidden_act %r is not silu" % raw["hidden_act"])
        self.hidden = int(raw["hidden_size"])
        self.intermediate = int(raw["intermediate_size"])
        self.layers = int(raw["num_hidden_layers"])
        self.heads = int(raw["num_attention_heads"])
        kv = raw.get("num_key_value_heads")
        self.kv_heads = int(kv) if kv is not None else self.heads
        hd = raw.get("head_dim")
        self.head_dim = int(hd) if hd is not None else self.hidden // self.heads
        self.vocab = int(raw["vocab_size"])
        self.eps = float(raw["rms_norm_eps"])
        self.tied = bool(raw.get("tie_word_embeddings", False))
        self.rope_theta, self.rope_scaling = read_rope(raw)
        if self.heads % self.kv_heads:
            raise ModelError("num_attention_heads % num_key_value_heads != 0")

    @property
    def q_size(self):
        return self.heads * self.head_dim

    @property
    def kv_size(self):
        return self.kv_heads * self.head_dim


def _same_scaling(a, b):
    keys = ("factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")
    return (_rope_type(a) == _rope_type(b) and
            all(float(a.get(k, 0)) == float(b.get(k, 0)) for k in keys))


def _rope_type(scaling):
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def read_rope(raw):
    """(theta, scaling dict or None) from either config.json layout.

    transformers < 5 writes top-level rope_theta / rope_scaling; 5.x writes
    rope_parameters = {rope_type, rope_theta, factor, ...} and may drop or
    null the old fields. Reading only one layout would silently fall back to
    theta 10000, so both are read and a disagreement is an error (the same
    rule as pdworker's worker/model/model_config.cc).
    """
    legacy_theta = raw.get("rope_theta")
    legacy_scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if params is None:
        theta = float(legacy_theta) if legacy_theta is not None else 10000.0
        return theta, _checked_scaling(legacy_scaling)
    if not isinstance(params, dict) or any(
            isinstance(v, dict) for v in params.values()):
        raise ModelError("rope_parameters must be one flat object")
    scaling = _checked_scaling(params)
    if legacy_scaling is not None and not _same_scaling(
            legacy_scaling, params):
        raise ModelError("rope_scaling disagrees with rope_parameters")
    theta = params.get("rope_theta", legacy_theta)
    if (legacy_theta is not None and theta is not None and
            float(theta) != float(legacy_theta)):
        raise ModelError("rope_theta disagrees with rope_parameters")
    return (float(theta) if theta is not None else 10000.0), scaling


def _checked_scaling(scaling):
    """None for default RoPE, the dict for llama3, an error otherwise."""
    kind = _rope_type(scaling)
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelError("unsupported rope type %r" % (kind,))
    return dict(scaling)


def load_args(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return Args(json.load(f))


# ----------------------------------------------------------------------------
# safetensors: [u64 little-endian header length][JSON header][data]

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    """{name: CPU tensor} for every tensor in one .safetensors file.

    Each tensor's bytes are read into its own bytearray and wrapped with
    torch.frombuffer (no copy), so peak host memory is about the file size.
    """
    out = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len).decode("utf-8"))
        base = 8 + header_len
        for name, entry in sorted(header.items(),
                                  key=lambda kv: _offset(kv[1])):
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ModelError("%s: %s has unsupported dtype %s" %
                                 (path, name, entry["dtype"]))
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
            numel = math.prod(shape) if shape else 1
            if end - begin != numel * torch.tensor([], dtype=dtype
                                                   ).element_size():
                raise ModelError("%s: %s has bad data_offsets" % (path, name))
            f.seek(base + begin)
            buf = bytearray(end - begin)
            if f.readinto(buf) != len(buf):
                raise ModelError("%s: %s runs past end of file" % (path, name))
            t = (torch.frombuffer(buf, dtype=dtype) if buf else
                 torch.empty(0, dtype=dtype))
            out[name] = t.reshape(shape)
    return out


def _offset(entry):
    return entry["data_offsets"][0] if isinstance(entry, dict) and \
        "data_offsets" in entry else -1


def load_weights(model_dir):
    """{HF tensor name: CPU tensor} from model.safetensors or its index."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise ModelError("%s: no model.safetensors or index" % model_dir)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    weights = {}
    for shard in sorted(set(weight_map.values())):
        weights.update(read_safetensors(os.path.join(model_dir, shard)))
    missing = [n for n in weight_map if n not in weights]
    if missing:
        raise ModelError("tensors missing from shards: %s" % missing[:5])
    return weights


# ----------------------------------------------------------------------------
# RoPE


def rope_inv_freq(args):
    """inv_freq [head_dim / 2] in fp32, as transformers computes it.

    Default: 1 / theta^(2i / D) with the exponent in fp32. llama3 (Llama 3.1
    / 3.2): wavelengths shorter than original/high_freq_factor are kept,
    longer than original/low_freq_factor divided by `factor`, and the ones in
    between interpolated (transformers' _compute_llama3_parameters).
    """
    dim = args.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (args.rope_theta ** exponent)  # [D/2] fp32
    s = args.rope_scaling
    if s is None:
        return inv_freq
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor,
                         inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args, max_len, dtype, device):
    """cos, sin [max_len, head_dim] in `dtype` (fp32 math, then cast)."""
    inv_freq = rope_inv_freq(args)
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # [S, D/2] fp32, pos * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """x [..., heads, D]; cos/sin broadcastable [..., 1, D]."""
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------
# The model


def rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: fp32 statistics, cast back, then weight * x."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention")


def math_attention(q, k, v, mask):
    """q [B, KVH, M, D], k/v [B, KVH, N, D], mask bool [B or 1, 1, M, N].

    HF's eager attention: scores in the model dtype, softmax in fp32, cast
    back before multiplying by V.
    """
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Layer(nn.Module):
    """One decoder layer's weights and its KV cache."""

    def __init__(self, w, prefix, args, dtype, device):
        super().__init__()

        def get(name, shape):
            t = w.get(prefix + name)
            if t is None:
                raise ModelError("missing tensor %s%s" % (prefix, name))
            if tuple(t.shape) != tuple(shape):
                raise ModelError("%s%s has shape %s, expected %s" %
                                 (prefix, name, tuple(t.shape), shape))
            return t

        def param(t):
            return nn.Parameter(t.to(device=device, dtype=dtype),
                                requires_grad=False)

        h, q, kv, inter = args.hidden, args.q_size, args.kv_size, \
            args.intermediate
        a = "self_attn."
        self.wqkv = param(torch.cat([get(a + "q_proj.weight", (q, h)),
                                     get(a + "k_proj.weight", (kv, h)),
                                     get(a + "v_proj.weight", (kv, h))]))
        bias = [prefix + a + p + "_proj.bias" for p in "qkv"]
        if all(b in w for b in bias):  # Qwen2, or Llama attention_bias
            self.bqkv = param(torch.cat([w[b] for b in bias]))
        else:
            self.bqkv = None
        self.wo = param(get(a + "o_proj.weight", (h, q)))
        ob = w.get(prefix + a + "o_proj.bias")
        self.bo = param(ob) if ob is not None else None
        self.w13 = param(torch.cat([get("mlp.gate_proj.weight", (inter, h)),
                                    get("mlp.up_proj.weight", (inter, h))]))
        self.w2 = param(get("mlp.down_proj.weight", (h, inter)))
        self.attn_norm = param(get("input_layernorm.weight", (h,)))
        self.ffn_norm = param(get("post_attention_layernorm.weight", (h,)))
        # Allocated by TorchLlama.setup_cache; None until then.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)


class TorchLlama(nn.Module):
    """Llama forward with a static KV cache: prefill() and decode_step().

    Both are static-shape for a given batch size (and prompt length), with
    no host synchronisation, so they can be captured in a CUDA graph or
    compiled with torch.compile(mode="reduce-overhead").
    """

    def __init__(self, args, weights, dtype=torch.bfloat16, device="cpu",
                 attention="auto"):
        super().__init__()
        self.args = args
        self.dtype = dtype
        self.device = torch.device(device)
        # "sdpa": F.scaled_dot_product_attention (CUDA default); "math":
        # explicit fp32-softmax attention (CPU default, and torch < 2.0).
        if attention == "auto":
            attention = ("sdpa" if has_sdpa() and self.device.type == "cuda"
                         else "math")
        if attention == "sdpa" and not has_sdpa():
            raise ModelError("this torch has no scaled_dot_product_attention")
        self.attention = attention
        h = args.hidden
        embed = weights.get("model.embed_tokens.weight")
        if embed is None or tuple(embed.shape) != (args.vocab, h):
            raise ModelError("model.embed_tokens.weight missing or misshapen")
        self.embed = nn.Parameter(embed.to(device=device, dtype=dtype),
                                  requires_grad=False)
        if args.tied:
            self.lm_head = self.embed  # one tensor, read once per step
        else:
            head = weights.get("lm_head.weight")
            if head is None or tuple(head.shape) != (args.vocab, h):
                raise ModelError("lm_head.weight missing or misshapen")
            self.lm_head = nn.Parameter(head.to(device=device, dtype=dtype),
                                        requires_grad=False)
        norm = weights.get("model.norm.weight")
        if norm is None or tuple(norm.shape) != (h,):
            raise ModelError("model.norm.weight missing or misshapen")
        self.norm = nn.Parameter(norm.to(device=device, dtype=dtype),
                                 requires_grad=False)
        self.layers = nn.ModuleList(
            Layer(weights, "model.layers.%d." % i, args, dtype, device)
            for i in range(args.layers))
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.max_batch = 0
        self.max_len = 0

    # -- cache -------------------------------------------------------------

    def setup_cache(self, max_batch, max_len):
        """Allocates the static KV cache and the RoPE tables.

        Per layer K and V of [max_batch, KVH, max_len, D] in the model dtype
        (zeros), registered as buffers so torch.compile treats them as
        static addresses, plus cos/sin [max_len, D].
        """
        a = self.args
        shape = (max_batch, a.kv_heads, max_len, a.head_dim)
        for layer in self.layers:
            layer.k_cache = None  # free the old cache before allocating
            layer.v_cache = None
            layer.k_cache = torch.zeros(shape, dtype=self.dtype,
                                        device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype,
                                        device=self.device)
        self.cos, self.sin = rope_tables(a, max_len, self.dtype, self.device)
        self.max_batch, self.max_len = max_batch, max_len

    def static_tensors(self):
        """Tensors mutated or read in place across calls (for compile)."""
        out = [self.cos, self.sin]
        for layer in self.layers:
            out += [layer.k_cache, layer.v_cache]
        return out

    # -- pieces ----------------------------------------------------------------

    def _qkv(self, layer, x):
        """x [..., hidden] -> q [..., H, D], k, v [..., KVH, D]."""
        a = self.args
        qkv = F.linear(x, layer.wqkv, layer.bqkv)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        lead = x.shape[:-1]
        return (q.reshape(*lead, a.heads, a.head_dim),
                k.reshape(*lead, a.kv_heads, a.head_dim),
                v.reshape(*lead, a.kv_heads, a.head_dim))

    def _mlp(self, layer, x):
        gate, up = F.linear(x, layer.w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.w2)

    def _attend(self, q, k, v, mask=None, causal=False):
        """q [B, KVH, M, D], k/v [B, KVH, N, D] -> [B, KVH, M, D]."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  is_causal=causal)
        if causal:
            m, n = q.shape[-2], k.shape[-2]
            mask = torch.ones(m, n, dtype=torch.bool,
                              device=q.device).tril()[None, None]
        return math_attention(q, k, v, mask)

    def _logits(self, h):
        return F.linear(rms_norm(h, self.norm, self.args.eps), self.lm_head)

    # -- forward -------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens, all_logits=False):
        """tokens [B, T] (int64, on the device), positions 0..T-1 of rows
        0..B-1; fills the cache and returns logits [B, V] of the last
        position (what serving samples from), or [B, T, V] if all_logits.
        """
        a = self.args
        b, t = tokens.shape
        group = a.heads // a.kv_heads
        h = F.embedding(tokens, self.embed)  # [B, T, hidden]
        cos = self.cos[:t][None, :, None, :]  # [1, T, 1, D]
        sin = self.sin[:t][None, :, None, :]
        for layer in self.layers:
            x = rms_norm(h, layer.attn_norm, a.eps)
            q, k, v = self._qkv(layer, x)  # [B, T, heads, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KVH, T, D]
            layer.k_cache[:b, :, :t] = k
            layer.v_cache[:b, :, :t] = v
            # GQA for a long query: expand K/V to H heads (cheap next to the
            # prefill's matmuls) and run causal attention per query head.
            q = q.transpose(1, 2)  # [B, H, T, D]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            o = self._attend(q, k, v, causal=True)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(b, t, a.q_size)
            h = h + F.linear(o, layer.wo, layer.bo)
            h = h + self._mlp(layer, rms_norm(h, layer.ffn_norm, a.eps))
        if not all_logits:
            h = h[:, -1]
        return self._logits(h)

    @torch.no_grad()
    def decode_step(self, tokens, positions):
        """tokens [B], positions [B] (int64, on the device) -> logits [B, V].

        Row i feeds tokens[i] at positions[i] of cache row i and attends to
        cache positions 0..positions[i]. GQA without copying the cache: the
        H query heads are viewed as [KVH, group] so each KV head serves its
        `group` query heads as `group` query rows of one attention call.
        """
        a = self.args
        b = tokens.shape[0]
        group = a.heads // a.kv_heads
        rows = torch.arange(b, device=tokens.device)
        h = F.embedding(tokens, self.embed)  # [B, hidden]
        cos = self.cos[positions][:, None, :]  # [B, 1, D]
        sin = self.sin[positions][:, None, :]
        keys = torch.arange(self.max_len, device=tokens.device)
        mask = (keys[None, :] <= positions[:, None])[:, None, None, :]
        for layer in self.layers:
            x = rms_norm(h, layer.attn_norm, a.eps)
            q, k, v = self._qkv(layer, x)  # q [B, H, D], k/v [B, KVH, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            layer.k_cache[rows, :, positions] = k
            layer.v_cache[rows, :, positions] = v
            q = q.reshape(b, a.kv_heads, group, a.head_dim)
            o = self._attend(q, layer.k_cache[:b], layer.v_cache[:b], mask)
            h = h + F.linear(o.reshape(b, a.q_size), layer.wo, layer.bo)
            h = h + self._mlp(layer, rms_norm(h, layer.ffn_norm, a.eps))
        return self._logits(h)


def load(model_dir, dtype=torch.bfloat16, device="cpu", attention="auto"):
    """TorchLlama from a Hugging Face checkpoint directory (no cache yet)."""
    args = load_args(model_dir)
    weights = load_weights(model_dir)
    return TorchLlama(args, weights, dtype=dtype, device=device,
                      attention=attention)


def decode_weight_bytes(args, element_size=2):
    """Bytes a batch-1 decode step must read from memory for weights.

    Every linear weight and norm of every layer, the final norm, the LM head
    matrix, and one embedding row. With tied embeddings the matrix is read
    once, as the LM head. Same count as pdworker's LlamaDecodeWeightBytes.
    """
    h = args.hidden
    per_layer = (2 * h + (args.q_size + 2 * args.kv_size) * h +
                 h * args.q_size + 3 * args.intermediate * h)
    elements = per_layer * args.layers + h + args.vocab * h + h
    return elements * element_size


def kv_bytes_per_token(args, element_size=2):
    """K and V of one token over all layers, bytes."""
    return 2 * element_size * args.layers * args.kv_size


def _main():
    """Prints greedy tokens (and optionally logits) for a quick check:
    torch_llama.py DIR 1,2,3 [--steps N] [--dtype float32]."""
    import argparse
    p = argparse.ArgumentParser(description=_main.__doc__)
    p.add_argument("model")
    p.add_argument("tokens")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load(args.model, dtype=dtype, device=args.device)
    prompt = [int(t) for t in args.tokens.split(",")]
    model.setup_cache(1, len(prompt) + args.steps + 1)
    dev = model.device
    logits = model.prefill(torch.tensor([prompt], device=dev))
    out = []
    for i in range(args.steps):
        nxt = int(logits[0].float().argmax())
        out.append(nxt)
        logits = model.decode_step(torch.tensor([nxt], device=dev),
                                   torch.tensor([len(prompt) + i],
                                                device=dev))
    print(",".join(str(t) for t in out))


if __name__ == "__main__":
    _main()
