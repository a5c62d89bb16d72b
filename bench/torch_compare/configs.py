"""Model shapes for the PyTorch / transformers comparison (issue 10).

Each shape is a dict of LlamaConfig keyword arguments in a layout-neutral
form: the RoPE base and scaling are kept apart ("rope_theta", "rope_scaling")
and `hf_config_kwargs` turns them into whichever layout the installed
transformers expects, because transformers 5 moved both into one
"rope_parameters" dict and a config built with the wrong layout silently
falls back to theta 10000 (wrong positions, no error).

Shapes:
  llama_1b    Llama-3.2-1B dimensions (1.24e9 parameters, 2.5 GB in bf16).
  llama_0p5b  Qwen2.5-0.5B dimensions expressed as a Llama (no q/k/v bias,
              0.49e9 parameters), so both systems run the same Llama graph.
  tiny        CPU smoke tests: every code path (GQA, llama3 RoPE scaling in
              all three frequency regimes, untied LM head) in ~0.1 M params.
  tiny_tied   CPU smoke tests of the other paths: tied embeddings, 4:1 GQA,
              unscaled RoPE.

No torch or transformers import here: the module is read by scripts that run
where neither is installed.
"""

import copy

SHAPES = {
    "llama_1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama_0p5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        # head_dim 16 and theta 5e5 give RoPE wavelengths of ~6, ~32, ~170,
        # ... tokens; an original context of 64 with low/high factors 1/4
        # puts them in all three llama3 regimes (kept, smoothed, divided).
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # Like tiny, but with tied embeddings, 4:1 GQA and plain RoPE (the
    # llama_0p5b code path) for the self-test.
    "tiny_tied": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 384,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    },
}

# Fields every shape shares. bos/eos/pad are None so that neither
# transformers' generate() nor pdworker stops early or masks a token: the
# weights are random, any id may win the argmax, and an early stop or a
# suppressed EOS would make the two greedy paths incomparable.
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def shape(name):
    """The layout-neutral kwargs of a shape (a copy; KeyError if unknown)."""
    if name not in SHAPES:
        raise KeyError("unknown shape %r; known: %s" %
                       (name, ", ".join(sorted(SHAPES))))
    out = copy.deepcopy(COMMON)
    out.update(copy.deepcopy(SHAPES[name]))
    return out


def transformers_major_minor(version):
    """'5.17.0' -> (5, 17); '4.57.0.dev0' -> (4, 57)."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts)


def hf_config_kwargs(name, transformers_version):
    """LlamaConfig(**kwargs) for `name` in the installed transformers' layout.

    transformers >= 5: rope_parameters = {rope_type, rope_theta, [scaling]}.
    transformers < 5:  rope_theta and rope_scaling (None when unscaled).
    "architectures" is dropped: save_pretrained fills it from the class.
    """
    kwargs = shape(name)
    kwargs.pop("architectures")
    theta = kwargs.pop("rope_theta")
    scaling = kwargs.pop("rope_scaling")
    if transformers_major_minor(transformers_version) >= (5, 0):
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling is not None:
            params.update(scaling)
        kwargs["rope_parameters"] = params
    else:
        kwargs["rope_theta"] = theta
        kwargs["rope_scaling"] = scaling
    return kwargs


def config_json(name, layout="both", dtype="bfloat16"):
    """A config.json dict for `name` written without transformers (tests).

    layout: "legacy" (rope_theta/rope_scaling, transformers < 5), "v5"
    (rope_parameters only) or "both" (consistent copies of each, which
    transformers 5 and pdworker both accept and the numpy reference reads).
    """
    raw = shape(name)
    theta = raw.pop("rope_theta")
    scaling = raw.pop("rope_scaling")
    raw["model_type"] = "llama"
    raw["initializer_range"] = 0.02
    raw["use_cache"] = True
    if layout in ("legacy", "both"):
        raw["rope_theta"] = theta
        raw["rope_scaling"] = copy.deepcopy(scaling)
        raw["torch_dtype"] = dtype
    if layout in ("v5", "both"):
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling is not None:
            params.update(scaling)
        raw["rope_parameters"] = params
        raw["dtype"] = dtype
    if layout not in ("legacy", "v5", "both"):
        raise ValueError("layout must be legacy, v5 or both")
    return raw


def param_count(name):
    """Parameters of the shape (tied embeddings counted once)."""
    s = shape(name)
    h, inter = s["hidden_size"], s["intermediate_size"]
    d = s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embed = s["vocab_size"] * h
    head = 0 if s["tie_word_embeddings"] else embed
    return s["num_hidden_layers"] * per_layer + embed + head + h
