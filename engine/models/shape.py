"""A model config's shape: its values checked before anything is built from them, and its
parameter count (engine.memory sizes the weights from it before they are allocated).

A hand-edited or hostile config.json (``num_attention_heads: 0``, ``rms_norm_eps: NaN``, a head
count that does not divide) would otherwise fail inside transformers as a ZeroDivisionError, deep
in a forward pass as a shape error, or not at all: a NaN epsilon turns every norm into NaN and the
model silently generates nothing. ``check_config`` refuses each with one line naming the field.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.config import ConfigError, is_finite, require_int

# Fields that are counts or sizes when given (transformers fills the ones left out).
POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
# Fields that are positive reals when given.
POSITIVE_REALS = ("rms_norm_eps", "rope_theta")


def check_config(fields: Mapping[str, Any], where: str, resolved: bool = False) -> None:
    """ConfigError (one line, naming ``where`` and the field) unless the shape fields of
    ``fields`` can build a model: counts positive integers, the query heads a multiple of the KV
    heads, epsilon and the rotary base finite and positive, the head dimension even (rotary
    embeddings turn pairs of dimensions). ``resolved``: ``fields`` are a loaded config's, with
    transformers' defaults filled in (head_dim then follows from hidden_size when unset)."""
    for name in POSITIVE_INTS:
        value = fields.get(name)
        if value is not None:
            require_int(f"{where}: {name}", value, 1)
    for name in POSITIVE_REALS:
        value = fields.get(name)
        if value is not None and not (is_finite(value) and value > 0):
            raise ConfigError(f"{where}: {name} must be a finite number > 0, got {value!r}")
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    hidden, head_dim = fields.get("hidden_size"), fields.get("head_dim")
    if resolved and head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ConfigError(f"{where}: hidden_size ({hidden}) must be a multiple of "
                              f"num_attention_heads ({heads}) when head_dim is not given")
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise ConfigError(f"{where}: the head dimension must be even (rotary embeddings turn pairs "
                          f"of dimensions), got {head_dim}")


def config_fields(config) -> dict[str, Any]:
    """The shape fields of a loaded (transformers) config, for ``check_config``."""
    return {name: getattr(config, name, None) for name in POSITIVE_INTS + POSITIVE_REALS}


def parameter_counts(config, qkv_bias: bool, qk_norm: bool) -> tuple[int, int]:
    """(every parameter, the projection and LM-head weights among them) of a Llama-family model
    of ``config`` (engine.models.llama); the second is what CPU packing copies once more."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    vocab = config.vocab_size
    projections = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * inter
    others = 2 * h + (heads * d + 2 * kv_heads * d if qkv_bias else 0) + (2 * d if qk_norm else 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    total = layers * (projections + others) + vocab * h * (1 if tied else 2) + h
    return total, layers * projections + vocab * h
