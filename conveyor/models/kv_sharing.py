"""K/V shared across layers (Gemma 4, Gemma 3n): the last layers attend over an earlier layer's K/V instead of
their own. Used by those families' configs and by the GGUF loader, so it belongs to no family."""

from __future__ import annotations


def kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """Per layer, whose K/V it attends over: the last `num_shared` layers read the last earlier layer of their kind
    (transformers' kv_sharing_modes: that layer "stores", these "reuse")."""
    layers = len(types)
    first_shared = layers - num_shared
    if num_shared and first_shared <= 0:
        raise NotImplementedError(f"num_kv_shared_layers {num_shared} of {layers} layers (no layer computes K/V)")
    sources = list(range(layers))
    for i in range(first_shared, layers):
        owners = [j for j in range(first_shared) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"K/V-shared layer {i} ({types[i]}) has no earlier layer of its kind")
        sources[i] = owners[-1]
    return tuple(sources)
