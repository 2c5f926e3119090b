"""`edgeinfer backend --tensor-parallel 2` as a real node: it answers what one process answers, its pages (every
rank's KV heads in one body) hit on a one-process node of the same model, and a rank that dies takes the node
down: the server exits and no request hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.backend.page_store.test_bridge import SEED, Backend, random_prompt
from tests.conftest import wait_until
from tests.support import moe_checkpoints
from tests.support.backend_process import BackendProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_dir(smol_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-llama")
    moe_checkpoints.servable_llama(d, smol_dir)
    return d


class Node(Backend):
    def __init__(self, model_dir, node_id: str, redis_url: str, log_dir, *extra: str) -> None:
        BackendProcess.__init__(self, model_dir, node_id, ["--redis-url", redis_url, "--num-pages", "200",
                                                           "--heartbeat", "0.5", "--store-fetch-timeout", "3", *extra],
                                SEED, log_dir / f"{node_id}.log")


def children(pid: int) -> list[int]:
    from tests.support.serve import children_of

    return children_of(pid)


def test_a_tp2_node_answers_as_one_process_and_its_pages_hit_on_a_tp1_node(llama_dir, valkey, tmp_path):
    if valkey.proc is None:
        valkey.start()
    tp2 = Node(llama_dir, "tp2", valkey.url, tmp_path, "--tensor-parallel", "2")
    tp1 = Node(llama_dir, "tp1", valkey.url, tmp_path)
    try:
        tp2.wait_ready(180)
        tp1.wait_ready(180)
        assert len(children(tp2.proc.pid)) == 1                    # rank 1
        prompt = random_prompt(3, 100)
        a, usage = tp2.generate(prompt, "ns-tp", 12)
        assert usage["cached_tokens"] == 0
        wait_until(lambda: tp2.published() >= 6, 30)
        b, usage = tp1.generate(prompt, "ns-tp", 12)                # pages from the TP=2 node
        assert usage["cached_tokens"] >= 96 and b == a
        c, usage = tp1.generate(random_prompt(4, 100), "ns-other", 12)
        d, usage2 = tp2.generate(random_prompt(4, 100), "ns-other", 12)   # and the other way round
        assert usage2["cached_tokens"] >= 96 and c == d
        # a rank dies: the node stops by itself (the gateway then sees it fail its probes)
        rank1 = children(tp2.proc.pid)[0]
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while tp2.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tp2.proc.poll() is not None, "the node outlived its dead rank"
        with pytest.raises(requests.ConnectionError):
            requests.get(tp2.url + "/health", timeout=2)
    finally:
        tp2.stop()
        tp1.stop()
