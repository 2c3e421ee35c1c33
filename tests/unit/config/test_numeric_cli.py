"""The other entry points refuse a number out of range with one ``error:`` line, in process:
``python -m data_pipeline.prepare`` (the run's config: pretrain/config/numbers.py) exits 1,
``python -m benchmarks.gpu_check`` (its own NUMERIC_ARGS) exits 2; nothing runs before."""

from __future__ import annotations

import pytest


def test_prepare_refuses_a_bad_number_before_any_data(capsys, tmp_path, monkeypatch):
    from data_pipeline.prepare import main

    monkeypatch.chdir(tmp_path)
    code = main(["curriculum=none", f"trainer.run_dir={tmp_path}/run", "optimizer.weight_decay=inf"])
    out, err = capsys.readouterr()
    assert (code, err) == (1, "error: invalid run config: optimizer.weight_decay=inf must be a finite number >= 0\n")
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, line", [
    (["--budget-s", "nan"], "error: --budget-s nan: a positive number of seconds"),  # was: no budget at all
    (["--budget-s", "inf"], "error: --budget-s inf: a positive number of seconds"),
    (["--reps", "0"], "error: --reps 0: at least 1"),
    (["--steps", "1"], "error: --steps 1: at least 2 (the losses must be seen to fall)"),
])
def test_gpu_check_refuses_a_bad_number_before_any_work(capsys, args, line):
    from benchmarks.gpu_check.__main__ import main

    assert main(["--device", "cpu", *args]) == 2
    assert capsys.readouterr().err == line + "\n"
