"""Content-checksum throughput on this machine: what verifying a corpus or sample index costs.

For each of sha256, blake2b and plain reading (the floor: no hashing), MB/s on one core over a
file of ``--mib`` MiB (default 256, read from the page cache: the file is read once first), the
median of ``--runs`` runs, each hashed the way ``data_pipeline.fsutil.content_digest`` does it
(``readinto`` a reused buffer, ``update`` per block). Then ``content_digests`` over ``--files``
copies of that file on a thread pool (hashlib releases the GIL), against the sum of one-thread
runs. Prints one JSON line per measurement and a summary.

``.venv/bin/python benchmarks/hashing.py [--mib 256] [--runs 5] [--files 4]``
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_pipeline import fsutil  # noqa: E402

BLOCK = fsutil.BLOCK


def read_only(path: str) -> None:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass


def hashed(algorithm: str):
    def run(path: str) -> None:
        h = hashlib.new(algorithm)
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                h.update(view[:n])
        h.hexdigest()
    return run


def median_mb_s(fn, path: str, runs: int) -> float:
    size = os.path.getsize(path)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - t)
    return size / statistics.median(times) / 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--files", type=int, default=4)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="hashing-")
    try:
        path = os.path.join(tmp, "data.bin")
        with open(path, "wb") as f:  # int32-token-like content: random bytes hash like any other
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        read_only(path)  # into the page cache: the hash is measured, not the disk
        rates = {"read": median_mb_s(read_only, path, args.runs)}
        for algo in ("sha256", "blake2b"):
            rates[algo] = median_mb_s(hashed(algo), path, args.runs)
        for what, mb_s in rates.items():
            print(json.dumps({"what": what, "MB_s_one_core": round(mb_s), "mib": args.mib, "runs": args.runs,
                              "vs_read": round(mb_s / rates["read"], 3)}))
        copies = [path] + [shutil.copy(path, os.path.join(tmp, f"copy{i}.bin")) for i in range(1, args.files)]
        for c in copies:
            read_only(c)
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            fsutil.content_digests(copies)
            times.append(time.perf_counter() - t)
        pool = args.files * os.path.getsize(path) / statistics.median(times) / 1e6
        cores = len(os.sched_getaffinity(0))
        print(json.dumps({"what": f"content_digests ({fsutil.ALGORITHM}) of {args.files} files, thread pool",
                          "MB_s": round(pool), "cores": cores,
                          "speedup_vs_one_thread": round(pool / rates[fsutil.ALGORITHM], 2)}))
        fastest = max(("sha256", "blake2b"), key=rates.get)
        print(f"fastest here: {fastest} ({rates[fastest]:.0f} MB/s/core, {rates[fastest] / rates['read']:.2f} of "
              f"plain reading at {rates['read']:.0f} MB/s); the pipeline uses {fsutil.ALGORITHM}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
