"""Decode CUDA graphs (backend/engine/cuda_graphs.py), the parts that run without a GPU: bucketing, padding,
the static buffers and their reuse across steps and buckets, driven through the real engine on a tiny random
Llama with EagerCapture standing in for torch.cuda.CUDAGraph (which cannot run on CPU). Plus the host-side
step inputs that keep the CUDA step free of device syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeinfer import kernels
from edgeinfer.backend.engine import cuda_graphs as cg
from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.model_runner import ModelRunner
from edgeinfer.backend.model.loader import load_model
from tests.support.engine_steps import generate_together
from tests.support.tiny import tiny_llama


def test_buckets_cover_every_batch_size_up_to_the_limit():
    assert cg.decode_buckets(1) == (1,)
    assert cg.decode_buckets(3) == (1, 2, 4)
    assert cg.decode_buckets(8) == (1, 2, 4, 8)
    assert cg.decode_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert cg.decode_buckets(64)[-3:] == (48, 56, 64)
    for limit in (1, 5, 9, 33, 64):
        buckets = cg.decode_buckets(limit)
        assert list(buckets) == sorted(set(buckets))
        for n in range(1, limit + 1):
            b = cg.pick_bucket(n, buckets)
            assert b is not None and b >= n and all(x < n for x in buckets if x < b)
    assert cg.pick_bucket(65, cg.decode_buckets(64)) is None
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        cg.decode_buckets(0)
    with pytest.raises(ValueError, match="n=0"):
        cg.pick_bucket(0, (1, 2))


def test_padding_rows_write_no_kv_and_read_no_pages():
    stage = np.array([[5, 6, 7], [10, 11, 12], [33, 34, 35], [11, 12, 13]], dtype=np.int64)
    buf = np.full((4, 8), 99, dtype=np.int64)   # stale values from an earlier, larger step
    out = cg.pad_rows(stage, 4, buf)
    assert out.shape == (4, 4) and np.shares_memory(out, buf)
    assert out[:, :3].tolist() == stage.tolist()
    assert out[:, 3].tolist() == [0, 0, cg.PAD_SLOT, cg.PAD_CONTEXT] == [0, 0, -1, 0]
    with pytest.raises(ValueError, match=r"does not fit \[4, 2\]"):
        cg.pad_rows(stage, 2)


def test_env_flag(monkeypatch):
    monkeypatch.setenv(cg.GRAPHS_ENV, "0")
    assert cg.graphs_env() is False
    monkeypatch.setenv(cg.GRAPHS_ENV, "yes")
    with pytest.raises(ValueError, match="EDGEINFER_CUDA_GRAPHS='yes'; expected 0 or 1"):
        cg.graphs_env()


def test_graphs_are_off_on_cpu(tiny_model):
    assert ModelRunner(tiny_model, EngineConfig(num_pages=32, max_num_seqs=4)).graphs is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(tiny_llama(tmp_path_factory.mktemp("tiny"), max_position=256))


def _generate(eng: LLMEngine, lengths: list[int], max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
    prompts = [torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate(lengths)]
    return [(ids, lps) for ids, lps, _ in generate_together(eng, prompts, "t", max_tokens)]


def _engine(model, graphs: bool) -> LLMEngine:
    eng = LLMEngine(model, None, EngineConfig(num_pages=64, max_num_seqs=6, max_num_batched_tokens=64,
                                              enable_prefix_cache=False))
    if graphs:
        r = eng.runner
        r.graphs = cg.DecodeGraphs(model, r.kv, cg.decode_buckets(6), r.tables.array.shape[1], cg.EagerCapture)
    return eng


def test_graph_replays_match_eager_steps_across_buckets(tiny_model, monkeypatch):
    # 5 sequences finishing at different steps: decode batches of 5, 4, 3, 2, 1 -> buckets 8, 4, 4, 2, 1,
    # each replay over static buffers still holding a larger step's rows
    lengths, max_tokens = [7, 19, 33, 4, 12], [3, 9, 6, 12, 5]
    eager = _generate(_engine(tiny_model, False), lengths, max_tokens)
    monkeypatch.setattr(cg.EagerCapture, "captures", 0)
    monkeypatch.setattr(cg.EagerCapture, "replays", 0)
    eng = _engine(tiny_model, True)
    graphed = _generate(eng, lengths, max_tokens)
    assert sorted(eng.runner.graphs.graphs) == [1, 2, 4, 8]
    assert cg.EagerCapture.captures == 4
    assert cg.EagerCapture.replays >= 10   # every decode-only step replayed
    for (ids_e, lps_e), (ids_g, lps_g), m in zip(eager, graphed, max_tokens):
        assert len(ids_g) == m
        assert ids_g == ids_e
        np.testing.assert_allclose(lps_g, lps_e, rtol=0, atol=1e-4)


def test_padding_leaves_the_kv_pool_as_eager_steps_leave_it(tiny_model):
    lengths, max_tokens = [9, 21, 5], [6, 4, 8]
    pools = []
    for graphs in (False, True):
        eng = _engine(tiny_model, graphs)
        _generate(eng, lengths, max_tokens)
        pools.append(torch.stack([torch.stack((kv.k, kv.v)) for kv in eng.runner.kv]))
    eager, graphed = pools
    written = eager.flatten(3).abs().amax(-1) > 0           # [layers, 2, pages, page_size] slots holding a row
    assert torch.equal(written, graphed.flatten(3).abs().amax(-1) > 0)   # no slot more, none less
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-5)


def test_steps_that_do_not_fit_run_eagerly(tiny_model):
    r = _engine(tiny_model, True).runner
    g = r.graphs
    assert g.buckets[-1] == 8
    stage = np.zeros((4, 9), dtype=np.int64)
    assert g.run(stage, np.zeros((9, 1), dtype=np.int32)) is None                  # more than the largest bucket
    assert g.run(stage[:, :2], np.zeros((2, g.width + 1), dtype=np.int32)) is None  # wider tables
    assert g.graphs == {}


def test_prefill_kernel_gets_its_grid_size_from_the_host(tiny_model, monkeypatch):
    """The Triton prefill launcher syncs on the device to find the longest chunk unless max_seqlen_q is passed."""
    seen = []
    real = kernels.paged_prefill_attention

    def spy(*args, max_seqlen_q=None, **kw):
        seen.append(max_seqlen_q)
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "paged_prefill_attention", spy)
    monkeypatch.setattr(tiny_model, "step_ops", None)   # the module path, as on CUDA (the CPU ops prefill in C++)
    _generate(_engine(tiny_model, False), [11, 30], [1, 1])
    assert seen and all(m == 30 for m in seen)   # one step: both prompts, chunks of 11 and 30
