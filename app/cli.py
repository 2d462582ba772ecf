"""`prefixserve` command line: generate (one prompt), serve (the OpenAI-compatible server), cluster
(several servers behind the SGLang Model Gateway: app/cluster.py) and collect-env (what a bug report needs)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from app.args import add_engine_args, engine_config_from_args
from app.cluster import add_cluster_args
from app.responses_store import DEFAULT_MAX_STORED_RESPONSES
from engine.config import DEFAULT_MODEL


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed_sampling
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from app.server import serve

    return serve(args)


def _collect_env(args: argparse.Namespace) -> int:
    import json

    from engine.collect_env import collect_env, format_report

    facts = collect_env(args.model)
    print(json.dumps(facts, indent=2) if args.json else format_report(facts))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixserve", description="Prefix-sharing LLM inference.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (a user message)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1] (default: 1)")
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed (default: none)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate, model=DEFAULT_MODEL)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument("--api-key", default=None,
                        help="require this bearer token (Authorization: Bearer KEY) on the API (default: none)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model names clients send (default: the --model value)")
    server.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests queued beyond the running ones before new ones get 429 (default: 256)")
    server.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests waiting in the engine (arrived, not yet running) at most, as SGLang's flag: "
                             "a generation request arriving beyond that is refused with 503 + Retry-After "
                             "(Anthropic routes: 529 overloaded_error) (default: no limit)")
    server.add_argument("--metrics-namespace", default="prefixserve",
                        help="prefix of every /metrics name; 'vllm' publishes vLLM's names (vllm:num_requests_running "
                        "...) so dashboards and gateways built for vLLM read them unchanged (default: prefixserve)")
    server.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="/v1/responses results kept in this process's memory for previous_response_id and "
                             f"GET /v1/responses/{{id}} (LRU; 0 stores none; default: {DEFAULT_MAX_STORED_RESPONSES})")
    server.add_argument("--timeout-keep-alive", type=float, default=None,
                        help="seconds an idle keep-alive connection stays open, as uvicorn's flag; longer than "
                             "clients' own idle expiry (httpx: 5 s) so they close first (default: 75)")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGTERM before aborting them (default: 30)")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    env = sub.add_parser("collect-env", help="print what a bug report needs: CPU, libraries, kernel choices, memory",
                         description="CPU model and flags, what the OS grants, torch / oneDNN / transformers "
                                     "versions and the ISA oneDNN runs, the C kernels' build, the kernels chosen "
                                     "by measurement on this machine, memory. Paste it into bug reports.")
    env.add_argument("--model", default=None,
                     help="also load this model and report its kernel choices and memory (default: report the "
                          "choices measured earlier on this machine without loading anything)")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.set_defaults(func=_collect_env)

    cluster = sub.add_parser(
        "cluster", allow_abbrev=False, help="several `serve` replicas behind the SGLang Model Gateway (pip install 'prefixserve[cluster]')",
        description="Starts --replicas `prefixserve serve` workers and the gateway in front of them. Flags not "
                    "listed here (the model, --dtype, --kv-redis-url, ...) go to every worker's `serve`.")
    add_cluster_args(cluster)
    cluster.set_defaults(func=_cluster)
    return parser


def _cluster(args: argparse.Namespace, extra: list[str]) -> int:
    from app.cluster import run_cluster

    build_parser().parse_args(["serve", *extra])  # the workers' flags fail here, before anything starts
    return run_cluster(args, extra)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "cluster":  # only the cluster passes flags on (to its workers)
        parser.parse_args(argv)  # exits with argparse's usual "unrecognized arguments" error
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args, extra) if args.command == "cluster" else args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"prefixserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
