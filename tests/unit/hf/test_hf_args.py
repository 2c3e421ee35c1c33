"""``python -m model_providers.glm5.hf``: each numeric option out of its range is one ``error:``
line naming the option and value, before any file is read or written (cli.bad_arguments);
a token array without a row is refused with the shape checks."""

from __future__ import annotations

import numpy as np
import pytest

from model_providers.glm5.hf.cli import main


@pytest.mark.parametrize("argv, line", [
    (["export", "{tmp}/ckpt", "{tmp}/out", "--max-shard-gb", "nan"],  # was int(nan): ValueError
     "error: --max-shard-gb=nan must be a finite number > 0"),
    (["export", "{tmp}/ckpt", "{tmp}/out", "--max-shard-gb", "0"],
     "error: --max-shard-gb=0.0 must be a finite number > 0"),
    (["import", "{tmp}/hf", "{tmp}/out", "--mtp-steps", "-1"],
     "error: --mtp-steps=-1 must be >= 0 (0: no MTP module)"),
    (["loss", "--hf", "{tmp}/hf", "--tokens", "{tmp}/t.npy", "--tp", "0"], "error: --tp=0 must be >= 1"),
    (["loss", "--hf", "{tmp}/hf", "--tokens", "{tmp}/t.npy", "--etp", "-2", "--ep", "0"],
     "error: --ep=0 must be >= 1; --etp=-2 must be >= 1 or null (null: --tp)"),
    (["loss", "--hf", "{tmp}/hf", "--tokens", "{tmp}/empty.npy"],
     "error: --tokens must be a [batch>=1, seq>=2] int array, got shape (0, 4)"),
], ids=["max-shard-nan", "max-shard-zero", "mtp-steps", "tp", "ep-etp", "no-rows"])
def test_bad_numbers_are_one_line_before_any_work(tmp_path, argv, line):
    np.save(tmp_path / "t.npy", np.zeros((2, 4), dtype=np.int64))
    np.save(tmp_path / "empty.npy", np.zeros((0, 4), dtype=np.int64))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in argv])
    assert str(e.value.code) == line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
