"""End to end with the real backend (backend.server subprocesses) on the real SmolLM2-135M model:
the openai client through the gateway, a two-node routing test, and `edgeinfer serve`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

from tests.gateway.conftest import DEMO_KEY, aclient, client, parsed, tenant
from tests.support.backend_process import INTERNAL_AUTH, INTERNAL_SECRET, BackendProcess
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # e2e: claims through the public API (a real stack)
SEED = "real-backend-test-seed"


class Backend(BackendProcess):
    def __init__(self, model_dir, node_id: str) -> None:
        super().__init__(model_dir, node_id, ["--max-num-seqs", "4", "--kv-cache-bytes", str(64 << 20)], SEED)

    def prompt_tokens(self) -> float:
        return self.metric("edgeinfer_backend_prompt_tokens_total")


@pytest.fixture(scope="module")
def model_dir():
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def backends(model_dir):
    nodes = [Backend(model_dir, "real-a"), Backend(model_dir, "real-b")]
    try:
        for b in nodes:
            b.wait_ready()
        yield nodes
    finally:
        for b in nodes:
            b.stop()


def real_gateway(harness, model_dir, nodes):
    name = requests.get(nodes[0].url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["model"]
    cfg = parsed({"server": {"page_seed": SEED, "health_interval_s": 0.5, "internal_secret": INTERNAL_SECRET},
                  "models": [{"name": name, "tokenizer": str(model_dir)}],
                  "nodes": [{"id": b.node_id, "url": b.url, "model": name} for b in nodes],
                  "tenants": [tenant()]})
    return harness.gateway([], cfg=cfg), name


async def test_openai_client_against_real_backend(harness, model_dir, backends):
    gw, name = real_gateway(harness, model_dir, backends[:1])
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    r = client(gw).chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content.strip() and r.usage.completion_tokens <= 8
    assert r.choices[0].finish_reason in ("stop", "length")
    again = client(gw).chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy is deterministic
    c = aclient(gw)
    stream = await c.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    comp = await c.completions.create(model=name, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, logprobs=2)
    assert comp.choices[0].text and len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
    await c.close()


def test_the_kv_format_is_the_most_compact_one_within_the_measured_budget(backends):
    """A default-started node (--kv-dtype auto) reports how its KV format was chosen: each candidate measured
    against fp32 KV, the most compact within the budget served. On SmolLM2 that is int8 (rotated K): fp8 e4m3 is
    the same bytes and measured several times its KL divergence (issue 55)."""
    from edgeinfer.backend.quant.kv_gate import FormatCost, pick

    info = requests.get(backends[0].url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()
    gate = info["kv_gate"]
    assert gate["requested"] == "auto" and gate["budget_kld"] == 0.002
    measured = {k: FormatCost(**v) for k, v in gate["measured"].items()}
    assert set(measured) == {"int8", "fp8_e4m3", "bf16"}
    assert gate["served"] == pick(measured, gate["budget_kld"]) == "int8"
    assert info["kv_format"] == measured["int8"].ident == "int8_hadamard"
    assert 0 < measured["bf16"].kld_mean < measured["int8"].kld_mean <= 0.002 < measured["fp8_e4m3"].kld_mean
    # 30 layers x 3 kv heads x 64 dims, K and V: 1 byte + a bf16 scale per token-head against 2 bytes per value
    assert (measured["int8"].bytes_per_token, measured["bf16"].bytes_per_token) == (2 * 30 * 3 * 66, 2 * 30 * 3 * 128)


def test_second_turn_routes_to_prefix_holder_and_reports_cached_tokens(harness, model_dir, backends):
    gw, name = real_gateway(harness, model_dir, backends)
    c = client(gw)
    system = ("You are a helpful assistant for a hardware store. You answer questions about tools, paint, "
              "garden supplies and plumbing parts. Keep answers short and friendly.")
    convo = [{"role": "system", "content": system}, {"role": "user", "content": "Do you sell hammers?"}]
    before = {b.node_id: b.prompt_tokens() for b in backends}
    t1 = c.chat.completions.create(model=name, messages=convo, max_tokens=12, temperature=0)
    grew = [b for b in backends if b.prompt_tokens() > before[b.node_id]]
    assert len(grew) == 1
    holder = grew[0]
    convo += [{"role": "assistant", "content": t1.choices[0].message.content},
              {"role": "user", "content": "And nails?"}]
    mid = {b.node_id: b.prompt_tokens() for b in backends}
    t2 = c.chat.completions.create(model=name, messages=convo, max_tokens=8, temperature=0)
    assert holder.prompt_tokens() > mid[holder.node_id]
    assert all(b.prompt_tokens() == mid[b.node_id] for b in backends if b is not holder)
    assert t2.usage.prompt_tokens_details.cached_tokens >= 48  # at least the system prompt's pages
    m = requests.get(gw.url + "/metrics", timeout=5).text
    assert re.search(r'edgeinfer_gateway_routing_decisions_total\{decision="prefix",model="[^"]+"\} 1\.0', m)


def test_edgeinfer_serve_runs_gateway_and_backend(tmp_path):
    port, backend_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "EDGEINFER_INTERNAL_SECRET"}
    env["EDGEINFER_HOME"] = str(tmp_path)    # its valkey's data and secrets, not the user's
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer.ops.cli", "serve", "--port", str(port),
                             "--backend-port", str(backend_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            if "ready:" in line:
                break
        assert f"http://127.0.0.1:{port}/v1" in lines[-1] and DEMO_KEY in lines[-1]
        model = re.search(r"model=(\S+)", lines[-1]).group(1)
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {DEMO_KEY}"},
                          json={"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        # serve made up an internal secret and gave it to both: the backend refuses anyone else
        direct = requests.post(f"http://127.0.0.1:{backend_port}/internal/generate", timeout=10,
                               json={"request_id": "x", "prompt_token_ids": [1, 2, 3], "cache_namespace": "t"})
        assert direct.status_code == 401, direct.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-nope", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
