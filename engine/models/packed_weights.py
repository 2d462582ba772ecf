"""One copy of each linear weight. The bound ops pack every linear weight into the form their linear reads
(on CPU a blocked copy: the lanes layout, or oneDNN's); the module's plain tensor is then released (a meta
tensor of its shape), so the weights are resident once, not twice (a 1B-shaped float32 model measured 11.4 GB
resident with both copies). Binding other ops later unpacks the released tensors back from the bound forms
(``ops.unpack_weight``, exact), then packs them for the new ops.

A weight whose form shares the module's storage (the plain weight itself on CUDA, the row kernel's form) is
kept. A tied LM head is the embedding table: it is released only where the head's form can give rows back
(``ops.row_reader``), the embedding then reading from that form.
"""
from __future__ import annotations

import torch
from torch import nn

# (module path within a decoder layer, LayerWeights field)
LAYER_LINEARS = (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"), ("mlp.gate_up_proj", "gate_up"),
                 ("mlp.down_proj", "down"))


def _linears(model):
    """(module, its bound form) of every linear the model packs: each layer's four, and an untied LM head."""
    for layer, weights in zip(model.model.layers, model._layers):
        for path, field in LAYER_LINEARS:
            yield layer.get_submodule(path), getattr(weights, field)
    if not model.config.tie_word_embeddings and model._lm_head is not None:
        yield model.lm_head, model._lm_head


def _is_released(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.device.type == "meta"


def _storages(form) -> set[int]:
    """Storage addresses of the plain tensors a bound form holds (oneDNN's opaque tensors hold their own)."""
    tensors = [form] if isinstance(form, torch.Tensor) else [getattr(form, "small", None), getattr(form, "packed", None)]
    return {t.untyped_storage().data_ptr() for t in tensors
            if isinstance(t, torch.Tensor) and not t.is_mkldnn and t.device.type != "meta"}


def restore(model, ops) -> None:
    """Put back every released module weight, unpacked from its form bound with ``ops`` (the previous binding)."""
    for module, form in list(_linears(model)):
        if _is_released(module):
            module.weight = nn.Parameter(ops.unpack_weight(form), requires_grad=False)
    embedding = model.model.embed_tokens
    if _is_released(embedding):  # a tied table read from the head's form
        embedding.weight = nn.Parameter(ops.unpack_weight(model._lm_head), requires_grad=False)
        model.lm_head.weight = embedding.weight


def release_tied_embedding(model) -> int:
    """Release a tied model's embedding table once its LM head's bound form can give its rows back (the model
    then embeds from that form): the vocabulary held once, not twice (SmolLM2's 113 MB in float32, Llama-3.2-1B's
    1 GB). The bytes released."""
    embedding = model.model.embed_tokens
    w = embedding.weight
    if _is_released(embedding) or w.untyped_storage().data_ptr() in _storages(model._lm_head):
        return 0
    released = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    embedding.weight = released
    model.lm_head.weight = released  # tied: the same parameter
    return w.numel() * w.element_size()


def release_layer(layer: nn.Module, weights) -> int:
    """Release one decoder layer's module weights that its bound forms (``weights``: LayerWeights)
    duplicate, right after they are packed (so a model is never resident twice over); the bytes released."""
    return sum(release_module(layer.get_submodule(path), getattr(weights, field)) for path, field in LAYER_LINEARS)


def release_module(module: nn.Module, form) -> int:
    """Release ``module``'s weight if ``form`` is a copy of it (not the tensor itself, nor sharing its storage)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type == "meta" or form is w:
        return 0
    if w.untyped_storage().data_ptr() in _storages(form):
        return 0
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    return w.numel() * w.element_size()


def resident_bytes(model) -> int:
    """Bytes of weights the model holds once bound (resident_bytes_by_layout, summed)."""
    return sum(resident_bytes_by_layout(model).values())


def resident_bytes_by_layout(model) -> dict[str, int]:
    """Bytes of weights the model holds once bound, by layout: "int4" and "int8" quantized tables (an LM head's
    second forms with its table), and the float ones by dtype: the remaining parameters (norms, embedding,
    biases, kept plain weights) and the bound forms that are copies."""
    from kernels.cpu.linear import form_nbytes
    from kernels.quant_linear import QuantizedWeight

    out: dict[str, int] = {}

    def add(key: str, nbytes: int) -> None:
        out[key] = out.get(key, 0) + nbytes

    seen: set[int] = set()
    for p in model.parameters():
        if p.device.type != "meta" and p.untyped_storage().data_ptr() not in seen:
            seen.add(p.untyped_storage().data_ptr())
            add(str(p.dtype).removeprefix("torch."), p.numel() * p.element_size())
    forms = [form for _, form in _linears(model)]
    if model.config.tie_word_embeddings and model._lm_head is not None:
        forms.append(model._lm_head)
    for form in forms:
        if not isinstance(form, QuantizedWeight) and not (_storages(form) & seen):
            add(_dtype_name(form), form_nbytes(form))
    quantized = {id(q): q for m in model.modules() for q in [getattr(m, "qweight", None)] if isinstance(q, QuantizedWeight)}
    if isinstance(model._lm_head, QuantizedWeight):
        quantized[id(model.lm_head.weight)] = model._lm_head  # the head as bound: with its second forms
    for q in quantized.values():
        add("int4" if q.layout.startswith("int4") else q.layout, q.nbytes)
    return out


def _dtype_name(form) -> str:
    tensor = getattr(form, "small", form)
    return str(getattr(tensor, "dtype", "unknown")).removeprefix("torch.")
