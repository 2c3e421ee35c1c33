"""The generated sample corpora: deterministic, math answers right (re-derived from the problem
text, not from the generator), agent tool results real (replayed in a fresh sandbox)."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction

from data_pipeline.samples import agent, code, math as math_samples, prose
from data_pipeline.samples.sandbox import Sandbox
from data_pipeline.samples.stdlib_files import read_source, stdlib_files


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _check_math(text: str) -> bool:
    """Solve the problem from its statement; True when the stated answer matches (None: kind not checked here)."""
    answer = text.rsplit("Answer: ", 1)[1].strip()
    if m := re.search(r"Solve for x: (-?\d+)x \+ \((-?\d+)\) = (-?[\d/]+)\.", text):
        a, b, c = int(m[1]), int(m[2]), Fraction(m[3])
        return Fraction(answer) == (c - b) / a
    if m := re.search(r"gcd\((\d+), (\d+)\)", text):
        return int(answer) == math.gcd(int(m[1]), int(m[2]))
    if m := re.search(r"Compute (\d+)\^(\d+) mod (\d+)\.", text):
        return int(answer) == pow(int(m[1]), int(m[2]), int(m[3]))
    if m := re.search(r"Compute ([\d/]+) \+ ([\d/]+)\.", text):
        return Fraction(answer) == Fraction(m[1]) + Fraction(m[2])
    if m := re.search(r"Solve x\^2 - \((-?\d+)\)x \+ \((-?\d+)\) = 0\.", text):
        s, p = int(m[1]), int(m[2])
        return [int(v) for v in answer.split(",")] == [x for x in range(-40, 41) if x * x - s * x + p == 0]
    if m := re.search(r"prime factorization of (\d+)\.", text):
        factors = [int(v) for v in answer.split(" x ")]
        return math.prod(factors) == int(m[1]) and all(all(f % k for k in range(2, f)) for f in factors)
    return None


def test_math_answers_check_out_and_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    math_samples.generate(str(a), seed=7, max_bytes=120_000)
    math_samples.generate(str(b), seed=7, max_bytes=120_000)
    assert a.read_bytes() == b.read_bytes()
    checked = 0
    for rec in _lines(a):
        assert rec["text"].startswith("Problem: ") and "\nStep 1: " in rec["text"]
        ok = _check_math(rec["text"])
        assert ok is not False, rec["text"]
        checked += ok is True
    assert checked > 200
    math_samples.generate(str(b), seed=8, max_bytes=120_000)
    assert a.read_bytes() != b.read_bytes()


def test_code_and_prose_come_from_the_installed_stdlib(tmp_path):
    code.generate(str(tmp_path / "c.jsonl"), seed=1, max_bytes=200_000)
    sources = {rel: path for rel, path in stdlib_files()}
    recs = _lines(tmp_path / "c.jsonl")
    assert sum(len(r["text"]) for r in recs) >= 200_000
    for r in recs:
        assert r["text"] == read_source(sources[r["path"]])
    prose.generate(str(tmp_path / "p.jsonl"), seed=1, max_bytes=600_000)
    docs = _lines(tmp_path / "p.jsonl")
    from pydoc_data.topics import topics

    assert sum(d["source"].startswith("pydoc_data.topics:") for d in docs) == len(topics)
    assert any(d["source"].endswith(".py") and "The function " in d["text"] for d in docs)


def test_agent_episodes_are_deterministic_with_real_tool_outputs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    agent.generate(str(a), seed=3, episodes=14)
    agent.generate(str(b), seed=3, episodes=14)
    assert a.read_bytes() == b.read_bytes()
    episodes = [e["messages"] for e in _lines(a)]
    replayed = 0
    with Sandbox(str(tmp_path / "replay")) as box:
        for n, msgs in enumerate(episodes):
            assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[-1]["role"] == "assistant"
            calls = [(m, msgs[i + 1]) for i, m in enumerate(msgs) if m.get("tool_calls")]
            assert calls and all(r["role"] == "tool" and r["name"] == m["tool_calls"][0]["name"] for m, r in calls)
            if any(k in msgs[1]["content"] for k in ("src/", "topic.txt", "define,")):
                continue  # these start from pre-populated files; replayable ones create everything they use
            for m, result in calls:
                call = m["tool_calls"][0]
                assert box.call(f"r{n}", call["name"], call["arguments"]) == result["content"]
            replayed += 1
            if "primes" in msgs[1]["content"]:
                sieve, trial = (r["content"] for _, r in calls)
                assert int(sieve.split()[0]) == int(trial)
            if "crashes" in msgs[1]["content"]:
                assert "Traceback (most recent call last):" in calls[1][1]["content"]
                assert "Error" in calls[1][1]["content"].strip().splitlines()[-1]
    assert replayed >= 4
