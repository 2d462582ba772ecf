"""Structured outputs: the per-step cost of grammar masking on SmolLM2-135M-Instruct (vocab 49152).

A batch of B chat requests generates JSON under a schema. Every piece of work structured outputs
adds to a step is timed where it runs (wrapped on the engine's own objects):
  mask    StructuredOutputManager.grammar_mask: llguidance fills the [B, 1536] int32 bitmask
  apply   Sampler._apply_grammar: unpack the bits, -inf on disallowed logits (+ the logits copy)
  accept  StructuredOutputManager.accept: advance each row's matcher by its sampled token
and reported per decode step, next to the whole step's time, for B = 1 and 16. The same batch
unconstrained gives the baseline step time. Compilation (first request of a schema) is reported
separately. JSON under benchmarks/results/.

    python benchmarks/structured_output.py [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import write_json  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "skills", "address"],
    "additionalProperties": False,
}


class Timer:
    """Wraps a bound method on one object and accumulates its wall time for the current step."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.total = owner, name, 0.0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        setattr(owner, name, timed)

    def restore(self) -> None:
        vars(self.owner).pop(self.name, None)

    def take(self) -> float:
        value, self.total = self.total, 0.0
        return value


def run(llm, batch: int, max_tokens: int, constrained: bool) -> dict:
    from engine import SamplingParams, StructuredOutputsParams

    engine = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        messages = [{"role": "user", "content": f"Invent user number {i} and describe them as JSON."}]
        ids = llm.apply_chat_template(messages, True, None)
        engine.add_request(f"{'c' if constrained else 'u'}{batch}-{i}", {"prompt_token_ids": list(ids)},
                           SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, structured_outputs=spec,
                                          ignore_eos=not constrained))
    timers = {name: Timer(*where) for name, where in {
        "mask": (engine.structured, "grammar_mask"),
        "apply": (engine.runner.sampler, "_apply_grammar"),
        "accept": (engine.structured, "accept"),
    }.items()}
    steps = []
    finals = {}
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step = time.perf_counter() - t0
        parts = {name: timer.take() for name, timer in timers.items()}
        if running == batch:  # full-batch decode steps only (no prefill, no stragglers)
            steps.append({"step": step, **parts})
    for timer in timers.values():
        timer.restore()
    valid = 0
    for out in finals.values():
        try:
            json.loads(out.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in ("step", "mask", "apply", "accept")}
    med["overhead"] = med["mask"] + med["apply"] + med["accept"]
    return {"batch": batch, "constrained": constrained, "decode_steps": len(steps), "median_ms": med,
            "valid_json": valid, "outputs": len(finals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()

    from engine import LLM, StructuredOutputsParams

    llm = LLM(max_num_seqs=32, max_model_len=1024)
    t0 = time.perf_counter()
    llm.engine.structured.compile(StructuredOutputsParams(json={"type": "string"}))  # builds the LLTokenizer
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.structured.compile(StructuredOutputsParams(json=SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    results = []
    for batch in args.batches:
        for constrained in (False, True):
            r = run(llm, batch, args.max_tokens, constrained)
            results.append(r)
            m = r["median_ms"]
            print(f"B={batch:2d} {'json ' if constrained else 'free '} step {m['step']:7.2f} ms | mask {m['mask']:.3f} "
                  f"apply {m['apply']:.3f} accept {m['accept']:.3f} = overhead {m['overhead']:.3f} ms/step | "
                  f"valid JSON {r['valid_json']}/{r['outputs']} ({r['decode_steps']} steps)")
    print(f"first structured request builds the LLTokenizer: {tokenizer_s:.2f} s (once per engine); "
          f"compiling the schema: {compile_ms:.1f} ms (cached afterwards)")
    path = write_json("structured_output", {"schema": SCHEMA, "max_tokens": args.max_tokens, "results": results,
                                            "tokenizer_init_s": tokenizer_s, "schema_compile_ms": compile_ms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
