"""Built-in verifiable tasks: a character tokenizer and problems with exact answers.

Owns the :class:`CharTokenizer`, the :class:`Problem` record, the task section of the run
config (:class:`TaskConfig`) and the task registry ``TASKS`` ("addition", "reverse").
Responses are scored by ``megatron_rl.rewards`` on decoded text (``exact_match`` for these
tasks).

It does not own generation (the rollout engine), reward shaping such as overlong
penalties (``algos.shaping``), group filtering, or the check that the tokenizer fits the
model's vocabulary (the trainer validates ``tokenizer.vocab_size <= model.vocab_size``).
Pure Python: no ``torch.distributed``, no Megatron.

Each task is a finite space of problems indexed ``0 .. space_size - 1``. Problems are
drawn without replacement with a seeded ``random.Random``, the held-out set first and the
training set after it. So the two sets never overlap, and the held-out set depends only
on the seed, its own size and the task knobs, never on how many training problems a run
asks for. A problem's id is its index in the space: unique and stable across runs.

Shape legend: S sequences (one response per problem passed to :func:`score`).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Iterable
from dataclasses import dataclass

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.config import TaskConfig
from megatron_rl.registry import Registry

DEFAULT_ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"
"""Characters of the built-in tokenizer, in id order after the special tokens."""

_NUM_SPECIAL = 3
_UNKNOWN_CHAR = "\ufffd"


class CharTokenizer:
    """Character-level tokenizer: ids 0-2 are special, then one id per alphabet character.

    :meth:`encode` adds no special tokens: a :class:`Problem` prepends ``bos_id`` to its
    prompt and :meth:`Task.sft_example` appends ``eos_id`` to the answer.

    Args:
        alphabet: The characters, taking ids 3, 4, ... in order; no repeats.

    Raises:
        ValueError: the alphabet is empty or repeats a character.
    """

    pad_id: int = 0
    """Padding; never produced by :meth:`encode`, skipped by :meth:`decode`."""
    bos_id: int = 1
    """Beginning of sequence; starts every prompt."""
    eos_id: int = 2
    """End of sequence; ends every answer, and a response without it is truncated."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not alphabet:
            raise ValueError("tokenizer alphabet must be non-empty")
        repeated = sorted({char for char in alphabet if alphabet.count(char) > 1})
        if repeated:
            raise ValueError(f"tokenizer alphabet repeats {''.join(repeated)!r}")
        self.alphabet = alphabet
        self._id_of = {char: i for i, char in enumerate(alphabet, start=_NUM_SPECIAL)}

    @property
    def vocab_size(self) -> int:
        """Number of ids in use (specials plus alphabet); the model's vocab must be >= this."""
        return _NUM_SPECIAL + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Returns one id per character of ``text``, without special tokens.

        Raises:
            ValueError: a character is not in the alphabet; names it and its position.
        """
        ids = []
        for position, char in enumerate(text):
            token_id = self._id_of.get(char)
            if token_id is None:
                raise ValueError(
                    f"character {char!r} at position {position} of {text!r} is not in the "
                    f"tokenizer alphabet {self.alphabet!r}"
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Returns the text up to the first ``eos_id``, skipping pad and bos.

        The model's vocabulary is usually larger than this tokenizer's, so a sampled id
        may have no character; it decodes to U+FFFD instead of raising, because a bad
        sample must cost a reward, not the run.

        Args:
            ids: Token ids; ints or 0-dim tensors (a 1-D tensor iterates as those).
        """
        chars = []
        for token in ids:
            token_id = int(token)
            if token_id == self.eos_id:
                break
            if token_id in (self.pad_id, self.bos_id):
                continue
            index = token_id - _NUM_SPECIAL
            chars.append(self.alphabet[index] if 0 <= index < len(self.alphabet) else _UNKNOWN_CHAR)
        return "".join(chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One question with its single accepted answer."""

    problem_id: int
    """Index in the task's problem space: unique within the task, stable across runs."""
    prompt_text: str
    """The question, e.g. ``"17+25="``."""
    answer_text: str
    """The accepted response without the end-of-sequence token, e.g. ``"42"``."""
    prompt_ids: tuple[int, ...]
    """``bos_id`` then the prompt's character ids: what the policy is conditioned on."""


class Task(abc.ABC):
    """A finite space of problems with exact answers, split into train and held-out sets.

    A subclass defines the space (:attr:`space_size`, :meth:`problem_text`) and the length
    bounds, validating its own knobs before calling ``super().__init__``; this class draws
    the two disjoint sets and builds the token ids.

    Args:
        cfg: The task section of the run config.

    Attributes:
        name: The registered task name.
        tokenizer: The :class:`CharTokenizer` every prompt and answer is encoded with.
        eval_prompts: Held-out problems, in draw order.
        train_prompts: Training problems, in draw order; disjoint from ``eval_prompts``.

    Raises:
        ConfigError: a problem count is below 1, or together they exceed the space.
    """

    def __init__(self, cfg: TaskConfig) -> None:
        for key in ("num_train_prompts", "num_eval_prompts"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"data.task.{key}: must be >= 1, got {getattr(cfg, key)}")
        needed = cfg.num_train_prompts + cfg.num_eval_prompts
        if needed > self.space_size:
            raise ConfigError(
                f"data.task.num_train_prompts + data.task.num_eval_prompts: {needed} exceeds the "
                f"{self.space_size} distinct problems of task {cfg.name!r}"
            )
        self.name = cfg.name
        self.tokenizer = CharTokenizer()
        rng = random.Random(cfg.seed)
        # Drawn in one sequence, held-out first: disjoint by construction, and the held-out
        # set is the same whatever the training-set size.
        indices = _draw_distinct(self.space_size, needed, rng)
        self.eval_prompts = [self._problem(i) for i in indices[: cfg.num_eval_prompts]]
        self.train_prompts = [self._problem(i) for i in indices[cfg.num_eval_prompts :]]
        # Distinct indices give distinct prompts only if problem_text is injective; a
        # subclass that breaks this would leak held-out answers into training.
        prompts = {p.prompt_text for p in self.eval_prompts + self.train_prompts}
        if len(prompts) != needed:
            raise AssertionError(f"task {self.name!r} maps different indices to one prompt")

    @property
    @abc.abstractmethod
    def space_size(self) -> int:
        """Number of distinct problems."""

    @abc.abstractmethod
    def problem_text(self, index: int) -> tuple[str, str]:
        """Returns ``(prompt_text, answer_text)`` of problem ``index`` in ``[0, space_size)``."""

    @property
    @abc.abstractmethod
    def max_prompt_chars(self) -> int:
        """Longest prompt over the whole space, in characters."""

    @property
    @abc.abstractmethod
    def max_answer_chars(self) -> int:
        """Longest answer over the whole space, in characters."""

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in tokens, including ``bos``."""
        return 1 + self.max_prompt_chars

    @property
    def max_answer_tokens(self) -> int:
        """Longest correct response in tokens, including ``eos``: the generation budget."""
        return self.max_answer_chars + 1

    def sft_example(self, problem: Problem) -> tuple[list[int], list[int]]:
        """Returns ``(prompt_ids, answer_ids)`` for the supervised warm start.

        ``prompt_ids`` starts with ``bos``; ``answer_ids`` is the answer followed by
        ``eos``, so the model also learns to stop.
        """
        return list(problem.prompt_ids), self.tokenizer.encode(problem.answer_text) + [
            self.tokenizer.eos_id
        ]

    def _problem(self, index: int) -> Problem:
        prompt_text, answer_text = self.problem_text(index)
        return Problem(
            problem_id=index,
            prompt_text=prompt_text,
            answer_text=answer_text,
            prompt_ids=(self.tokenizer.bos_id, *self.tokenizer.encode(prompt_text)),
        )


def _draw_distinct(space_size: int, count: int, rng: random.Random) -> list[int]:
    """``count`` distinct indices in ``[0, space_size)``, in draw order."""
    # One draw at a time with rejection, not random.sample: sample's draw sequence depends
    # on the requested count, which would move the held-out set when the train set grows.
    seen: set[int] = set()
    order: list[int] = []
    while len(order) < count:
        index = rng.randrange(space_size)
        if index not in seen:
            seen.add(index)
            order.append(index)
    return order


TASKS: Registry[type[Task]] = Registry("task")
"""Task classes by name; :func:`build_task` looks ``TaskConfig.name`` up here."""


@TASKS.register("addition")
class AdditionTask(Task):
    """``"a+b="`` -> ``"c"`` in decimal, with ``a, b`` in ``[0, max_operand]``, ``c = a + b``.

    Index ``i`` is the ordered pair ``divmod(i, max_operand + 1)``, so ``"3+4="`` and
    ``"4+3="`` are different problems.
    """

    def __init__(self, cfg: TaskConfig) -> None:
        if cfg.max_operand < 1:
            raise ConfigError(f"data.task.max_operand: must be >= 1, got {cfg.max_operand}")
        self.max_operand = cfg.max_operand
        super().__init__(cfg)

    @property
    def space_size(self) -> int:
        return (self.max_operand + 1) ** 2

    def problem_text(self, index: int) -> tuple[str, str]:
        a, b = divmod(index, self.max_operand + 1)
        return f"{a}+{b}=", str(a + b)

    @property
    def max_prompt_chars(self) -> int:
        return 2 * len(str(self.max_operand)) + len("+=")

    @property
    def max_answer_chars(self) -> int:
        return len(str(2 * self.max_operand))


@TASKS.register("reverse")
class ReverseTask(Task):
    """``"0123="`` -> ``"3210"``: reverse a digit string of ``min_digits..max_digits`` digits.

    Leading zeros are allowed. Indices enumerate the strings by length, then by value.
    """

    def __init__(self, cfg: TaskConfig) -> None:
        if not 1 <= cfg.min_digits <= cfg.max_digits:
            raise ConfigError(
                f"data.task.min_digits, data.task.max_digits: need 1 <= min_digits <= max_digits, "
                f"got {cfg.min_digits}, {cfg.max_digits}"
            )
        self.min_digits = cfg.min_digits
        self.max_digits = cfg.max_digits
        super().__init__(cfg)

    @property
    def space_size(self) -> int:
        return sum(10**n for n in range(self.min_digits, self.max_digits + 1))

    def problem_text(self, index: int) -> tuple[str, str]:
        for length in range(self.min_digits, self.max_digits + 1):
            if index < 10**length:
                digits = f"{index:0{length}d}"
                return f"{digits}=", digits[::-1]
            index -= 10**length
        raise IndexError(f"problem index out of range for task {self.name!r}")

    @property
    def max_prompt_chars(self) -> int:
        return self.max_digits + len("=")

    @property
    def max_answer_chars(self) -> int:
        return self.max_digits


def build_task(cfg: TaskConfig) -> Task:
    """Builds the task named ``cfg.name``.

    Raises:
        UnknownNameError: no such task; the message lists the registered ones.
        ConfigError: a knob of the task is out of range.
    """
    return TASKS.get(cfg.name)(cfg)
