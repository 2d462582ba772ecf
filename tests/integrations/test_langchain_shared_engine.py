"""In-process chat models share one engine per (model, engine settings) and process
(integrations/langchain/shared_engines.py): memory scales with use, not with instances, and the
instances share one prefix cache."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
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
    assert shared_engines().num_users(config) == 0 and not engine.is_running
    other.close()


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
