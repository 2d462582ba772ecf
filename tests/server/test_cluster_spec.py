"""ClusterSpec (app/cluster.py): what `prefixserve cluster` starts, as plain commands, and its refusals."""
from __future__ import annotations

import pytest

from app.cli import build_parser
from app.cluster import ClusterSpec, spec_from_args


def _spec(*argv: str) -> ClusterSpec:
    parser = build_parser()
    args, extra = parser.parse_known_args(["cluster", *argv])
    return spec_from_args(args, extra)


def test_workers_get_their_ports_threads_and_every_serve_flag():
    spec = _spec("--replicas", "3", "--port", "9000", "--threads-per-replica", "1", "--model", "m",
                 "--kv-redis-url", "redis://127.0.0.1:6379/0", "--dtype", "bfloat16")
    assert spec.urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003")
    cmd = spec.worker_command(9002)
    assert cmd[cmd.index("--port") + 1] == "9002"
    # The shared Redis tier and every other engine flag reach each worker unchanged.
    assert cmd[-6:] == ["--model", "m", "--kv-redis-url", "redis://127.0.0.1:6379/0", "--dtype", "bfloat16"]
    assert spec.threads == 1
    gateway = spec.gateway_command()
    assert gateway[gateway.index("--worker-urls") + 1: gateway.index("--policy")] == list(spec.urls)
    assert gateway[gateway.index("--policy") + 1] == "cache_aware"
    assert gateway[gateway.index("--prometheus-port") + 1] == "9004"


def test_worker_urls_start_no_workers():
    spec = _spec("--worker-urls", "http://a:8000", "http://b:8000", "--policy", "round_robin",
                 "--gateway-arg=--cache-threshold=0.5")
    assert spec.local_worker_ports == () and spec.urls == ("http://a:8000", "http://b:8000")
    assert spec.gateway_command()[-1] == "--cache-threshold=0.5"


@pytest.mark.parametrize("argv, message", [
    (("--replicas", "0"), "--replicas"),
    (("--threads-per-replica", "0"), "--threads-per-replica"),
    (("--worker-urls", "http://a:1", "--model", "m"), "no workers are started"),
])
def test_bad_specs_fail_clearly(argv, message):
    with pytest.raises(ValueError, match=message):
        _spec(*argv)


def test_unknown_policy_and_worker_flags_fail_before_anything_starts(capsys):
    from app.cli import main

    with pytest.raises(SystemExit):
        main(["cluster", "--policy", "fastest"])
    with pytest.raises(SystemExit):  # checked as a `serve` flag before any process starts
        main(["cluster", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
