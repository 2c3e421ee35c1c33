"""metrics.jsonl after a kill mid-write: the torn last line is cut on resume with a warning, and
readers name the file and line of anything they cannot parse (issue 17, case 3)."""

from __future__ import annotations

import json

import pytest

from pretrain.reporting import jsonl
def _write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


@pytest.mark.parametrize("tail", [b'{"step": 4, "lo', b"\x00\x00\x00\x00\n"])
def test_a_torn_last_line_is_cut_and_the_rest_kept(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    _write(path, records, tail)
    with pytest.raises(jsonl.JsonlError, match=rf"{path}, line 4: not a JSON record"):
        jsonl.read(str(path))
    warning = jsonl.repair(str(path))
    assert warning.startswith(f"{path}: cut a torn last record (line 4, ") and "3 complete records kept" in warning
    assert jsonl.read(str(path)) == records
    assert jsonl.repair(str(path)) is None  # whole now
    with open(path, "a") as f:  # appending goes on after the cut
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    assert [r["step"] for r in jsonl.read(str(path))] == [1, 2, 3, 4]


def test_a_complete_last_record_that_lost_its_newline_is_kept_and_terminated(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1}], b'{"step": 2}')
    assert jsonl.repair(str(path)) == (f"{path}: terminated the last record (line 2), whose newline an "
                                       f"interrupted write lost")
    with open(path, "a") as f:
        f.write('{"step": 3}\n')
    assert jsonl.read(str(path)) == [{"step": 1}, {"step": 2}, {"step": 3}]


def test_damage_before_the_last_line_is_named_not_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    before = path.read_bytes()
    with pytest.raises(jsonl.JsonlError, match=rf"{path}, line 2: not a JSON record"):
        jsonl.repair(str(path))
    assert path.read_bytes() == before
    path.write_bytes(b'{"step": 1}\n[1, 2]\n')
    with pytest.raises(jsonl.JsonlError, match=rf"{path}, line 2: a JSON list, not a record"):
        jsonl.read(str(path))


def test_missing_and_whole_files(tmp_path):
    assert jsonl.read(str(tmp_path / "absent.jsonl")) == [] and jsonl.repair(str(tmp_path / "absent")) is None
    path = tmp_path / "m.jsonl"
    _write(path, [{"step": 1}], b"\n\n")
    assert jsonl.repair(str(path)) is None and jsonl.read(str(path)) == [{"step": 1}]
