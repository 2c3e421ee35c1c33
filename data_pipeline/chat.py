"""Trajectories -> text + per-token loss mask, with a GLM-style chat template.

Rendering (markers from ``data.chat``)::

    <|system|>\\n{system}<|user|>\\n{user}<|assistant|>\\n{thought}<tool_call>{"name": .., "arguments": ..}</tool_call>
    <|observation|>\\n<tool_response>\\n{result}\\n</tool_response><|assistant|>\\n{answer}

Role headers (``<|role|>\\n``) are *template*; a tool turn (observation header included) is a
*tool result*; everything else (system, user, assistant text and tool calls) is trained on. The
whole string is tokenised once and each token takes the kind of its first character, so the
tokens equal the tokenizer's output for the rendered text exactly.
"""

from __future__ import annotations

import json

import numpy as np

from data_pipeline.config import ChatTemplateConfig

TEXT, TEMPLATE, TOOL = 0, 1, 2  #: span kinds
ROLES = ("system", "user", "assistant", "tool")


class TrajectoryError(ValueError):
    pass


def render(messages, chat: ChatTemplateConfig) -> tuple[str, list[tuple[int, int]]]:
    """(text, spans): ``spans`` lists (end_char, kind) in order; a span starts where the previous
    one ends."""
    if not isinstance(messages, list) or not messages:
        raise TrajectoryError(f"expected a non-empty list of turns, got {type(messages).__name__}")
    parts: list[tuple[str, int]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise TrajectoryError(f"turn {i}: role must be one of {list(ROLES)}, got {m!r:.80}")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise TrajectoryError(f"turn {i}: content must be a string")
        role = m["role"]
        if role == "tool":
            parts.append((f"{chat.observation}\n{chat.tool_response_start}\n{content}\n{chat.tool_response_end}", TOOL))
            continue
        parts.append((f"{getattr(chat, role)}\n", TEMPLATE))
        body = content
        for call in m.get("tool_calls") or []:
            body += f"{chat.tool_call_start}{json.dumps({'name': call['name'], 'arguments': call.get('arguments', {})}, ensure_ascii=False)}{chat.tool_call_end}"
        parts.append((body, TEXT))
    text, spans, pos = "", [], 0
    for s, kind in parts:
        if not s:
            continue
        pos += len(s)
        text += s
        if spans and spans[-1][1] == kind:
            spans[-1] = (pos, kind)
        else:
            spans.append((pos, kind))
    return text, spans


def token_kinds(offsets, spans) -> np.ndarray:
    """Kind of each token from its first character's span (``offsets``: (start, end) per token)."""
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    ends = np.array([e for e, _ in spans], dtype=np.int64)
    kinds = np.array([k for _, k in spans], dtype=np.uint8)
    return kinds[np.minimum(np.searchsorted(ends, starts, side="right"), len(kinds) - 1)]


def loss_mask(kinds: np.ndarray, mask_template: bool, mask_tool_results: bool) -> np.ndarray:
    keep = np.ones(len(kinds), dtype=np.uint8)
    if mask_template:
        keep[kinds == TEMPLATE] = 0
    if mask_tool_results:
        keep[kinds == TOOL] = 0
    return keep
