from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.app import GatewayRunner, create_app
from tests.gateway.server_thread import ServerThread
from tests.gateway.stub_backend import StubBackend

DEMO_KEY = config_mod.DEMO_API_KEY
OTHER_KEY = "sk-test-other"
METRICS_KEY = "sk-test-metrics-scraper"
METRICS_AUTH = {"authorization": f"Bearer {METRICS_KEY}"}   # /metrics with the per-tenant series
MODEL = "stub-model"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level tokenizer (256 byte tokens, no merges) with a ChatML template: encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    return d


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from edgeinfer.protocol.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir)


def tenant(**kw) -> dict:
    base = {"id": "demo", "api_key_sha256": [config_mod.hash_key(DEMO_KEY)], "models": ["*"]}
    return {**base, **kw}


def gateway_config(tokenizer_dir: Path, stubs: list[StubBackend], tenants: list[dict] | None = None,
                   source: str = "", **server) -> dict:
    data = {
        "server": {"health_interval_s": 0.2, "shutdown_grace_s": 5.0, "page_seed": "test-seed",
                   "metrics_key_sha256": config_mod.hash_key(METRICS_KEY), **server},
        "models": [{"name": MODEL, "tokenizer": str(tokenizer_dir)}],
        "nodes": [{"id": s.node_id, "url": s.url, "model": MODEL} for s in stubs],  # type: ignore[attr-defined]
        "tenants": tenants if tenants is not None else [tenant()],
    }
    return data


def parsed(data: dict, source: str = "") -> config_mod.GatewayConfig:
    return config_mod.parse(data, source)


class Harness:
    def __init__(self, tokenizer, tokenizer_dir) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.threads: list[ServerThread] = []

    def stub(self, node_id: str = "node-a", **kw) -> StubBackend:
        s = StubBackend(node_id, self.tokenizer, **kw)
        t = ServerThread(s.app).start()
        s.url = t.url  # type: ignore[attr-defined]
        s.thread = t  # type: ignore[attr-defined]
        self.threads.append(t)
        return s

    def gateway(self, stubs: list[StubBackend], tenants: list[dict] | None = None, cfg=None, **server) -> ServerThread:
        cfg = cfg or parsed(gateway_config(self.tokenizer_dir, stubs, tenants, **server))
        t = ServerThread(lambda: create_app(cfg), shutdown_timeout=cfg.server.shutdown_grace_s,
                         runner_cls=GatewayRunner).start()
        t.cfg = cfg  # type: ignore[attr-defined]
        self.threads.append(t)
        return t

    def close(self) -> None:
        for t in reversed(self.threads):
            try:
                t.stop()
            except Exception:  # already stopped by the test
                pass


@pytest.fixture
def harness(tokenizer, tokenizer_dir):
    h = Harness(tokenizer, tokenizer_dir)
    yield h
    h.close()


def client(gw: ServerThread, key: str = DEMO_KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


def aclient(gw: ServerThread, key: str = DEMO_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
