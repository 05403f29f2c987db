import json
import sys

import pytest

from conveyor.bench.client import RequestRecord
from conveyor.bench.report import levels_payload, markdown_table, write_json, write_plot
from conveyor.bench.roofline import Roofline
from conveyor.bench.stats import compute_level_stats


def _levels():
    ok = RequestRecord(start_s=0.0, end_s=0.3, chunk_times_s=[0.1, 0.2, 0.3], num_output_tokens=3)
    return [compute_level_stats([ok], 1.0, 1),
            compute_level_stats([ok, ok, RequestRecord(0.0, 0.1, error="HTTP 503: busy")], 1.0, 4)]


def test_markdown_has_a_row_per_level_and_errors():
    table = markdown_table(_levels(), title="t")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # header + 2 levels
    assert rows[1].startswith("| 1 | 1 | 0 |") and rows[2].startswith("| 4 | 3 | 1 |")
    assert "HTTP 503: busy" in table and "roofline" not in table


def test_roofline_column():
    roofline = Roofline(gflops=60.0, gflops_per_token=0.27)  # 222 tok/s bound
    table = markdown_table(_levels(), roofline)
    assert "% roofline" in table and "1.4%" in table  # 3 tok/s of 222
    assert "GFLOP/s" in markdown_table(_levels(), Roofline(60.0, None, measured=True))


def test_json_round_trip_with_nan_as_null(tmp_path):
    levels = _levels()
    levels.append(compute_level_stats([RequestRecord(0.0, 0.1, error="x")], 1.0, 8))
    path = tmp_path / "out.json"
    write_json(path, {"config": {"url": "u"}, **levels_payload(levels, Roofline(10.0, 1.0))})
    data = json.loads(path.read_text())
    assert [lvl["concurrency"] for lvl in data["levels"]] == [1, 4, 8]
    assert data["levels"][2]["ttft_ms"]["p50"] is None
    assert data["levels"][0]["roofline_fraction"] == pytest.approx(0.3)
    assert data["roofline"]["max_tok_s"] == 10.0


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(RuntimeError, match="pip install"):
        write_plot(tmp_path / "p.png", _levels())


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_plot(tmp_path / "p.png", _levels(), title="t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
