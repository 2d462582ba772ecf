"""LLM: the offline API (vLLM-style). `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.admission import tokenize_prompt
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.engine import Engine, PromptInput
from engine.errors import InvalidRequestError
from engine.async_engine import AsyncEngine
from engine.frontend import FrontendSurface
from engine.outputs import RequestOutput
from engine.process_setup import prepare_process
from engine.sampling_params import SamplingParams


class LLM(FrontendSurface):
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        config = EngineConfig(model=model, **engine_args)
        prepare_process(config.device)  # process-wide set-up, once (gc freeze, malloc tuning)
        self.engine = self._core = Engine(config)
        self._ids = itertools.count()
        self._async: AsyncEngine | None = None

    def as_async_engine(self) -> AsyncEngine:
        """An AsyncEngine over this LLM's engine (made once; started by whoever uses it), so that
        front-ends drive an offline LLM the way the server drives its engine. Do not call
        ``generate`` while its loop runs: one engine, one driver at a time."""
        if self._async is None:
            self._async = AsyncEngine(self.engine)
        return self._async

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, prio in zip(ids, prompts, params, priorities):
                self.engine.add_request(request_id, prompt, p, priority=prio, cache_salt=cache_salt)
        except Exception:
            for request_id in ids:  # leave no half-submitted batch behind
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptInput | Seq[PromptInput], params: "BeamSearchParams", *, use_tqdm: bool = False
    ) -> list["BeamSearchOutput"]:
        """vLLM's offline beam-search API; the search itself runs inside the engine as block forks."""
        sampling = SamplingParams(
            n=params.beam_width, use_beam_search=True, temperature=0.0, max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        outs = self.generate(prompts, sampling, use_tqdm=use_tqdm)
        return [
            BeamSearchOutput([
                BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob, c.finish_reason)
                for c in o.outputs
            ])
            for o in outs
        ]

    def kv_cache_usage(self) -> dict[str, int]:
        return self.engine.kv_cache_usage()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (device pool and host tier), as vLLM's LLM.reset_prefix_cache;
        False while a request holds blocks."""
        return self.engine.reset_prefix_cache()

    # -- retention (engine/retention.py) --------------------------------------------------------------
    def retain_prefix(self, prompt: PromptInput, ttl_s: float, *, cache_salt: str | None = None) -> int:
        """Compute ``prompt`` now (where it is not cached) and retain it for ``ttl_s`` seconds: warm a system
        prompt or a RAG corpus before traffic. Returns the tokens retained (whole KV blocks)."""
        _, ids = tokenize_prompt(self.engine.tokenizer, self.engine.model_config.vocab_size, prompt)
        params = SamplingParams(max_tokens=1, temperature=0.0, cache_breakpoints=((len(ids), float(ttl_s)),))
        self.generate({"prompt_token_ids": ids}, params, use_tqdm=False, cache_salt=cache_salt)
        return self.engine.cache_lookup(ids, cache_salt=cache_salt, remote=False)["retained_tokens"]

    def cache_lookup(self, token_ids: list[int], *, cache_salt: str | None = None) -> dict[str, int | None]:
        """Tokens of ``token_ids``' prefix cached on the device (``device_tokens``), of those retained
        (``retained_tokens``), continuing them in the host tier (``host_tokens``) and continuing those in Redis
        (``remote_tokens``; None without a Redis tier or when it does not answer)."""
        return self.engine.cache_lookup(token_ids, cache_salt=cache_salt)

    def cache_release(self, token_ids: list[int], *, cache_salt: str | None = None) -> int:
        """End the retention of ``token_ids``' cached prefix; the tokens that were retained."""
        return self.engine.cache_release(token_ids, cache_salt=cache_salt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while len(finals) < len(ids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[i] for i in ids]


def _per_prompt(value, n: int, name: str) -> list:
    if value is None:
        return [SamplingParams()] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts.", param=name)
        return list(value)
    return [value] * n


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False


@dataclass(frozen=True)
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated tokens
    text: str  # the generated text
    cum_logprob: float
    finish_reason: str | None


@dataclass(frozen=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
