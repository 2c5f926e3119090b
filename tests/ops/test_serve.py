"""`edgeinfer serve` as a new user runs it: the installed console script, started from a directory that is not
the checkout, in an environment where Hugging Face's `kernels` package is installed (transformers, a test
extra, brings it; it once shadowed our own top-level `kernels`). Its embedded valkey, its children's
lifetimes, its first-start output and a restart that hits the pages the first run published."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time

import pytest
import requests

from tests.gateway.conftest import DEMO_KEY
from tests.ops.launcher import alive
from tests.support.serve import EDGEINFER, QUESTION, Serve, children_of

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # e2e: claims through the public API (a real stack)
def test_hugging_face_kernels_is_installed_beside_us():
    """The condition the first-contact bug needed; the test extra installs it (pyproject)."""
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and "edgeinfer" not in (spec.origin or "")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("edgeinfer-home")


def test_serve_from_elsewhere_runs_the_whole_product_and_a_restart_hits_its_pages(home, tmp_path):
    first = Serve(home, tmp_path)
    try:
        first.wait_for("ready:")
        out = "".join(first.lines)
        assert "page store: embedded valkey on 127.0.0.1:" in out
        assert "page store on: tiers ['redis'], index redis" in out   # no host tier beside valkey
        a, b = first.ask(), first.ask()
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32   # two full pages of the prompt
        status = subprocess.run([str(EDGEINFER), "ops", "status", "--json"], cwd=tmp_path, env=first.env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        nodes = json.loads(status.stdout)
        assert [n["node_id"] for n in nodes] == ["local-0"] and nodes[0]["state"] == "active"
        kids = children_of(first.proc.pid)
        assert len(kids) == 2, kids                                         # valkey and the backend
    finally:
        rc = first.stop()
    assert rc == 0, "".join(first.lines)[-3000:]
    assert not any(alive(p) for p in kids), kids
    assert (home / "valkey" / "pages.rdb").is_file()
    assert not (home / "serve" / "running.json").exists()

    second = Serve(home, tmp_path)          # same home: same valkey data, seed and page key
    try:
        second.wait_for("ready:")
        c = second.ask()
        # a fresh backend: its own prefix cache is empty, so these pages came from the valkey the first run filled
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, c["usage"]
        assert c["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    finally:
        assert second.stop() == 0


def test_a_port_in_use_is_refused_in_one_line_before_anything_loads(home, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
        env["EDGEINFER_HOME"] = str(home)
        r = subprocess.run([str(EDGEINFER), "serve", "--port", str(port)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port} is not free" in lines[0] and "--port" in lines[0], lines


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_first_start_stops_every_child(tmp_path, sig):
    serve = Serve(tmp_path / "home", tmp_path)
    try:
        serve.wait_for("starting the backend")
        deadline = time.monotonic() + 30
        while len(children_of(serve.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = children_of(serve.proc.pid)
        assert len(kids) == 2, kids
    finally:
        rc = serve.stop(sig)
    assert rc == 128 + sig, "".join(serve.lines)[-2000:]
    assert "stopped by" in "".join(serve.lines)
    assert not any(alive(p) for p in kids), kids


def test_ctrl_c_after_long_prompts_and_schemas_prints_no_traceback(home, tmp_path):
    """Issue 54, item 8: once the gateway's worker pools ran (a prompt over 8,192 characters: the tokenizer pool; a
    json_schema: the schema-check pool), Ctrl-C (SIGINT to the terminal's whole foreground group) printed ~20
    lines of KeyboardInterrupt traceback per worker. The workers ignore SIGINT; serve stops as on any Ctrl-C."""
    serve = Serve(home, tmp_path, "--no-page-store", terminal_group=True)
    try:
        serve.wait_for("ready:")
        _ask(serve, [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps. " * 400}])
        r = requests.post(f"http://127.0.0.1:{serve.port}/v1/chat/completions", timeout=180,
                          headers={"authorization": f"Bearer {DEMO_KEY}"},
                          json={"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
                                "messages": [{"role": "user", "content": "A city as JSON."}],
                                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                                    "type": "object", "properties": {"name": {"type": "string"}},
                                    "required": ["name"]}}}})
        assert r.status_code == 200, r.text
        workers = [p for p in children_of(serve.proc.pid)]
        assert len(workers) >= 3, workers          # the backend and at least one worker of each pool
        os.killpg(serve.proc.pid, signal.SIGINT)
        rc = serve.proc.wait(timeout=90)
    finally:
        serve.stop()
    out = "".join(serve.lines)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert rc in (0, 128 + signal.SIGINT), out[-2000:]


LONG = [{"role": "user", "content": "Here is a ship's log. " + "Day 3: wind from the north, we sailed past two "
         "islands and counted forty gulls; the cook burned the bread again and the captain laughed. " * 14
         + "On which day was the log written? Answer in a few words."}]


def _ask(serve: Serve, messages: list[dict]) -> dict:
    r = requests.post(f"http://127.0.0.1:{serve.port}/v1/chat/completions", timeout=180,
                      headers={"authorization": f"Bearer {DEMO_KEY}"},
                      json={"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 16, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_disaggregated_serve_answers_as_a_colocated_one(tmp_path_factory, tmp_path):
    """`edgeinfer serve --prefill-nodes 1 --decode-nodes 1`: the README's question (short: the decode node prefills
    it itself) and a ~500-token prompt (two hops: prefilled on the prefill node, its pages handed to the decode
    node) give the colocated deployment's greedy answers; `ops status` shows each node's role."""
    answers = {}
    colocated = Serve(tmp_path_factory.mktemp("home-colocated"), tmp_path)
    try:
        colocated.wait_for("ready:")
        answers["colocated"] = [_ask(colocated, m)["choices"][0]["message"]["content"] for m in (QUESTION, LONG)]
    finally:
        assert colocated.stop() == 0
    split = Serve(tmp_path_factory.mktemp("home-split"), tmp_path, "--prefill-nodes", "1", "--decode-nodes", "1")
    try:
        split.wait_for("ready:")
        got = [_ask(split, m) for m in (QUESTION, LONG)]
        answers["disaggregated"] = [g["choices"][0]["message"]["content"] for g in got]
        assert got[1]["usage"]["prompt_tokens"] > 400
        metrics = requests.get(f"http://127.0.0.1:{split.port}/metrics", timeout=10).text
        assert 'edgeinfer_gateway_disaggregated_requests_total{model="SmolLM2-135M-Instruct",outcome="handed_off"} ' \
               '1.0' in metrics
        assert 'outcome="skipped_short"} 1.0' in metrics
        status = subprocess.run([str(EDGEINFER), "ops", "status", "--json"], cwd=tmp_path, env=split.env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        roles = {n["node_id"]: n["role"] for n in json.loads(status.stdout)}
        assert roles == {"local-prefill-0": "prefill", "local-decode-0": "decode"}
        assert len(children_of(split.proc.pid)) == 3     # valkey, the prefill node, the decode node
    finally:
        assert split.stop() == 0, "".join(split.lines)[-3000:]
    assert answers["disaggregated"] == answers["colocated"]
    assert "Paris" in answers["colocated"][0]
