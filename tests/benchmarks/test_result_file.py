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
