"""What a step costs by how many tokens it computes, measured on this machine at start-up, and the rule
that turns it into how many draft tokens a step may verify.

On a CPU a step reads every weight once whatever its row count, so up to a point extra rows are nearly
free (SmolLM2 int4 on a 2-core Zen 5: 8 rows cost ~1.3x one row) and past it they cost their FLOPs. Where
that point lies depends on the CPU, the model and its dtype, so it is measured, not assumed.

    StepCost.measure(runner) -> StepCost;  cost.seconds(tokens) -> s (interpolated)
    worth_drafting(cost, num_rows, gains) -> how many of the offered drafts to verify
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from engine.speed_check import prefill_batch

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class StepCost:
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def measure(cls, runner, sizes: tuple[int, ...] = SIZES) -> StepCost:
        """The least time of a forward (and one row's logits) over ``sizes`` tokens of one sequence, written
        into KV blocks no request holds yet (call before serving)."""
        capacity = runner.kv_cache.shape[2] * runner.block_size
        sizes = tuple(n for n in sizes if n <= capacity) or (1,)
        model, out = runner.model, []
        with torch.inference_mode():
            for n in sizes:
                input_ids, positions, attn = prefill_batch(runner, n)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    model.compute_logits(model(input_ids, positions, runner.kv_cache, attn)[-1:])
                    best = min(best, time.perf_counter() - t0)
                out.append(best)
        # A step never gets cheaper with more tokens: smooth the noise of the small sizes upwards.
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1])
        return cls(sizes, tuple(out))

    @classmethod
    def flat(cls) -> StepCost:
        """A step costing the same at any size (a GPU at these sizes): every draft is worth verifying."""
        return cls((1,), (1.0,))

    def seconds_for(self, tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if tokens <= ts[0]:
            return ss[0]
        i = bisect.bisect_left(ts, tokens)
        if i == len(ts):  # past the last size: linear in the tokens from the last two
            if len(ts) == 1:
                return ss[0]
            slope = (ss[-1] - ss[-2]) / (ts[-1] - ts[-2])
            return ss[-1] + slope * (tokens - ts[-1])
        t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)


def worth_drafting(cost: StepCost, num_tokens: int, num_outputs: float, offers: list[tuple[int, float]]) -> list[int]:
    """Which drafts a step verifies. ``num_tokens`` the step computes anyway, yielding ``num_outputs``
    tokens; ``offers``: (draft length, expected accepted tokens) per draft. Drafts are taken best yield per
    token first while they raise the step's output tokens per second; returns the indices taken."""
    order = sorted(range(len(offers)), key=lambda i: -offers[i][1] / max(offers[i][0], 1))
    taken = []
    rate = num_outputs / cost.seconds_for(num_tokens)
    for i in order:
        length, gain = offers[i]
        new_rate = (num_outputs + gain) / cost.seconds_for(num_tokens + length)
        if new_rate <= rate:
            continue
        taken.append(i)
        num_tokens, num_outputs, rate = num_tokens + length, num_outputs + gain, new_rate
    return sorted(taken)
