"""The autoscaling signal (docs/OPERATIONS.md "Autoscaling"): each backend's gauges (queued prefill tokens, KV usage,
TTFT estimate) and the gateway's per-pool gauges built from its nodes' /ready answers, with the load ratio an HPA
targets at 1."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.gateway.metrics import Metrics
from edgeinfer.gateway.nodes import Node, _read_load
from edgeinfer.protocol.wire import BackendInfo
from tests.support.engine_steps import Stepper, engine
from tests.support.tiny import prompt


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def node(node_id: str, role: str, kv: float, queued: int, wait: float | None) -> Node:
    n = Node(node_id, f"http://{node_id}", "m")
    n.info = BackendInfo(node_id, "m", "fp", "fp8", 16, 4096, "v", "active", role)
    body = (f'{{"kv_pages_used": {int(kv * 100)}, "kv_pages_total": 100, "prefill_tokens_queued": {queued}, '
            f'"queue_wait_s": {"null" if wait is None else wait}}}').encode()
    _read_load(n, body)
    return n


def test_pool_gauges_sum_and_average_per_model_and_role():
    m = Metrics()
    nodes = [node("d0", "decode", 0.5, 100, 1.0), node("d1", "decode", 0.9, 300, 3.0),
             node("p0", "prefill", 0.2, 5000, 4.0), node("b0", "both", 0.1, 0, None)]
    assert nodes[3].ttft_estimate_s == 0.0 and nodes[1].ttft_estimate_s == 3.0
    m.set_pools(nodes, kv_target=0.8, ttft_target_s=2.0)
    got = samples(m.render(False))
    dec = (("model", "m"), ("role", "decode"))
    assert got[("edgeinfer_gateway_pool_nodes", dec)] == 2
    assert got[("edgeinfer_gateway_pool_prefill_tokens_queued", dec)] == 400
    assert abs(got[("edgeinfer_gateway_pool_kv_usage_ratio", dec)] - 0.7) < 1e-9
    assert got[("edgeinfer_gateway_pool_ttft_estimate_seconds", dec)] == 2.0
    assert got[("edgeinfer_gateway_pool_load_ratio", dec)] == 1.0          # max(0.7 / 0.8, 2.0 / 2.0)
    pre = (("model", "m"), ("role", "prefill"))
    assert got[("edgeinfer_gateway_pool_load_ratio", pre)] == 2.0           # its queue: 4 s against 2 s
    both = (("model", "m"), ("role", "both"))
    assert got[("edgeinfer_gateway_pool_load_ratio", both)] == 0.125
    m.set_pools(nodes[:2], kv_target=0.8, ttft_target_s=2.0)                # the prefill pool lost its node
    assert samples(m.render(False))[("edgeinfer_gateway_pool_nodes", pre)] == 0


def test_each_backend_reports_its_own_signal(tmp_path):
    from edgeinfer.backend.model.loader import load_model
    from tests.support.tiny import tiny_llama

    eng = engine(load_model(tiny_llama(tmp_path / "t")), kv_dtype="fp32", num_pages=32, max_num_batched_tokens=32)
    m = BackendMetrics("tiny")
    eng.observers.append(m)
    s = Stepper(eng)
    for i in range(3):
        s.add(f"r{i}", prompt(i, 60), 4)
    s.step()                            # one 32-token chunk of 180 prompt tokens computed
    got = samples(generate_latest(m.registry))
    lab = (("model", "tiny"),)
    assert got[("edgeinfer_backend_prefill_tokens_queued", lab)] == 180 - 32
    assert 0 < got[("edgeinfer_backend_kv_usage_ratio", lab)] <= 1
    assert got[("edgeinfer_backend_ttft_estimate_seconds", lab)] >= 0
    s.run()
    got = samples(generate_latest(m.registry))
    assert got[("edgeinfer_backend_prefill_tokens_queued", lab)] == 0
    assert got[("edgeinfer_backend_kv_usage_ratio", lab)] == 0
