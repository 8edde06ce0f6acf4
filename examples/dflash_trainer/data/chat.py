"""Chat records as the target sees them: rendered by the tokenizer's own chat template, split into
(text, is_loss) pieces so the loss falls on the assistant turns only.

An assistant turn may carry reasoning, as ``reasoning_content`` or as a ``<think>...</think>`` block
leading its content. ``reasoning`` decides what becomes of it:

- ``train``: rendered, and the loss covers it with the answer (the drafter learns the target's thinking);
- ``keep``: rendered as context, the loss on the answer only;
- ``drop``: removed from every turn before rendering.

The template decides what it renders: a Qwen3-style template drops the reasoning of turns before the
last user message, so those turns train on their answers alone, as the target sees them when it serves.
"""

from __future__ import annotations

from typing import Any

REASONING = ("train", "keep", "drop")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message; reasoning is "" when it has none."""
    content = message["content"]
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"].strip("\n"), content
    if THINK_CLOSE in content:
        head, _, answer = content.partition(THINK_CLOSE)
        return head.split(THINK_OPEN, 1)[-1].strip("\n"), answer.lstrip("\n")
    return "", content


def _for_template(messages: list[dict], reasoning: str) -> list[dict]:
    if reasoning != "drop":
        return messages
    return [{"role": m["role"], "content": split_reasoning(m)[1]} if m["role"] == "assistant" else m
            for m in messages]


def plain_segments(messages: list[dict], reasoning: str) -> list[tuple[str, bool]]:
    """A tokenizer without a chat template: "role: content\\n" per turn, the loss on the assistant's
    content (and its reasoning, with ``train``), not on the "assistant: " prefix."""
    out = []
    for m in messages:
        if m["role"] != "assistant":
            out += [(f"{m['role']}: ", False), (m["content"] + "\n", False)]
            continue
        thought, answer = split_reasoning(m)
        out.append(("assistant: ", False))
        if thought and reasoning != "drop":
            out.append((f"{THINK_OPEN}{thought}{THINK_CLOSE}", reasoning == "train"))
        out.append((answer + "\n", True))
    return out


def _find(rendered: str, text: str, cursor: int) -> tuple[int, str]:
    """Where ``text`` is in ``rendered`` from ``cursor`` (-1 if not), and the text found (templates
    often strip surrounding whitespace)."""
    start = rendered.find(text, cursor)
    if start < 0 and text.strip():
        text = text.strip()
        start = rendered.find(text, cursor)
    return start, text


def template_segments(messages: list[dict], tokenizer: Any, reasoning: str) -> tuple[list[tuple[str, bool]], int]:
    """(pieces, index of an assistant message whose answer is not in the rendering, or -1)."""
    rendered = tokenizer.apply_chat_template(_for_template(messages, reasoning), tokenize=False)
    out: list[tuple[str, bool]] = []
    cursor = 0
    # Every turn in order, so a text repeated in an earlier turn is not matched.
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            start, text = _find(rendered, m["content"], cursor)
            if start >= 0:
                out += [(rendered[cursor:start], False), (text, False)]
                cursor = start + len(text)
            continue
        thought, answer = split_reasoning(m)
        if thought and reasoning != "drop":
            start, text = _find(rendered, thought, cursor)
            if start >= 0:  # absent: the template left this turn's reasoning out
                after, found = _find(rendered, answer, start + len(text))
                if after >= 0:
                    out.append((rendered[cursor:start], False))
                    if reasoning == "train":  # the reasoning, the template's text between, the answer: all loss
                        out.append((rendered[start:after + len(found)], True))
                    else:
                        out += [(rendered[start:after], False), (found, True)]
                    cursor = after + len(found)
                    continue
        start, text = _find(rendered, answer, cursor)
        if start < 0:
            return out, i
        out += [(rendered[cursor:start], False), (text, True)]
        cursor = start + len(text)
    out.append((rendered[cursor:], False))
    return out, -1
