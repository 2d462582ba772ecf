"""Decode bursts: several decode steps per host round for a batch of plain greedy decodes (vLLM v0's
multi-step scheduling, ``num_scheduler_steps``).

Why: on an H200, a batch-64 decode step of the Llama-3.2-1B shape took 3.8 ms, of which the GPU computed
1.3 ms; the rest was the host scheduling the step, building its inputs and appending 64 tokens
(benchmarks/results/h200/check.json, before bursts). A burst of K steps queues K replays of the decode graph at
once, each feeding its argmax to the next on the device, and copies each step's tokens to the host behind
an event. The host then appends step k's tokens (stops, detokenization, block commits) while the device
computes steps k+1..K-1, and pays for scheduling and input preparation once per K steps.

    Engine.step():  schedule -> reserve_burst (blocks for K tokens) -> launch_burst (K steps queued)
                    -> for each step k: continue_burst (rows still running) -> update -> process

A burst never changes a token: each step's token is the argmax of the same logits an ordinary step's
sampler takes (Sampler's on-device greedy path). Eligible (``burst_length``): decode-only steps of at most
the largest graph's rows, every row one sequence's only sample, greedy, without logprobs, penalties, bias,
min_tokens bans, grammar or drafts, with nothing waiting to be admitted (a newcomer waits at most one
burst) and no KV tier (a block evicted for the lookahead would be demoted after the burst overwrote it).

A sequence that stops at step j keeps no later token: the burst's later steps still compute its row, and
their KV lands past its end in blocks it held (never committed ones); the blocks go back to the pool when it
finishes, and whoever gets them next writes after the burst on the same stream.
"""
from __future__ import annotations

import time

import torch

from engine.sampler import SampleResult
from engine.scheduler_output import SampleSpec, SchedulerOutput

DEFAULT_DECODE_BURST = 8  # steps per burst where decode steps replay CUDA graphs (num_scheduler_steps=None)


def burst_length(batch: SchedulerOutput, max_steps: int, max_model_len: int, max_rows: int) -> int:
    """How many decode steps ``batch`` may run on the device in one host round: 1 (an ordinary step) unless
    every row is eligible (module docstring); at most ``max_steps``, the room left before ``max_model_len``
    and the most tokens any row still wants."""
    if max_steps <= 1 or not 0 < len(batch.rows) <= max_rows or batch.copies or batch.transfers:
        return 1
    room, wanted = max_steps, 0
    for row in batch.rows:
        if (row.num_new_tokens != 1 or row.num_draft_tokens or row.prompt_logprobs is not None
                or len(row.samples) != 1 or not _plain_greedy(row.samples[0])):
            return 1
        spec = row.samples[0]
        room = min(room, max_model_len - row.start)  # the burst feeds positions start .. start + K - 1
        wanted = max(wanted, spec.params.max_tokens - spec.output_index)
    return max(1, min(room, wanted))


def _plain_greedy(spec: SampleSpec) -> bool:
    p = spec.params
    return (p.is_greedy and spec.num_top_logprobs is None and not spec.banned_token_ids and not p.logit_bias
            and not p.needs_penalties and p.structured_outputs is None and not p.use_beam_search)


class DeviceBurst:
    """A burst's steps, queued on the device: ``output(k, batch)`` waits for step k's tokens and gives them as
    the RunnerOutput of ``batch`` (the rows of step k that are still running, in launch order)."""

    def __init__(self, seq_ids: tuple[str, ...], host: torch.Tensor, events: list | None) -> None:
        """``host`` [K, >=B]: each step's argmax of the B launched rows, on the host; ``events``: recorded after
        each step's copy into it (pinned memory, filled while the device runs), or None where the device is
        the CPU (filled before the burst returned)."""
        self.index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        self.host, self.events = host, events
        self.started = time.perf_counter()

    def step_tokens(self, k: int) -> list[int]:
        if self.events is not None:
            self.events[k].synchronize()
        return self.host[k, : len(self.index)].tolist()

    def output(self, k: int, batch: SchedulerOutput):
        from engine.model_runner import RunnerOutput  # the runner's output type (it imports this module)

        tokens = self.step_tokens(k)
        seq_ids = tuple(row.seq_id for row in batch.rows)
        n = len(seq_ids)
        chosen = [tokens[self.index[seq_id]] for seq_id in seq_ids]
        return RunnerOutput(seq_ids, SampleResult(chosen, [None] * n, [None] * n, [None] * n), {},
                            forward_seconds=(time.perf_counter() - self.started) / (k + 1))
