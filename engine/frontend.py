"""What servers and adapters need from an engine, and nothing of its internals.

`LLM` and `AsyncEngine` both mix in `FrontendSurface`; app/ and integrations/ use only this:

    model_info        ModelInfo, frozen: served name, folder, max_model_len, vocab size, EOS ids,
                      chat template, dtype, device, KV pool size, max_num_seqs
    tokenize(text) / token_strings(ids) / detokenize(ids) / decode_token(id)
    apply_chat_template(conversation, ...) -> token ids;   tool_chat (the model's tool layer)
    stats()           numbers for /metrics
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.tool_calls import ToolChat

if TYPE_CHECKING:
    from engine.engine import Engine


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the model as configured (a name or a folder): the default served name
    model_path: str  # the resolved local folder
    architecture: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int  # the KV pool's resident size (engine/kv_budget.py sizes it by default on CPU)
    max_num_seqs: int
    weight_bytes: int = 0  # the model's weights as held in memory (quantized tables at their packed size)
    weight_bytes_by_layout: dict = field(default_factory=dict)  # "int4", "int8", "float32", ... -> bytes
    quantization: str = "none"  # "gguf" / "compressed-tensors" / "gptq" / "awq": linears kept int4 / int8

    @property
    def kv_cache_tokens(self) -> int:
        return self.block_size * self.num_kv_blocks


def model_info_of(engine: Engine) -> ModelInfo:
    return ModelInfo(
        model=str(engine.config.model), model_path=str(engine.model_path),
        architecture=engine.model_config.architecture, dtype=engine.config.dtype, device=str(engine.device),
        max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
        eos_token_ids=tuple(engine.model_config.eos_token_ids),
        chat_template=getattr(engine.tokenizer, "chat_template", None) or None,
        block_size=engine.config.block_size, num_kv_blocks=engine.blocks.num_blocks,
        kv_cache_bytes=engine.runner.kv_cache.nbytes,
        max_num_seqs=engine.config.max_num_seqs,
        weight_bytes=engine.weight_bytes, weight_bytes_by_layout=dict(engine.weight_bytes_by_layout),
        quantization=engine.quantization,
    )


class FrontendSurface:
    """Mixed into LLM and AsyncEngine; both keep their Engine as ``_core``."""

    _core: Engine

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return model_info_of(self._core)

    @functools.cached_property
    def tool_chat(self) -> ToolChat:
        """The model's chat template and tool layer (rendering, tool-call parsing, constraints)."""
        return ToolChat(self._core.tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._core.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string for each token id (byte-level pieces as the vocabulary spells them)."""
        return self._core.tokenizer.convert_ids_to_tokens(list(token_ids))

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        vocab = self._core.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab}).", param="tokens")
        return self._core.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        return self._core.detokenizer.decode_token(token_id)

    def apply_chat_template(
        self, conversation: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
    ) -> list[int]:
        tokenizer = self._core.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template.", param="messages")
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )
        # The template already holds any BOS token: do not add special tokens twice.
        return tokenizer(text, add_special_tokens=False).input_ids

    def get_tokenizer(self):
        """The Hugging Face tokenizer itself (vLLM's name), for callers that need more than the above."""
        return self._core.tokenizer
