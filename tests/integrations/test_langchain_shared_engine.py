"""In-process chat models share one engine per (model, engine settings) and process
(integrations/langchain/shared_engines.py): memory scales with use, not with instances, and the
instances share one prefix cache."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import EngineConfig

REPO = Path(__file__).resolve().parents[2]


def test_chat_models_with_other_call_settings_lease_one_engine(tiny_model_factory):
    from integrations.langchain import ChatPrefixServe
    from integrations.langchain.shared_engines import shared_engines

    kwargs = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 4}
    path = str(tiny_model_factory("llama"))
    config = EngineConfig(model=path, **kwargs)
    a = ChatPrefixServe(model=path, engine_kwargs=kwargs, max_tokens=3, temperature=0)
    b = ChatPrefixServe(model=path, engine_kwargs=kwargs, max_tokens=2, temperature=0.7, seed=1)
    other = ChatPrefixServe(model=path, engine_kwargs={**kwargs, "num_kv_blocks": 65}, max_tokens=2)
    for chat in (a, b, other):
        chat.invoke("Hello")
    assert shared_engines().num_users(config) == 2
    engine = a._get_backend()._default.engine
    assert b._get_backend()._default.engine is engine
    assert other._get_backend()._default.engine is not engine  # other engine settings: another engine

    a.close()
    a.close()  # idempotent: one lease is released once
    assert shared_engines().num_users(config) == 1 and engine.is_running
    del b  # dropped without close(): collecting it releases its lease, the last one
    gc.collect()
    # Idle, not gone: a chat model built again (in a function, per request) finds it and its prefix cache.
    assert shared_engines().num_users(config) == 0 and engine.is_running and shared_engines().is_held(config)
    again = ChatPrefixServe(model=path, engine_kwargs=kwargs, max_tokens=3, temperature=0)
    again.invoke("Hello")
    assert again._get_backend()._default.engine is engine
    again.close()
    other.close()
    assert shared_engines().close_idle() >= 2 and not engine.is_running and not shared_engines().is_held(config)


def test_an_idle_engine_stops_after_its_timeout(tiny_model_factory):
    from integrations.langchain.shared_engines import SharedEngines

    registry = SharedEngines(idle_timeout_s=0.2)
    config = EngineConfig(model=str(tiny_model_factory("llama")), num_kv_blocks=32, max_model_len=128)
    lease = registry.acquire(config)
    engine = lease.engine
    lease.release()
    lease.release()  # idempotent
    assert engine.is_running and registry.is_held(config)
    again = registry.acquire(config)  # within the timeout: the same engine, its timer cancelled
    assert again.engine is engine
    again.release()
    deadline = time.monotonic() + 10
    while (registry.is_held(config) or engine.is_running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not registry.is_held(config) and not engine.is_running


_CHAT_PER_CALL = r"""
import time
from integrations.langchain import ChatPrefixServe

PATH = {path!r}
system = "You are a concise assistant for a hardware store. " * 12

def ask(question):
    chat = ChatPrefixServe(model=PATH, engine_kwargs=dict(num_kv_blocks=64, max_model_len=512), max_tokens=4,
                           temperature=0)
    reply = chat.invoke([("system", system), ("human", question)])
    return reply.usage_metadata["input_token_details"].get("cache_read", 0)

first = ask("Do you sell hammers?")
t0 = time.perf_counter()
second = ask("Do you sell nails?")
print("CACHE", first, second, round(time.perf_counter() - t0, 2))
"""


def test_a_chat_model_built_per_call_reuses_the_engine_and_exits_quietly(tiny_model_factory):
    """The common pattern: a chat model built inside a function for each call. The second call finds the
    first one's engine and reads the shared system prompt from its cache, and the process exits without a
    traceback."""
    script = _CHAT_PER_CALL.format(path=str(tiny_model_factory("llama")))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CACHE"))
    _, first, second, seconds = line.split()
    assert int(first) == 0 and int(second) > 100 and float(seconds) < 5
    assert "Traceback" not in proc.stderr and "RuntimeError" not in proc.stderr, proc.stderr[-3000:]


# Run in a fresh interpreter so that the RSS figures are this scenario's alone.
_SCRIPT = r"""
import json, os, sys
from integrations.langchain import ChatPrefixServe
from langchain_core.messages import HumanMessage, SystemMessage

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

system = SystemMessage("You are a concise assistant for a hardware store. " * 12)
base = rss()
settings = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=0.3, top_p=0.9, seed=2),
            dict(temperature=1.0, max_tokens=3, seed=3)]
chats, cached = [], []
for i, kw in enumerate(settings):
    chat = ChatPrefixServe(model=sys.argv[1], max_tokens=kw.pop("max_tokens", 4), **kw)
    msg = chat.invoke([system, HumanMessage(f"Question {i}: do you sell hammers?")])
    cached.append(msg.usage_metadata["input_token_details"]["cache_read"])
    chats.append(chat)
    if i == 0:
        one = rss() - base
four = rss() - base
print(json.dumps({"one": one, "four": four, "cache_read": cached}))
"""


@pytest.mark.real_model
def test_four_chat_models_take_the_memory_of_one_and_share_the_prefix_cache(smollm2_path):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(smollm2_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["four"] <= 1.5 * result["one"], result
    assert result["cache_read"][0] == 0 and all(c > 0 for c in result["cache_read"][1:]), result
