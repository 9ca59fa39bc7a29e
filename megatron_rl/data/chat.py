"""Token-in/token-out chat rendering for multi-turn rollouts, and tool calls out of model turns.

Owns :class:`ChatRenderer`, which turns a conversation into ids with the tokenizer's own
chat template without ever re-tokenizing what a trajectory already holds:

* the first prompt is the template's rendering with the generation prompt;
* after a model turn (ids as generated, ending with its stop token), the environment's new
  messages become ids by rendering the conversation without and with them and tokenizing
  only the new text (the standard incremental trick), preceded by whatever the template
  writes after the assistant's stop token (ChatML: a newline). A template that renders the
  earlier conversation differently once messages follow is refused (:class:`TemplateError`);
* :meth:`ChatRenderer.first_mismatch` compares a finished trajectory's ids with the
  template's rendering of its whole conversation, tokenized in one go, and returns the first
  position where they differ (a model that wrote a non-canonical tokenization of its own
  text, or a template that rewrites history, e.g. one that drops earlier reasoning).

Tool calls are parsed in the tokenizer's own format: with transformers' response
template (``tokenizer.response_template``, e.g. Qwen3's) through ``parse_response``; a
tokenizer without one gets the Hermes/Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
JSON format. A tool call that does not parse is :class:`MalformedToolCall`.

Does not own running turns or environments (``megatron_rl.rollout.multiturn``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from megatron_rl.data.tokenizer import HFPromptTokenizer, Messages

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class TemplateError(ValueError):
    """The chat template cannot extend the conversation append-only."""


class MalformedToolCall(ValueError):
    """A model turn holds a tool call that does not parse (the message says why)."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn."""

    name: str
    """The function's name."""
    arguments: dict[str, Any]
    """Its arguments, parsed from JSON."""


class ChatRenderer:
    """A tokenizer's chat template, rendered append-only (see the module docstring).

    Args:
        tokenizer: the run's Hugging Face tokenizer (chat template on; its ``tools`` go to every render).
    """

    def __init__(self, tokenizer: HFPromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self.hf = tokenizer.hf_tokenizer
        self.tools = tokenizer.tools
        self.stop_texts = tuple(self.hf.decode([i]) for i in tokenizer.stop_token_ids)

    def render_text(self, messages: Messages, add_generation_prompt: bool) -> str:
        """The template's text of ``messages``."""
        return self.hf.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def render_ids(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        """The template's ids of ``messages``, tokenized in one go."""
        encoded = self.hf.apply_chat_template(messages, tools=self.tools, tokenize=True, return_dict=True,
                                              add_generation_prompt=add_generation_prompt)
        return list(encoded["input_ids"])

    def turn_text(self, ids: Iterable[int]) -> str:
        """A model turn's text as the conversation holds it: its ids up to its stop token, special tokens kept."""
        stops = set(self.tokenizer.stop_token_ids)
        kept = []
        for token in ids:
            if int(token) in stops:
                break
            kept.append(int(token))
        return self.hf.decode(kept, skip_special_tokens=False)

    def observation_ids(self, conversation: Messages, new_messages: Messages) -> list[int]:
        """Ids that follow a conversation ending with a model turn (its stop token included)
        when ``new_messages`` are appended and the model is prompted again.

        Raises:
            TemplateError: the template renders ``conversation`` differently once messages follow.
        """
        before = self.render_text(conversation, add_generation_prompt=False)
        after = self.render_text(conversation + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
            raise TemplateError(f"the chat template renders the conversation differently once messages follow "
                                f"(first differing character {at}: {before[at:at + 20]!r} became "
                                f"{after[at:at + 20]!r}); token-in/token-out needs an append-only template")
        return self.tokenizer.encode_text(self._tail_after_stop(before) + after[len(before):])

    def _tail_after_stop(self, rendered: str) -> str:
        """What the template writes after the last model turn's stop token (ChatML: a newline)."""
        ends = [(rendered.rfind(t), t) for t in self.stop_texts if t and t in rendered]
        if not ends:
            return ""
        at, text = max(ends)
        return rendered[at + len(text):]

    def first_mismatch(self, conversation: Messages, ids: list[int]) -> int | None:
        """The first position where ``ids`` differ from the template's rendering of
        ``conversation`` (tokenized in one go), or None. The rendering may go on past the
        ids' end (what the template writes after the last model turn's stop token)."""
        rendered = self.render_ids(conversation, add_generation_prompt=False)
        for i, (a, b) in enumerate(zip(ids, rendered)):
            if a != b:
                return i
        return len(rendered) if len(rendered) < len(ids) else None

    def tool_calls(self, text: str, prefix: str) -> tuple[ToolCall, ...]:
        """The tool calls in a model turn's ``text`` (stop token included), generated after ``prefix``.

        Raises:
            MalformedToolCall: a tool call does not parse, or lacks a string name or object arguments.
        """
        template = getattr(self.hf, "response_template", None)
        if template is not None:
            try:
                parsed = self.hf.parse_response(text, prefix=prefix)
            except ValueError as err:
                raise MalformedToolCall(" ".join(str(err).split())[:200]) from None
            calls = [c.get("function", c) if isinstance(c, dict) else c for c in parsed.get("tool_calls") or []]
        else:
            calls = []
            for body in _HERMES_CALL.findall(text):
                try:
                    calls.append(json.loads(body))
                except json.JSONDecodeError as err:
                    raise MalformedToolCall(f"tool call {body.strip()[:80]!r} is not JSON: {err}") from None
            if text.count("<tool_call>") != len(calls):
                raise MalformedToolCall("a <tool_call> is not closed by </tool_call>")
        return tuple(_tool_call(c) for c in calls)


def _tool_call(call: Any) -> ToolCall:
    """A parsed call as :class:`ToolCall` (arguments given as a JSON string are parsed)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise MalformedToolCall(f"tool call {call!r} has no string 'name'")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise MalformedToolCall(f"arguments of {call['name']!r} are not JSON: {err}") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"arguments of {call['name']!r} are {type(arguments).__name__}, not an object")
    return ToolCall(call["name"], arguments)
