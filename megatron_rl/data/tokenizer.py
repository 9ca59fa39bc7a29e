"""Tokenizers as the RL trainer sees them: prompts in, ids out; response ids in, text out.

Owns the tokenizer section of the run config (:class:`TokenizerConfig`), the interface the
trainer codes against (:class:`PromptTokenizer`), its two implementations (a local Hugging
Face tokenizer with its chat template, :func:`load_tokenizer`; the built-in task's
character tokenizer, :func:`char_tokenizer_adapter`), what a prompt may be (a string or
a list of chat messages, :func:`normalized_prompt`) and the config-time check
:func:`check_tokenizer_config`.

It does not own prompt files (``megatron_rl.data.prompts``), sampling (the rollout engine
stops on :attr:`PromptTokenizer.stop_token_ids`), rewards, or the choice of the default
tokenizer directory (the caller passes the init checkpoint's directory). Nothing here
touches the network: Hugging Face files are read with ``local_files_only=True``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.config import TokenizerConfig
from megatron_rl.data.tasks import CharTokenizer

Messages = list[dict[str, Any]]
"""A chat prompt: ``[{"role": ..., "content": ...}, ...]``."""

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""Any one of these marks a directory as holding a Hugging Face tokenizer."""


class PromptTokenizer(abc.ABC):
    """What the trainer needs from a tokenizer.

    Attributes:
        vocab_size: Ids in use, added tokens included; the model's vocab must be >= this.
        stop_token_ids: Ids that end a response, deduplicated, most important first.
    """

    vocab_size: int
    stop_token_ids: tuple[int, ...]

    @abc.abstractmethod
    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        """Ids the policy is conditioned on, ending where the response starts.

        Raises:
            ValueError: the prompt's form does not fit this tokenizer's settings.
        """

    @abc.abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Plain ids of ``text`` without special tokens (supervised targets)."""

    @abc.abstractmethod
    def decode_response(self, ids: Iterable[int]) -> str:
        """Text of a sampled response up to, not including, its first stop token.

        Args:
            ids: Token ids; ints or 0-dim tensors (a 1-D tensor iterates as those).
        """

    def _until_stop(self, ids: Iterable[int]) -> list[int]:
        stops = set(self.stop_token_ids)
        kept = []
        for token in ids:
            token_id = int(token)
            if token_id in stops:
                break
            kept.append(token_id)
        return kept


class HFPromptTokenizer(PromptTokenizer):
    """A local Hugging Face tokenizer, with or without its chat template.

    Build it with :func:`load_tokenizer`.

    Args:
        tokenizer: The loaded ``transformers`` tokenizer.
        cfg: The tokenizer section of the run config.
        stop_token_ids: Resolved stop ids (see :func:`load_tokenizer`).
        tools: Tool schemas the chat template is given with every prompt (an environment's).
    """

    def __init__(self, tokenizer: Any, cfg: TokenizerConfig, stop_token_ids: tuple[int, ...],
                 tools: Messages | None = None):
        self.hf_tokenizer = tokenizer
        self.use_chat_template = cfg.chat_template
        self.system_prompt = cfg.system_prompt
        self.vocab_size = len(tokenizer)
        self.stop_token_ids = stop_token_ids
        self.tools = tools

    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        """Chat template with the generation prompt, or the tokenizer's default plain encode.

        Raises:
            ValueError: ``prompt`` is a message list but the chat template is off, or a
                message is not a dict with string ``role`` and ``content``.
        """
        if not self.use_chat_template:
            if not isinstance(prompt, str):
                raise ValueError(
                    "a prompt given as chat messages needs tokenizer.chat_template: true"
                )
            # Default add_special_tokens: a plain prompt starts the way the tokenizer
            # starts any sequence (e.g. with bos).
            return list(self.hf_tokenizer.encode(prompt))
        encoded = self.hf_tokenizer.apply_chat_template(
            self.prompt_messages(prompt), tools=self.tools, add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def prompt_messages(self, prompt: str | Messages) -> Messages:
        """The messages :meth:`encode_prompt` renders with the chat template (the system prompt added).

        Raises:
            ValueError: as :meth:`encode_prompt`.
        """
        prompt = normalized_prompt(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def encode_text(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def decode_response(self, ids: Iterable[int]) -> str:
        # Ids past the tokenizer (the model's vocab is padded) decode to nothing rather
        # than raising: a bad sample must cost a reward, not the run.
        return self.hf_tokenizer.decode(self._until_stop(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (
            f"HFPromptTokenizer({self.hf_tokenizer.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"chat_template={self.use_chat_template}, stop_token_ids={self.stop_token_ids})"
        )


class CharPromptTokenizer(PromptTokenizer):
    """The built-in task's :class:`CharTokenizer` behind :class:`PromptTokenizer`.

    A prompt is ``[bos] + encode(text)`` (exactly ``Problem.prompt_ids``); ``eos`` is the
    only stop token. There is no chat template, so message-list prompts are rejected.
    """

    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.char_tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.stop_token_ids = (tokenizer.eos_id,)

    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("the built-in task tokenizer takes string prompts, not chat messages")
        return [self.char_tokenizer.bos_id, *self.char_tokenizer.encode(prompt)]

    def encode_text(self, text: str) -> list[int]:
        return self.char_tokenizer.encode(text)

    def decode_response(self, ids: Iterable[int]) -> str:
        return self.char_tokenizer.decode(ids)

    def __repr__(self) -> str:
        return f"CharPromptTokenizer({self.char_tokenizer!r})"


def char_tokenizer_adapter(tok: CharTokenizer) -> PromptTokenizer:
    """The built-in task tokenizer behind the :class:`PromptTokenizer` interface."""
    return CharPromptTokenizer(tok)


def load_tokenizer(cfg: TokenizerConfig, default_path: str | None, tools: Messages | None = None) -> PromptTokenizer:
    """Loads the tokenizer of ``cfg.path`` (or ``default_path``) from local files only;
    ``tools`` go to the chat template with every prompt.

    Stop ids are ``eos_token_id`` of the tokenizer, then the ``eos_token_id`` (an int or a
    list) of ``generation_config.json`` in the same directory, then
    ``cfg.extra_stop_tokens``, deduplicated in that order.

    Raises:
        ConfigError: as :func:`check_tokenizer_config` (without the vocab-size rule).
    """
    directory = _resolve_dir(cfg, default_path)
    tokenizer = _load_hf(directory)
    _check_template(cfg, tokenizer, directory)
    return HFPromptTokenizer(tokenizer, cfg, _stop_ids(cfg, tokenizer, directory), tools)


def check_tokenizer_config(
    cfg: TokenizerConfig, default_path: str | None, model_vocab_size: int | None
) -> None:
    """Config-time check, before any process or model exists; loads the tokenizer once.

    Args:
        cfg: The tokenizer section.
        default_path: Used when ``cfg.path`` is None (the init checkpoint's directory).
        model_vocab_size: ``model.vocab_size``; None skips the size rule.

    Raises:
        ConfigError: one line naming the key: no directory, no tokenizer files, chat
            template asked for but missing, more tokenizer ids than model ids, or an extra
            stop token that is not a single token.
    """
    directory = _resolve_dir(cfg, default_path)
    tokenizer = _load_hf(directory)
    _check_template(cfg, tokenizer, directory)
    _stop_ids(cfg, tokenizer, directory)
    size = len(tokenizer)
    if model_vocab_size is not None and size > model_vocab_size:
        raise ConfigError(
            f"tokenizer.path: the tokenizer has {size} ids but model.vocab_size is {model_vocab_size}"
        )


def _resolve_dir(cfg: TokenizerConfig, default_path: str | None) -> Path:
    raw = cfg.path if cfg.path is not None else default_path
    if raw is None:
        raise ConfigError(
            "tokenizer.path: not set, and there is no init checkpoint directory to take it from"
        )
    directory = Path(raw).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"tokenizer.path: {raw} is not a directory")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"tokenizer.path: {raw} has no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    return directory


def _load_hf(directory: Path) -> Any:
    # Imported here: transformers is heavy and the built-in task path never needs it.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types; the user needs the directory
        text = str(err).strip()
        first_line = text.splitlines()[0] if text else type(err).__name__
        raise ConfigError(
            f"tokenizer.path: cannot load a tokenizer from {directory}: {first_line}"
        ) from err


def _check_template(cfg: TokenizerConfig, tokenizer: Any, directory: Path) -> None:
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"tokenizer.chat_template: true, but the tokenizer in {directory} has no chat "
            "template (set tokenizer.chat_template: false for plain encoding)"
        )


def _stop_ids(cfg: TokenizerConfig, tokenizer: Any, directory: Path) -> tuple[int, ...]:
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids.extend(_generation_config_eos(directory))
    for i, text in enumerate(cfg.extra_stop_tokens):
        ids.append(_single_token_id(tokenizer, text, f"tokenizer.extra_stop_tokens[{i}]"))
    return tuple(dict.fromkeys(ids))


def _generation_config_eos(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"tokenizer.path: {path} is not a JSON object: {err}") from err
    if eos is None:
        return []
    values = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"tokenizer.path: eos_token_id in {path} must be an int or a list of ints")
    return values


def _single_token_id(tokenizer: Any, text: str, key: str) -> int:
    # The vocabulary (added tokens included) first: a special token such as "<|eot_id|>"
    # is one id even where plain encoding would split it.
    token_id = tokenizer.get_vocab().get(text)
    if token_id is not None:
        return int(token_id)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(
            f"{key}: {text!r} is not a single token of the tokenizer (it encodes to {len(ids)} ids)"
        )
    return int(ids[0])


def normalized_prompt(prompt: Any) -> str | Messages:
    """A prompt as a string or a list of messages, the messages' null fields dropped.

    Arrow gives every message of a prompt file the union of all messages' fields, absent
    ones as null; a chat template testing "is defined" would otherwise see them as set.

    Raises:
        ValueError: the prompt is neither, or a message is not a dict with string
            ``role`` and ``content`` (the message is named by its index).
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"the prompt must be a string or a non-empty list of messages, got {prompt!r}"
        )
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"message {i} must be a dict with string 'role' and 'content', got {message!r}"
            )
    return [{k: v for k, v in message.items() if v is not None} for message in prompt]
