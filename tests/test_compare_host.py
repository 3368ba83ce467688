"""benchmarks/compare_host.py: issue 26's before / after table from several runs of two trees."""

from __future__ import annotations

import json

import compare_host
import pytest

CAPTURED = compare_host.CAPTURED


def _row(batch, host, propose, replay=0.5, weights=None, variant=CAPTURED):
    row = {"batch": batch, "k": 1, "variant": variant, "host_us": host, "propose_ms": propose, "replay_ms": replay}
    if weights is not None:
        row["weights"] = weights
    return row


def _run(folder, rows):
    folder.mkdir()
    (folder / "bench_draft_flash.json").write_text(json.dumps({"device": "x", "rows": rows}))
    return folder


def test_the_quietest_run_of_each_tree_is_compared(tmp_path, capsys):
    """The best run is the one with the lowest host time, chosen the same way for both trees; rows of
    other weights and the eager rows are left out; a tree without a weights key counts as bf16."""
    before = [_run(tmp_path / "before", [_row(32, 80.0, 0.70), _row(32, 1.0, 9.0, variant="eager")]),
              _run(tmp_path / "before_2", [_row(32, 41.0, 0.66)])]
    after = [_run(tmp_path / "draft", [_row(32, 70.0, 0.62, weights="bf16"), _row(32, 5.0, 0.51, weights="native")]),
             _run(tmp_path / "draft_2", [_row(32, 38.0, 0.57, weights="bf16"), _row(1, 30.0, 0.56, weights="bf16")])]
    compare_host.main(["--before", *map(str, before), "--after", *map(str, after)])
    lines = capsys.readouterr().out.splitlines()
    rows = {(line.split()[0], line.split()[2]): line.split() for line in lines[2:]}
    assert rows[("32", "before")][3:8] == ["2", "0.500", "0.660", "160", "41"]
    assert rows[("32", "after")][3:8] == ["2", "0.500", "0.570", "70", "38"]
    assert " ".join(rows[("32", "after")]).endswith("(70 38) host meets 40, wait meets 80")
    assert " ".join(rows[("1", "after")]).endswith("(30) host misses 25, wait misses 50")
    assert " ".join(rows[("32", "before")]).endswith("(80 41)")  # no verdict for the older tree


def test_a_folder_without_one_run_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="expected one bench_draft_\\*.json, found 0"):
        compare_host.load_rows(tmp_path / "empty", "bf16")
