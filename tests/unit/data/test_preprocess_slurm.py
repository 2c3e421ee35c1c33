"""``executor=slurm`` through the CLI: DataTrove submits an array job (one task per shard) and a
dependent finalize job. With stand-ins for ``sbatch``/``scontrol`` the submitted tasks are then
run the way Slurm would (``launch_pickled_pipeline`` with ``SLURM_ARRAY_TASK_ID``); the output
only appears after the finalize job and holds the same tokens as a local run."""

from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys

import pytest

from data_pipeline.config import DataConfigError
from data_pipeline.preprocess import prepare
from tests.support.data import REPO, corpus_cfg, read_docs, tokenizer_path, write_jsonl

SBATCH = """#!/bin/bash
n=$(ls "$SBATCH_LOG" | grep -c '\\.sh$')
cp "${@: -1}" "$SBATCH_LOG/job_$n.sh"
echo "$@" > "$SBATCH_LOG/job_$n.args"
echo "Submitted batch job $((100 + n))"
"""


def _tool(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _env(bin_dir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(env, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONWARNINGS="ignore", **extra)


@pytest.mark.heavy
def test_slurm_array_job_builds_the_same_shards(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "sbatch"
    bin_dir.mkdir()
    log.mkdir()
    _tool(bin_dir / "sbatch", SBATCH)
    _tool(bin_dir / "scontrol", "#!/bin/bash\necho localhost\n")
    texts = [f"record {i} " + "abc " * (i % 11) for i in range(120)]
    f = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    cache = tmp_path / "cache"
    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True)
    (conf / "tiny.yaml").write_text(
        f"cache_dir: {cache}\ntokenizer: {{path: {tokenizer_path()}}}\ncorpora:\n  c: {{paths: [{f}]}}\n"
        "mixtures:\n  default: {c: 1.0}\n")
    cli = [sys.executable, "-m", "data_pipeline.preprocess", "data=tiny",
           f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data.preprocess.executor=slurm",
           "data.preprocess.tasks=2", "data.preprocess.slurm.partition=cpu-small"]
    proc = subprocess.run(cli, cwd=REPO, env=_env(bin_dir, SBATCH_LOG=str(log)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"c": None}  # submitted, not built

    scripts = {p: open(p).read() for p in sorted(glob.glob(str(log / "job_*.sh")))}
    pipelines = {p: s for p, s in scripts.items() if "launch_pickled_pipeline" in s}  # (+ merge_stats jobs)
    tokenize = [s for s in pipelines.values() if "#SBATCH --job-name=tokenize-c" in s]
    finalize = [p for p, s in pipelines.items() if "#SBATCH --job-name=finalize-c" in s]
    assert len(tokenize) == 1 and "#SBATCH --array=0-1" in tokenize[0] and "#SBATCH --partition=cpu-small" in tokenize[0]
    assert len(finalize) == 1
    assert "--dependency=afterok:100" in (log / os.path.basename(finalize[0]).replace(".sh", ".args")).read_text()

    cfg = corpus_cfg(cache, [f], tasks=2)
    cfg.preprocess.executor = "slurm"
    with pytest.raises(DataConfigError, match="is not preprocessed .* run `python -m data_pipeline.preprocess` first"):
        prepare(cfg)

    logs = glob.glob(str(cache / "indexed" / "logs" / "c-*"))
    assert len(logs) == 1
    run = lambda job, task: subprocess.Popen(  # noqa: E731  (what srun runs inside each array task)
        [os.path.join(os.path.dirname(sys.executable), "launch_pickled_pipeline"),
         os.path.join(logs[0], job, "executor.pik")], cwd=REPO,
        env=_env(bin_dir, SLURM_ARRAY_TASK_ID=str(task), SLURM_NODELIST="localhost"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tasks = [run("tokenize", 0), run("tokenize", 1)]
    for t in tasks:
        assert t.wait(timeout=300) == 0, t.stderr.read()[-3000:]
    with pytest.raises(DataConfigError):
        prepare(cfg)  # every shard written, still not complete before the finalize job
    fin = run("finalize", 0)
    assert fin.wait(timeout=300) == 0, fin.stderr.read()[-3000:]

    out = prepare(cfg)["c"]
    assert len(out.prefixes) == 2 and out.stats["documents"] == 120
    local = prepare(corpus_cfg(tmp_path / "local", [f], tasks=2))["c"]
    assert read_docs(out.prefixes) == read_docs(local.prefixes)
    assert [len(read_docs([p])) for p in out.prefixes] == [len(read_docs([p])) for p in local.prefixes]
