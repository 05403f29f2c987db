"""Agent conversations as chat templates take them: one system turn, then no two text turns of one role in a row.

Agents send what their APIs allow: Codex two developer messages then two user messages, Anthropic clients
consecutive user turns (which Anthropic's API combines into one). Many templates (Gemma's, Mistral's) raise
on anything but system, then user / assistant alternating, so both agent adapters render the same
conversation the way those APIs mean it: a run of system / developer messages is one system message, a run of
text messages of one role one message (joined by a blank line). Tool calls and results are never merged.
"""

from __future__ import annotations

_INSTRUCTION_ROLES = ("system", "developer")


def merged_turns(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for message in messages:
        role = "system" if message["role"] in _INSTRUCTION_ROLES else message["role"]
        message = {**message, "role": role}
        previous = out[-1] if out else None
        if previous is not None and _plain(previous) and _plain(message) and previous["role"] == role:
            out[-1] = {**previous, "content": _joined(previous["content"], message["content"])}
        else:
            out.append(message)
    return out


def _plain(message: dict) -> bool:
    content = message.get("content")
    return message["role"] != "tool" and not message.get("tool_calls") and isinstance(content, (str, list))


def _joined(first: str | list[dict], second: str | list[dict]) -> str | list[dict]:
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}" if first and second else first or second
    # A turn with images is a list of chat parts (text, image_url): the parts in order, a blank line between texts.
    parts = _parts(first)
    if parts and _parts(second):
        parts.append({"type": "text", "text": "\n\n"})
    return parts + _parts(second)


def _parts(content: str | list[dict]) -> list[dict]:
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content}] if content else []
