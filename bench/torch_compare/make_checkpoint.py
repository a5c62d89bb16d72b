#!/usr/bin/env python3
"""Writes a random-weight Llama checkpoint (bf16 safetensors) for issue 10.

  make_checkpoint.py --shape llama_1b --out /tmp/torch_compare/llama_1b

Default backend "transformers": LlamaForCausalLM(LlamaConfig(...)) in fp32,
weights re-initialised below, cast to bf16, model.save_pretrained(out) --
the checkpoint is exactly what transformers itself writes (config.json in
the installed version's layout, tensor names, tied-weight handling).
Backend "builtin" writes the same tensors (bit for bit: every tensor has its
own generator seeded from (seed, name)) plus a config.json with both RoPE
layouts, without transformers; the CPU self-test uses it.

Why not transformers' default init (normal std initializer_range=0.02,
norms = 1): with it a random model is a poor test subject.
  * logits: std = 0.02 * sqrt(hidden) = 0.6 (0.5B) .. 0.9 (1B); the top-2
    gap among ~150k near-Gaussian logits is ~std / sqrt(2 ln V) ~ 0.1, the
    size of bf16 rounding on the logits themselves, so most greedy steps are
    near ties and a greedy comparison proves little;
  * attention: q.k / sqrt(D) has std (0.02^2 * hidden) ~ 0.4 on the 0.5B
    shape, i.e. nearly uniform attention, so a RoPE or masking bug barely
    moves the output;
  * norms = 1 cannot catch a norm weight that is dropped or applied as
    (1 + w).
So (all normal with mean 0, fp32, then rounded to bf16):
  embedding / LM head   std = logit_std / sqrt(hidden)   (logit_std 4: the
                        logits spread like a trained model's, std ~4)
  q/k/v/o, gate/up/down std = gain / sqrt(fan_in)        (gain 1: unit-scale
                        activations, attention scores with std ~1, so
                        attention depends on position and content)
  RMSNorm weights       uniform in [0.5, 1.5)
The tolerance rules that use these checkpoints are in hf_compare.py.
"""

import argparse
import json
import os
import struct
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import configs  # noqa: E402

META = "torch_compare_meta.json"


# ----------------------------------------------------------------------------
# The initialisation (shared by both backends)


def tensor_seed(seed, name):
    """A per-tensor generator seed: the weights do not depend on the order
    in which a backend visits its tensors."""
    return (int(seed) * 1000003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_tensor(name, shape, hidden, seed, gain, logit_std):
    """fp32 CPU tensor for the HF tensor `name` of `shape` (see docstring)."""
    import torch
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    if name.endswith("norm.weight"):  # input/post_attention layernorm, norm
        return torch.rand(shape, generator=gen) + 0.5
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        std = logit_std / hidden ** 0.5
    elif len(shape) == 2:
        std = gain / shape[1] ** 0.5  # nn.Linear weight [out, in]
    else:
        raise ValueError("no init rule for %s %s" % (name, shape))
    return torch.randn(shape, generator=gen) * std


def hf_tensor_shapes(shape_name):
    """{HF tensor name: shape} of a shape (lm_head only when untied)."""
    s = configs.shape(shape_name)
    h, inter, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (s["vocab_size"], h),
           "model.norm.weight": (h,)}
    if not s["tie_word_embeddings"]:
        out["lm_head.weight"] = (s["vocab_size"], h)
    for i in range(s["num_hidden_layers"]):
        p = "model.layers.%d." % i
        out.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return out


# ----------------------------------------------------------------------------
# Builtin backend: a minimal safetensors writer


_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def tensor_bytes(t):
    """Raw little-endian bytes of a CPU tensor (bf16 via its int16 view)."""
    import torch
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def write_safetensors(path, tensors):
    """Writes {name: CPU tensor} as one safetensors file (names sorted)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        raw = tensor_bytes(t)
        dtype = _ST_DTYPE[str(t.dtype).replace("torch.", "")]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # spec: pad the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def build_builtin(shape_name, out_dir, seed, gain, logit_std, dtype,
                  layout="both"):
    """Writes config.json + model.safetensors without transformers."""
    import torch
    hidden = configs.shape(shape_name)["hidden_size"]
    tensors = {}
    for name, shp in hf_tensor_shapes(shape_name).items():
        t = init_tensor(name, shp, hidden, seed, gain, logit_std)
        tensors[name] = t.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(configs.config_json(shape_name, layout, dtype), f, indent=2)
    return sum(t.numel() for t in tensors.values())


# ----------------------------------------------------------------------------
# transformers backend


def build_transformers(shape_name, out_dir, seed, gain, logit_std, dtype,
                       init_device="auto"):
    """LlamaForCausalLM(LlamaConfig) -> re-init -> cast -> save_pretrained.

    The model is built on the GPU when there is one: transformers' own
    initialisation (overwritten right after) then costs a moment instead
    of ~20 s of CPU time for 1.2e9 parameters. Our values come from CPU
    generators either way, so the checkpoint does not depend on the device.
    """
    import inspect
    import torch
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit("make_checkpoint: transformers is not importable "
                         "(%s); use --backend builtin" % e)
    torch.manual_seed(seed)
    kwargs = configs.hf_config_kwargs(shape_name, transformers.__version__)
    config = LlamaConfig(**kwargs)
    if init_device == "auto":
        init_device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(init_device):
        model = LlamaForCausalLM(config)  # fp32 (torch's default dtype)
    hidden = config.hidden_size
    with torch.no_grad():
        # named_parameters() lists a tied LM head once, as the embedding.
        for name, p in model.named_parameters():
            p.copy_(init_tensor(name, tuple(p.shape), hidden, seed, gain,
                                logit_std).to(p.device))
    model = model.to(getattr(torch, dtype))
    n_params = sum(p.numel() for p in model.parameters())
    save_kwargs = {}
    if "safe_serialization" in inspect.signature(
            model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True
    model.save_pretrained(out_dir, **save_kwargs)
    return n_params, transformers.__version__


def verify(shape_name, out_dir):
    """Re-reads what was written with torch_llama's own reader: every tensor
    present with its shape, and config.json's RoPE equal to the shape's (a
    transformers version that wrote another layout would show up here)."""
    import torch_llama
    args = torch_llama.load_args(out_dir)
    want = configs.shape(shape_name)
    if args.rope_theta != want["rope_theta"]:
        raise SystemExit("config.json rope_theta %s != %s" %
                         (args.rope_theta, want["rope_theta"]))
    ws = want["rope_scaling"]
    if (args.rope_scaling is None) != (ws is None) or (
            ws is not None and not torch_llama._same_scaling(
                args.rope_scaling, ws)):
        raise SystemExit("config.json rope scaling %r != %r" %
                         (args.rope_scaling, ws))
    weights = torch_llama.load_weights(out_dir)
    for name, shp in hf_tensor_shapes(shape_name).items():
        if name not in weights or tuple(weights[name].shape) != tuple(shp):
            raise SystemExit("written checkpoint lacks %s %s" % (name, shp))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(configs.SHAPES))
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gain", type=float, default=1.0,
                   help="linear weights: std = gain / sqrt(fan_in)")
    p.add_argument("--logit_std", type=float, default=4.0,
                   help="embedding/LM head: std = logit_std / sqrt(hidden)")
    p.add_argument("--dtype", default="bfloat16",
                   choices=["bfloat16", "float32", "float16"])
    p.add_argument("--backend", default="transformers",
                   choices=["transformers", "builtin"])
    p.add_argument("--init_device", default="auto",
                   help="device transformers builds the model on "
                        "(auto: cuda if available)")
    p.add_argument("--reuse", action="store_true",
                   help="keep OUT if it was written with the same arguments")
    args = p.parse_args(argv)
    meta = {"shape": args.shape, "seed": args.seed, "gain": args.gain,
            "logit_std": args.logit_std, "dtype": args.dtype,
            "backend": args.backend}
    meta_path = os.path.join(args.out, META)
    if args.reuse and os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if {k: old.get(k) for k in meta} == meta:
            print("make_checkpoint: reusing %s (%s parameters)" %
                  (args.out, old.get("params")))
            return 0
    os.makedirs(args.out, exist_ok=True)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    if args.backend == "transformers":
        n, version = build_transformers(args.shape, args.out, args.seed,
                                        args.gain, args.logit_std, args.dtype,
                                        args.init_device)
        meta["transformers"] = version
    else:
        n = build_builtin(args.shape, args.out, args.seed, args.gain,
                          args.logit_std, args.dtype)
    verify(args.shape, args.out)
    if n != configs.param_count(args.shape):
        print("make_checkpoint: warning: %d parameters, configs.py expects %d"
              % (n, configs.param_count(args.shape)), file=sys.stderr)
    meta["params"] = n
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    print("make_checkpoint: %s -> %s: %d parameters (%.3f B), %s" %
          (args.shape, args.out, n, n / 1e9, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
