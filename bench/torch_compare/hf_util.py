"""Small helpers around transformers, imported lazily by the scripts.

Kept apart so torch_bench.py and hf_compare.py load models the same way, and
so that the version differences live in one place:
  * from_pretrained takes `dtype=` from transformers 4.56 on (and 5.x),
    `torch_dtype=` before;
  * forward() takes `logits_to_keep` from 4.50 on, `num_logits_to_keep`
    in 4.45-4.49, neither before (then all logits are computed).
"""

import inspect


class HFUnavailable(Exception):
    """transformers cannot be imported here; the message says why."""


def import_transformers():
    """The transformers module, or HFUnavailable with the import error."""
    try:
        import transformers
        return transformers
    except Exception as e:  # ImportError, or a broken install
        raise HFUnavailable("transformers is not importable: %s: %s" %
                            (type(e).__name__, e))


def _version_at_least(version, major, minor):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= (major, minor)


def load_causal_lm(model_dir, dtype, device, attn_implementation=None):
    """LlamaForCausalLM.from_pretrained(model_dir) in `dtype` on `device`,
    in eval mode. bf16 files loaded with dtype=float32 are upcast exactly.
    """
    transformers = import_transformers()
    kwargs = {}
    if _version_at_least(transformers.__version__, 4, 56):
        kwargs["dtype"] = dtype
    else:
        kwargs["torch_dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device).eval()


def keep_logits_kwargs(model, n):
    """forward() kwargs that keep only the last n positions' logits ({} if
    this transformers cannot, in which case all positions are computed)."""
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": n}
    if "num_logits_to_keep" in params:
        return {"num_logits_to_keep": n}
    return {}


def greedy_generation_config(new_tokens):
    """A GenerationConfig for plain greedy decoding of exactly new_tokens
    tokens: no sampling, one beam, no EOS (random weights: any id may win,
    and stopping or suppressing one would change the path), pad id 0 only
    to silence the missing-pad warning (no padding is ever used)."""
    transformers = import_transformers()
    return transformers.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0, bos_token_id=None)
