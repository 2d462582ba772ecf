"""OutputProcessor: a step's samples become tokens, stop decisions, beam moves and RequestOutputs.

It runs after `Scheduler.update_from_output` (progress, block commits and n>1 forks are done by
then). Finishing a sequence or forking a beam goes back through the scheduler, which owns the
queues and the blocks.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine.beam_search import BeamSearch
from engine.detokenizer import Detokenizer, stream_safe_text
from engine.model_runner import PromptLogprobs, RunnerOutput
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampler import SampleResult
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.step_histogram import StepHistogram
from engine.structured_output import StructuredOutputManager


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # samples in index order (n>1 forks included); the root beam for beam search
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    beam: BeamSearch | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return self.beam.beams() if self.beam is not None else [s for s in self.seqs if not s.is_finished]


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count ("abort" too)
    iteration_tokens: StepHistogram = field(default_factory=StepHistogram)  # tokens scheduled per step
    fast_forward_tokens: int = 0  # output tokens a grammar forced (appended without sampling)


class OutputProcessor:
    """Owns the live requests. Invariant: every sequence of a request in ``requests`` is waiting,
    running or finished in the scheduler; a finished request is gone from ``requests``."""

    def __init__(
        self, scheduler: Scheduler, detokenizer: Detokenizer, structured: StructuredOutputManager,
        eos_token_ids: tuple[int, ...], max_model_len: int, fast_forward: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.fast_forward = fast_forward  # grammar fast-forward (engine/structured_output.py)
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self._beam_ids = itertools.count(1)

    def scheduled(self, batch: SchedulerOutput) -> None:
        """A step was scheduled (before it runs): a request's queue time ends at its first scheduling,
        not when its first token comes back (that is TTFT), so stamp it here."""
        if not batch.rows:
            return
        now = time.monotonic()
        self.counters.iteration_tokens.observe(batch.num_batched_tokens)
        seqs = self.scheduler.seqs
        for row in batch.rows:
            state = self.requests.get(seqs[row.seq_id].request_id)
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = now

    def process(self, batch: SchedulerOutput, result: RunnerOutput | None, emit_unfinished: bool = True
                ) -> list[RequestOutput]:
        """The step's RequestOutputs: one per request it advanced; ``emit_unfinished=False`` (a decode burst's
        steps before its last) only those that finished."""
        if result is None or not batch.rows:
            return []
        now = time.monotonic()
        seqs = self.scheduler.seqs
        for row in batch.rows:
            seq = seqs[row.seq_id]
            if row.seq_id in result.prompt_logprobs:
                self._append_prompt_logprobs(seq, result.prompt_logprobs[row.seq_id])
        touched: dict[str, RequestState] = {}
        constrained: dict[str, Sequence] = {}  # sequences whose grammar may force what comes next
        for i, seq_id in enumerate(result.sampled_seq_ids):
            seq = seqs.get(seq_id)
            if seq is None:  # finished by an earlier token of this step (accepted drafts after a stop)
                continue
            state = self.requests[seq.request_id]
            if state.beam is not None:
                state.beam.record(seq, result.samples.top_logprobs[i])
            else:
                self._append_token(seq, i, result.samples)
                if self.fast_forward and seq.params.structured_outputs is not None and seq.logprobs is None:
                    constrained[seq_id] = seq
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
            touched[state.request_id] = state
        for seq in constrained.values():  # after the step's last token of each (a row may emit several)
            if not seq.is_finished:
                self._fast_forward(seq)
        outputs = []
        for state in touched.values():
            if not emit_unfinished and not state.finished:
                continue
            if state.beam is not None:
                if not state.beam.ready():
                    continue
                self._advance_beams(state)
                if not state.beam.done:
                    continue
            outputs.append(self._request_output(state))
        return outputs

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.structured.release(seq.seq_id)
        self.detokenizer.release(seq.seq_id)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self._count_finished("abort")
        for seq in state.live_seqs():
            seq.finish_reason = "abort"
            self.finish(seq)
        if state.beam is not None:
            state.beam.done = True
        return True

    # -- tokens -----------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, row: int, samples: SampleResult) -> None:
        token = samples.token_ids[row]
        if seq.logprobs is not None:
            seq.cumulative_logprob += samples.logprobs[row]
            entry = {tid: Logprob(lp, rank + 1, self.detokenizer.decode_token(tid))
                     for rank, (tid, lp) in enumerate(samples.top_logprobs[row])}
            entry.setdefault(token, Logprob(samples.logprobs[row], samples.ranks[row],
                                            self.detokenizer.decode_token(token)))
            seq.logprobs.append(entry)
        self._add_token(seq, token)

    def _fast_forward(self, seq: Sequence) -> None:
        """Grammar fast-forward: tokens the grammar forces are appended without sampling; the next step
        computes them with the sequence's row (they need no verification). Not with logprobs (a forced
        token has no sampled logprob to report)."""
        p = seq.params
        limit = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        for token in self.structured.fast_forward(seq.seq_id, limit):
            if seq.is_finished:
                break
            self.counters.fast_forward_tokens += 1
            self._add_token(seq, token)

    def _add_token(self, seq: Sequence, token: int) -> None:
        """Append one output token (sampled or forced) and finish the sequence where it must stop."""
        previous_len = len(seq.text)
        seq.token_ids.append(token)
        self.counters.generation_tokens += 1
        p = seq.params
        stop = self.detokenizer.update(seq, previous_len)
        grammar_done = p.structured_outputs is not None and self.structured.accept(seq.seq_id, token)
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop.stop
        elif grammar_done:  # the output is complete and the grammar allows nothing more
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.finish(seq)

    def _append_prompt_logprobs(self, seq: Sequence, lp: PromptLogprobs) -> None:
        for j, (chosen, rank, top) in enumerate(zip(lp.token_logprobs, lp.ranks, lp.top)):
            token = seq.token_ids[lp.first_position + j]
            entry = {tid: Logprob(v, r + 1, self.detokenizer.decode_token(tid)) for r, (tid, v) in enumerate(top)}
            entry.setdefault(token, Logprob(chosen, rank, self.detokenizer.decode_token(token)))
            seq.prompt_logprobs.append(entry)

    # -- beams ------------------------------------------------------------------------------
    def _advance_beams(self, state: RequestState) -> None:
        """Apply one beam-search decision: reuse each chosen parent once, fork it for further
        choices, free beams nobody chose."""
        group = state.beam
        before = group.beams()
        chosen = group.step()
        if group.done:
            for seq in before:
                self.finish(seq)
            return
        reused: set[str] = set()
        beams: list[tuple[Sequence, int]] = []
        for c in chosen:
            if c.parent.seq_id in reused:
                child = self._new_beam(c.parent)
                self.scheduler.fork(c.parent, child)  # copies the parent's tokens before it appends
                beams.append((child, c.token_id))
            else:
                reused.add(c.parent.seq_id)
                beams.append((c.parent, c.token_id))
        for seq in before:
            if seq.seq_id not in reused:
                self.finish(seq)
        for seq, token in beams:
            seq.token_ids.append(token)
            self.counters.generation_tokens += 1
        group.running = [(seq, c.cumulative_logprob) for (seq, _), c in zip(beams, chosen)]

    def _new_beam(self, parent: Sequence) -> Sequence:
        return Sequence(
            seq_id=f"{parent.request_id}#b{next(self._beam_ids)}", request_id=parent.request_id, index=0,
            params=parent.params, token_ids=[], num_prompt_tokens=parent.num_prompt_tokens,
            arrival_order=parent.arrival_order, priority=parent.priority, cache_salt=parent.cache_salt,
            num_cached_tokens=parent.num_cached_tokens,
        )

    # -- outputs ----------------------------------------------------------------------------
    def _request_output(self, state: RequestState) -> RequestOutput:
        finished = state.finished
        outputs = self._beam_outputs(state) if state.beam is not None else []
        for seq in state.seqs if state.beam is None else ():
            text = seq.text if seq.is_finished else stream_safe_text(seq.text, seq.params.stop_strings)
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        first = state.seqs[0]
        if finished:
            self.requests.pop(state.request_id, None)
            self._count_finished((outputs[0].finish_reason if outputs else None) or "stop")
        metrics = {"arrival_time": state.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(state, name) is not None:
                metrics[name] = getattr(state, name)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=first.num_cached_tokens,
            num_retained_tokens=sum(seq.num_retained_tokens for seq in state.seqs),
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            metrics=metrics,
        )

    def _count_finished(self, reason: str) -> None:
        finished = self.counters.requests_finished
        finished[reason] = finished.get(reason, 0) + 1

    def _beam_outputs(self, state: RequestState) -> list[CompletionOutput]:
        outputs = []
        for i, hyp in enumerate(state.beam.finished):
            text = self.detokenizer.tokenizer.decode(list(hyp.token_ids), skip_special_tokens=True)
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=list(hyp.token_ids), cumulative_logprob=hyp.cumulative_logprob,
                finish_reason=hyp.finish_reason,
            ))
        return outputs
