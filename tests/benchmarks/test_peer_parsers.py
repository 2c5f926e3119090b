"""bench_peers' pure parts: parsing llama.cpp's tools (on output captured from the real binaries, built from
llama-cpp-python 0.3.36's vendored llama.cpp, commit 0c1e570) and the load generator's rate arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness.llamacpp import parse_batched_bench, parse_llama_bench
from benchmarks.harness.load import Shot, check, decode_tok_s, prefill_tok_s, ttft_p50_ms

DATA = Path(__file__).parent / "data"


def test_llama_bench_json_rows():
    rows = parse_llama_bench((DATA / "llama_bench_pp64_tg8.json").read_text())
    assert [r["test"] for r in rows] == ["pp64", "tg8"]
    assert rows[0]["tok_s"] == pytest.approx(11.940785)
    assert rows[1]["tok_s"] == pytest.approx(7.567195)
    assert rows[0]["build_commit"] == "0c1e570" and rows[1]["threads"] == 1


def test_llama_bench_garbage_names_the_output():
    with pytest.raises(ValueError, match="no JSON array"):
        parse_llama_bench("error: failed to load model\n")


def test_batched_bench_table_rows():
    rows = parse_batched_bench((DATA / "llama_batched_bench_npp16_ntg4.txt").read_text())
    assert [(r["pp"], r["tg"], r["batch"], r["n_kv"]) for r in rows] == [(16, 4, 1, 20), (16, 4, 2, 40)]
    assert rows[0]["prefill_tok_s"] == pytest.approx(9.67) and rows[0]["decode_tok_s"] == pytest.approx(4.89)
    assert rows[1]["decode_tok_s"] == pytest.approx(6.02) and rows[1]["total_tok_s"] == pytest.approx(7.62)


def test_batched_bench_without_table_raises():
    with pytest.raises(ValueError, match="no llama-batched-bench table"):
        parse_batched_bench("main: n_kv_max = 512\n")


def _shot(send, first, last, tokens=11, prompt=None):
    return Shot(send, first, last, tokens, prompt, "length")


def test_decode_rate_of_a_batching_server_is_the_sum():
    # 4 sequences decoding side by side, 10 tokens each after the first, over the same 2 s: 20 tok/s
    shots = [_shot(0.0, 1.0, 3.0) for _ in range(4)]
    assert decode_tok_s(shots) == pytest.approx(20.0)


def test_decode_rate_of_a_serialising_server_is_one_sequence():
    # one after the other, each 10 tokens in 2 s: the window holds only the last one, 5 tok/s
    shots = [_shot(0.0, 1.0 + 2 * i, 3.0 + 2 * i) for i in range(4)]
    assert decode_tok_s(shots) == pytest.approx(5.0)


def test_prefill_rate_waits_for_the_last_first_token():
    shots = [_shot(0.0, 0.5, 0.5, 1, 512), _shot(0.0, 2.0, 2.0, 1, 512)]
    assert prefill_tok_s(shots, 512) == pytest.approx(512.0)
    assert ttft_p50_ms(shots) == pytest.approx(1250.0)
    assert prefill_tok_s([*shots, Shot(0.0, None, None, 0, None, None, "HTTP 503")], 512) is None


def test_check_flags_errors_and_short_answers():
    good = _shot(0.0, 1.0, 2.0, 16)
    short = Shot(0.0, 1.0, 2.0, 7, None, "stop")
    assert check([good], 16) == []
    assert check([good, short, Shot(0.0, None, None, 0, None, None, "HTTP 429: slow down")], 16) == [
        "HTTP 429: slow down", "7 tokens (finish stop), expected 16"]
