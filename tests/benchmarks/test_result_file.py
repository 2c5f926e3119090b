import json
import time

from benchmarks.harness.results import run_stamp, write_result


def test_write_result_creates_parents_and_round_trips(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "r.json"
    result = {"bench": "x", "ratio": 1.25, "rows": [1, 2]}
    assert write_result(result, out) == out
    assert json.loads(out.read_text()) == result
    assert out.read_text().endswith("}\n")
    assert json.loads(capsys.readouterr().out) == result


def test_write_result_quiet(tmp_path, capsys):
    write_result({"a": 1}, tmp_path / "r.json", echo=False)
    assert capsys.readouterr().out == ""


def test_run_stamp_names_load_wall_and_command():
    stamp = run_stamp(time.monotonic() - 2.0, (0.5, 0.25, 0.125))
    assert stamp["loadavg_1_5_15_at_start"] == [0.5, 0.25, 0.12]
    assert len(stamp["loadavg_1_5_15_at_end"]) == 3
    assert 2.0 <= stamp["wall_s"] < 60.0
    assert isinstance(stamp["command"], str) and stamp["command"]


def test_interleaved_reverses_the_order_on_odd_rounds():
    from benchmarks.harness.results import interleaved

    assert list(interleaved(["a", "b", "c"], 3)) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                      (2, "a"), (2, "b"), (2, "c")]
    assert list(interleaved(["a"], 0)) == []


def test_percentiles_and_latency_summary():
    from benchmarks.harness.results import latency_summary, percentile

    xs = [i / 1000 for i in range(100, 0, -1)]  # 100..1 ms, unsorted
    assert (percentile(xs, 50), percentile(xs, 99), percentile(xs, 0)) == (0.051, 0.099, 0.001)
    assert percentile([], 50) is None
    assert latency_summary(xs) == {"n": 100, "p50": 51.0, "p90": 90.0, "p99": 99.0, "unit": "ms"}
    assert latency_summary([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "unit": "ms"}
