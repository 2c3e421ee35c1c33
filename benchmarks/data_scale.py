"""Scale rehearsal of the data pipeline (issue 16): GLM-5's recipe through the run's own dataset
construction at 0.01%, 0.1% and 1% of every stage, fitted and extrapolated to 100%.

    .venv/bin/python benchmarks/data_scale.py [--scales 0.0001 0.001 0.01] [--work DIR] [--json PATH]

Corpora: the seven of ``conf/data/glm5_corpus.yaml`` with its shard count (``preprocess.tasks``:
1,000 per corpus), each holding what ``conf/curriculum/glm5.yaml`` reads from it (one epoch over
the 28.5T-token run) x the scale, documents drawn per category from GLM-5-like length
distributions (:data:`LENGTHS`; agent trajectories up to 200K tokens), written as real megatron
``.idx`` files (read by megatron's own reader) with sparse ``.bin`` files (no token payload on
disk: every token reads as id 0). Per stage (the three 202,752-token stages read one stream and
build it once, as the run does): ``data_pipeline.build.build_mixture`` -- what ``build_datasets``
runs after preprocessing -- with the stage's mixture, sequence length and sample count (the run's
``num_samples`` and validation size) in a fresh child process: wall time, peak memory (the child's
peak RSS, /proc VmHWM; a tracemalloc of numpy's and megatron's C++ allocations would miss some),
bytes of the cached index files; then a second child (a restart, every other rank) loads the
cached indices: wall time and the latency of rank 0's first global batch (global batch / DP
samples; DP of ``parallel=glm5_h200_512gpu`` as each stage resolves it). At the largest scale
the loader's samples/s at 202,752-token packed samples. Fit: a least-squares line over the scales
evaluated at 100% (:func:`fit`; the exponent between the two largest scales says whether growth
is linear), and, from the per-dataset index build times of the largest scale, the wall time with
``data.index_threads`` >= datasets. ``--baseline`` also times, for the first stage below the
largest scale, megatron's ``build_blending_indices`` over one dataset per shard
(``data.max_group_documents=0``, the layout before issue 16): O(samples x datasets), the step that
does not hold at 100%; the rest of that build cannot even start here (8,000 open
``IndexedDataset``s x 3 file descriptors > ``ulimit -n``). Every child runs 1 index thread.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: corpus -> (median tokens, lognormal sigma, most tokens): web pages, books, source files, math,
#: long chain-of-thought, agent trajectories
LENGTHS = {
    "web_en": (550, 1.0, 65_536), "web_multilingual": (600, 1.0, 65_536), "books": (60_000, 0.8, 1_000_000),
    "code": (800, 1.3, 131_072), "math": (700, 0.9, 65_536), "reasoning": (3_000, 0.9, 65_536),
    "agent_trajectories": (12_000, 1.0, 200_000),
}
RUN = ["model=glm5_744b", "parallel=glm5_h200_512gpu", "data=glm5_corpus", "curriculum=glm5"]
WORLD = 512  #: GPUs of that layout
VOCAB = 154_880  #: GLM-5's: tokens are int32 on disk
INT32 = 4


def plan_streams():
    """The recipe's stages grouped by data stream: [(stage names, run config, samples, dp)]."""
    from pretrain.config.schema import compose, to_run_config
    from pretrain.curriculum import plan

    rc = to_run_config(compose(RUN))
    stages, problems = plan(rc)
    assert not problems, problems
    streams: dict = {}
    for st in stages:
        t, par = st.rc.trainer, st.rc.parallel
        key = (repr(st.rc.data), t.seq_length, t.seed)
        dp = WORLD // (par.tp * par.pp * par.cp)
        streams.setdefault(key, ([], st.rc, max(t.global_batch_size, st.stream_samples), dp))[0].append(st.name)
    return rc, stages, list(streams.values())


def corpus_tokens(stages) -> dict:
    """Tokens each corpus must hold for the whole curriculum to read it once."""
    out: dict = {}
    for st in stages:
        t = st.rc.trainer
        weights = {k: float(w) for k, w in st.rc.data.mixtures[st.rc.data.mixture].items() if w > 0}
        for c, w in weights.items():
            out[c] = out.get(c, 0.0) + st.steps * t.global_batch_size * t.seq_length * w / sum(weights.values())
    return out


def write_index(prefix: str, lengths: np.ndarray, itemsize: int) -> None:
    """A megatron ``.idx`` (header, int32 lengths, int64 byte pointers, document boundaries: one
    sequence per document) and a sparse ``.bin`` of the size it implies."""
    from megatron.core.datasets.indexed_dataset import DType

    dtype = {4: np.int32, 1: np.uint8}[itemsize]
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=pointers[1:])
    pointers *= itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([DType.code_from_dtype(dtype)]))
        f.write(np.array([len(lengths), len(lengths) + 1], "<u8").tobytes())
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * itemsize)


def write_corpora(root: str, scale: float, tokens: dict, shards: int, digest: str) -> dict:
    """The synthetic corpora at ``scale`` under ``root`` (reused when complete); name -> stats."""
    done = os.path.join(root, "corpora.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    shutil.rmtree(root, ignore_errors=True)
    out = {}
    for c, total in tokens.items():
        median, sigma, most = LENGTHS[c]
        mean = min(median * math.exp(sigma ** 2 / 2), most)
        per_shard = max(1, round(total * scale / mean / shards))
        folder = os.path.join(root, c)
        os.makedirs(folder)
        entries = []
        for k in range(shards):
            rng = np.random.RandomState((zlib.crc32(c.encode()) + k) % 2**31)
            lengths = np.clip(rng.lognormal(math.log(median), sigma, per_shard), 16, most).astype(np.int64)
            prefix = os.path.join(folder, f"shard_{k:05d}")
            write_index(prefix, lengths, INT32)
            mask = c == "agent_trajectories"
            if mask:
                write_index(prefix + "-lossmask", lengths, 1)
            entries.append({"prefix": f"shard_{k:05d}", "documents": per_shard, "tokens": int(lengths.sum()),
                            "loss_mask": mask, "tokenizer": digest})
        out[c] = {"path": folder, "shards": entries}
    with open(done, "w") as f:
        json.dump(out, f)
    return out


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


# --- child: one construction ----------------------------------------------------------------


def child(spec: dict) -> dict:
    """Build (or load) one stream's datasets as the run does; timings and memory."""
    import logging

    logging.disable(logging.WARNING)
    from data_pipeline.batches import micro_batches
    from data_pipeline.build import build_mixture
    from data_pipeline.preprocess import CorpusOutput

    _, stages, streams = plan_streams()
    names, rc, samples, dp = streams[spec["stream"]]
    cfg, t = rc.data, rc.trainer
    cfg.tokenizer.path = spec["tokenizer"]
    cfg.max_group_documents = spec.get("max_group_documents", cfg.max_group_documents)
    with open(os.path.join(spec["corpora"], "corpora.json")) as f:
        corpora = json.load(f)
    outputs = {c: CorpusOutput(c, v["path"], [os.path.join(v["path"], s["prefix"]) for s in v["shards"]],
                               [s["tokens"] for s in v["shards"]], v["shards"][0]["loss_mask"], {"shards": v["shards"]})
               for c, v in corpora.items()}
    n = max(t.global_batch_size, math.ceil(samples * spec["scale"]))
    if spec.get("max_group_documents") == 0:
        return per_shard_blend(cfg, outputs, n)
    cfg.index_threads = spec.get("index_threads", 1)
    per_dataset = time_datasets()
    rss0 = peak_rss()
    t0 = time.perf_counter()
    train, valid = build_mixture(cfg, outputs, t.seq_length, t.seed, spec["run_dir"], VOCAB, n,
                                 t.eval_samples if t.eval_every else None)
    out = {"seconds": time.perf_counter() - t0, "samples": n, "datasets": len(train.corpus_of_dataset),
           "peak_rss": peak_rss(), "rss_at_start": rss0, "valid": 0 if valid is None else len(valid),
           "per_dataset": per_dataset}
    if spec.get("batch"):
        t0 = time.perf_counter()
        first = list(micro_batches(train, 0, t.global_batch_size, t.micro_batch_size, 0, dp))
        out["first_batch_s"] = time.perf_counter() - t0
        out["first_batch_samples"] = sum(len(b["tokens"]) for b in first)
    if spec.get("loader"):
        k = min(spec["loader"], len(train))
        t0 = time.perf_counter()
        for b in micro_batches(train, 0, k, 1, 0, 1):
            assert b["tokens"].shape == (1, t.seq_length)
        out["loader_samples_per_s"] = k / (time.perf_counter() - t0)
    return out


def time_datasets() -> list:
    """[(documents, seconds)] of each megatron dataset's index build in this process (the part
    ``data.index_threads`` runs in parallel); the rest of a build is serial."""
    from data_pipeline.gpt_corpus import CorpusDataset

    times, build = [], CorpusDataset._build_document_sample_shuffle_indices

    def timed(self):
        t0 = time.perf_counter()
        out = build(self)
        times.append((len(self.indices), time.perf_counter() - t0))
        return out

    CorpusDataset._build_document_sample_shuffle_indices = timed
    return times


def per_shard_blend(cfg, outputs: dict, n: int) -> dict:
    """megatron's ``build_blending_indices`` over one dataset per shard (the layout before shard
    groups) for ``n`` samples: the step that is O(samples x datasets). The whole per-shard build
    cannot run here: its 8,000 ``IndexedDataset``s hold 3 file descriptors each."""
    from megatron.core.datasets import helpers

    from data_pipeline.blend import plan_blend
    from data_pipeline.config import active_weights

    blend = plan_blend(cfg, outputs, active_weights(cfg), outputs[next(iter(outputs))].stats["shards"][0]["tokenizer"])
    w = np.asarray(blend.weights, dtype=np.float64) / sum(blend.weights)
    index, sample = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    rss0 = peak_rss()
    t0 = time.perf_counter()
    helpers.build_blending_indices(index, sample, w, len(w), n, False)
    masks = sum(1 for o in blend.owners if outputs[o].loss_mask)
    return {"seconds": time.perf_counter() - t0, "samples": n, "datasets": len(w), "peak_rss": peak_rss(),
            "rss_at_start": rss0, "valid": 0, "open_files": 3 * (len(w) + masks)}


def run_child(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"child failed: {spec}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- parent: rehearsal, fit, table ------------------------------------------------------------


def fit(scales, values):
    """(value at 100% of a least-squares line value = a + b x scale, exponent k of value ~ scale^k
    between the two largest scales): fixed costs dominate the small scales, so a power law
    through all of them would bend the extrapolation down; k ~ 1 says the growth is linear."""
    b, a = np.polyfit(scales, values, 1)
    order = np.argsort(scales)[-2:]
    x, y = np.asarray(scales)[order], np.maximum(np.asarray(values, dtype=float)[order], 1e-9)
    return float(a + b), float(np.log(y[1] / y[0]) / np.log(x[1] / x[0]))


def gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", type=float, nargs="+", default=[0.0001, 0.001, 0.01])
    ap.add_argument("--work", default="/tmp/glm5_data_scale")
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", action="store_true", help="also megatron's per-shard blend, first stage")
    ap.add_argument("--loader", type=int, default=32, help="202,752-token samples read for samples/s")
    ap.add_argument("--report", default=None, help="print the tables of a --json file and stop")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.report:
        with open(args.report) as f:
            rows = json.load(f)
        report(rows, plan_streams()[2], sorted({r["scale"] for r in rows}))
        return

    from data_pipeline import tokenizer
    from data_pipeline.fsutil import file_digest
    from benchmarks.runs import REPO
    from pretrain.config.schema import compose, to_run_config

    samples = to_run_config(compose([])).data  # conf/data/samples.yaml, as the run composes it
    samples.cache_dir = os.path.join(REPO, samples.cache_dir)
    tok = tokenizer.resolve(samples)
    rc, stages, streams = plan_streams()
    tokens = corpus_tokens(stages)
    shards = rc.data.preprocess.tasks
    print(f"corpora ({shards} shards each, tokens at 100%): "
          + ", ".join(f"{c} {v / 1e12:.2f}T" for c, v in tokens.items()), flush=True)
    rows, wall = [], time.perf_counter()
    for scale in sorted(args.scales):
        root = os.path.join(args.work, f"corpora-{scale:g}")
        t0 = time.perf_counter()
        corpora = write_corpora(root, scale, tokens, shards, file_digest(tok))
        docs = sum(s["documents"] for v in corpora.values() for s in v["shards"])
        idx = sum(os.path.getsize(os.path.join(v["path"], s["prefix"] + ".idx"))
                  for v in corpora.values() for s in v["shards"])
        print(f"scale {scale:g}: {docs:,} documents, .idx {gib(idx)} GiB, ready in {time.perf_counter() - t0:.0f} s",
              flush=True)
        jobs = [(i, {}) for i in range(len(streams))]
        if args.baseline and scale < max(args.scales):
            jobs.append((0, {"max_group_documents": 0}))
        for i, extra in jobs:
            run_dir = os.path.join(args.work, "run")
            shutil.rmtree(run_dir, ignore_errors=True)
            spec = {"stream": i, "scale": scale, "corpora": root, "tokenizer": tok, "run_dir": run_dir, **extra}
            built = run_child(spec)
            index_bytes = du(os.path.join(run_dir, "data_index"))
            loader = args.loader if (scale == max(args.scales) and streams[i][1].trainer.seq_length == 202752
                                     and not extra) else 0
            loaded = built if extra else run_child({**spec, "batch": True, "loader": loader})
            row = {"stages": streams[i][0], "scale": scale, "per_shard": bool(extra), "build_s": built["seconds"],
                   "peak_rss": built["peak_rss"], "rss_at_start": built["rss_at_start"], "index_bytes": index_bytes,
                   "samples": built["samples"], "datasets": built["datasets"], "valid": built["valid"],
                   "load_s": loaded["seconds"], "load_peak_rss": loaded["peak_rss"],
                   **{k: loaded[k] for k in ("first_batch_s", "first_batch_samples", "loader_samples_per_s")
                      if k in loaded}}
            row.update({k: built[k] for k in ("open_files", "per_dataset") if k in built})
            rows.append(row)
            print(json.dumps(row), flush=True)
        shutil.rmtree(os.path.join(args.work, "run"), ignore_errors=True)
    report(rows, streams, args.scales)
    print(f"rehearsal wall time {time.perf_counter() - wall:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def report(rows, streams, scales) -> None:
    print("\n| stage(s) | scale | samples | datasets | build s | peak RSS GiB | index GiB | load s | first batch s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = "+".join(r["stages"]) + (" (megatron blend over shards)" if r["per_shard"] else "")
        fb = f"{r['first_batch_s']:.2f} ({r['first_batch_samples']})" if "first_batch_s" in r else "-"
        print(f"| {name} | {r['scale'] * 100:g}% | {r['samples']:,} | {r['datasets']} | {r['build_s']:.1f} | "
              f"{gib(r['peak_rss'])} | {gib(r['index_bytes'])} | {r['load_s']:.1f} | {fb} |")
    print("\nextrapolated to 100% (least-squares line over the scales; k: growth exponent 0.1% -> 1%):")
    print("| stage(s) | build h (k) | peak RSS GiB above start (k) | index GiB (k) | load s (k) |")
    print("|---|---|---|---|---|")
    for per_shard in (False, True):
        for names, *_ in streams:
            rs = [r for r in rows if r["stages"] == names and r["per_shard"] == per_shard]
            if len(rs) < 2:
                continue
            x = [r["scale"] for r in rs]
            b, kb = fit(x, [r["build_s"] for r in rs])
            m, km = fit(x, [r["peak_rss"] - r["rss_at_start"] for r in rs])
            i, ki = fit(x, [r["index_bytes"] for r in rs])
            ld, kl = fit(x, [r["load_s"] for r in rs])
            name = "+".join(names) + (" (megatron blend over shards)" if per_shard else "")
            print(f"| {name} | {b / 3600:.2f} ({kb:.2f}) | {gib(m)} ({km:.2f}) | {gib(i)} ({ki:.2f}) | "
                  f"{ld:.0f} ({kl:.2f}) |")
    top = max(scales)
    print(f"\nat 100% with data.index_threads >= datasets (the rehearsal ran 1 thread): the serial part "
          f"(build - the datasets' index builds) x 100% / {top:g}, plus the longest dataset index build: each "
          f"dataset's s/document x its documents at 100% (a group holds at most 2**31 - 1):")
    print("| stage(s) | serial h | longest dataset at 100%: documents, h | estimate h |")
    print("|---|---|---|---|")
    for names, *_ in streams:
        rs = [r for r in rows if r["stages"] == names and not r["per_shard"] and r["scale"] == top
              and r.get("per_dataset")]
        if not rs:
            continue
        r = rs[0]
        serial = (r["build_s"] - sum(s for _, s in r["per_dataset"])) / top
        at_full = [(min(2**31 - 1, d / top), s / d) for d, s in r["per_dataset"] if d > 0]
        docs, per_doc = max(at_full, key=lambda x: x[0] * x[1])
        longest = docs * per_doc
        print(f"| {'+'.join(names)} | {serial / 3600:.2f} | {docs:,.0f}, {longest / 3600:.2f} | "
              f"{(serial + longest) / 3600:.2f} |")
    for r in rows:
        if "loader_samples_per_s" in r:
            print(f"\nloader: {r['loader_samples_per_s']:.1f} samples/s at 202,752-token packed samples "
                  f"({r['loader_samples_per_s'] * 202752 / 1e6:.1f}M tokens/s, one process)")


if __name__ == "__main__":
    main()
