"""Built-in tasks: tokenizer, deterministic disjoint problem sets, exact answers, rewards."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.tasks import (
    DEFAULT_ALPHABET,
    TASKS,
    CharTokenizer,
    TaskConfig,
    build_task,
)
from megatron_rl.registry import UnknownNameError

# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) <= 256
    ids = tok.encode(DEFAULT_ALPHABET)
    assert ids == list(range(3, tok.vocab_size))
    assert tok.decode(ids) == DEFAULT_ALPHABET
    assert tok.decode(tok.encode("17+25=42")) == "17+25=42"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_decode_stops_at_eos_and_skips_pad_and_bos():
    tok = CharTokenizer()
    ids = [tok.bos_id, *tok.encode("4"), tok.pad_id, *tok.encode("2"), tok.eos_id, *tok.encode("9")]
    assert tok.decode(ids) == "42"
    assert tok.decode(torch.tensor(ids)) == "42"


def test_decode_marks_ids_outside_the_alphabet():
    tok = CharTokenizer()
    assert tok.decode([*tok.encode("4"), tok.vocab_size, 255]) == "4\ufffd\ufffd"


def test_encode_unknown_character_names_it_and_its_position():
    with pytest.raises(ValueError, match=re.escape("character '#' at position 3 of '12+#'")):
        CharTokenizer().encode("12+#")
    with pytest.raises(ValueError, match=r"character 'A' at position 0"):
        CharTokenizer().encode("A")


def test_bad_alphabets_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")
    with pytest.raises(ValueError, match="repeats '1'"):
        CharTokenizer("0121")


# --------------------------------------------------------------------------- tasks


def _addition_answer(prompt: str) -> str:
    match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    assert match, prompt
    return str(int(match.group(1)) + int(match.group(2)))


def test_addition_answers_are_the_sums_and_operands_in_range():
    task = build_task(TaskConfig(num_train_prompts=300, num_eval_prompts=50, max_operand=49))
    assert task.name == "addition"
    assert len(task.train_prompts) == 300 and len(task.eval_prompts) == 50
    for p in task.train_prompts + task.eval_prompts:
        assert p.answer_text == _addition_answer(p.prompt_text)
        assert all(0 <= int(x) <= 49 for x in p.prompt_text[:-1].split("+"))
        assert p.prompt_ids[0] == task.tokenizer.bos_id
        assert task.tokenizer.decode(p.prompt_ids) == p.prompt_text


def test_reverse_answers_are_reversed_digit_strings():
    task = build_task(
        TaskConfig(name="reverse", num_train_prompts=300, num_eval_prompts=50, max_digits=4)
    )
    lengths = set()
    for p in task.train_prompts + task.eval_prompts:
        digits = p.prompt_text.removesuffix("=")
        assert p.prompt_text.endswith("=") and digits.isdigit()
        assert "".join(reversed(digits)) == p.answer_text
        lengths.add(len(digits))
    assert lengths <= {2, 3, 4} and 4 in lengths


@pytest.mark.parametrize("name", ["addition", "reverse"])
def test_problem_sets_are_deterministic_and_disjoint(name):
    cfg = TaskConfig(name=name, num_train_prompts=400, num_eval_prompts=100, seed=7)
    first, again = build_task(cfg), build_task(cfg)
    assert first.train_prompts == again.train_prompts and first.eval_prompts == again.eval_prompts
    train_texts = {p.prompt_text for p in first.train_prompts}
    eval_texts = {p.prompt_text for p in first.eval_prompts}
    assert len(train_texts) == 400 and len(eval_texts) == 100
    assert not train_texts & eval_texts
    ids = [p.problem_id for p in first.train_prompts + first.eval_prompts]
    assert len(set(ids)) == len(ids)
    other = build_task(TaskConfig(name=name, num_train_prompts=400, num_eval_prompts=100, seed=8))
    assert {p.prompt_text for p in other.eval_prompts} != eval_texts


def test_held_out_set_does_not_depend_on_the_training_set_size():
    small = build_task(TaskConfig(num_train_prompts=10, num_eval_prompts=256))
    large = build_task(TaskConfig(num_train_prompts=2000, num_eval_prompts=256))
    assert small.eval_prompts == large.eval_prompts


def test_whole_space_can_be_drawn_and_bounds_are_tight():
    task = build_task(TaskConfig(num_train_prompts=90, num_eval_prompts=10, max_operand=9))
    every = task.train_prompts + task.eval_prompts
    assert {p.prompt_text for p in every} == {f"{a}+{b}=" for a in range(10) for b in range(10)}
    answers = [task.sft_example(p)[1] for p in every]
    assert task.max_answer_tokens == max(len(a) for a in answers) == len("18") + 1
    assert task.max_prompt_tokens == max(len(p.prompt_ids) for p in every) == len("^9+9=")


def test_default_task_bounds():
    addition = build_task(TaskConfig())
    assert addition.max_answer_tokens == len("98") + 1
    assert addition.max_prompt_tokens == len("^49+49=")
    reverse = build_task(TaskConfig(name="reverse"))
    assert reverse.max_answer_tokens == 5 + 1 and reverse.max_prompt_tokens == 1 + 5 + 1


def test_sft_example_is_prompt_then_answer_and_eos():
    task = build_task(TaskConfig(num_train_prompts=5, num_eval_prompts=5))
    problem = task.train_prompts[0]
    prompt_ids, answer_ids = task.sft_example(problem)
    assert prompt_ids == list(problem.prompt_ids)
    assert answer_ids[-1] == task.tokenizer.eos_id and task.tokenizer.eos_id not in answer_ids[:-1]
    assert task.tokenizer.decode(answer_ids) == problem.answer_text


def test_unknown_task_lists_the_available_ones():
    expected = "unknown task 'sorting'; available: addition, reverse"
    with pytest.raises(UnknownNameError, match=expected):
        build_task(TaskConfig(name="sorting"))


def test_task_names_are_unique():
    with pytest.raises(ValueError, match="task 'addition' is already registered"):
        TASKS.register("addition")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_train_prompts": 2400, "num_eval_prompts": 101},
         "data.task.num_train_prompts + data.task.num_eval_prompts: 2501 exceeds the 2500 distinct"),
        ({"num_train_prompts": 0}, "data.task.num_train_prompts: must be >= 1"),
        ({"num_eval_prompts": 0}, "data.task.num_eval_prompts: must be >= 1"),
        ({"max_operand": 0}, "data.task.max_operand: must be >= 1"),
        ({"name": "reverse", "min_digits": 3, "max_digits": 2}, "data.task.min_digits, data.task.max_digits: need"),
        ({"name": "reverse", "min_digits": 0}, "data.task.min_digits, data.task.max_digits: need"),
    ],
)
def test_bad_task_knobs_name_the_key(overrides, message):
    """By the dotted path a user writes (the task section is ``data.task``)."""
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        build_task(TaskConfig(**overrides))


# --------------------------------------------------------------------------- rewards


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(num_train_prompts=20, num_eval_prompts=10))


def _ids(task, text, *, eos=True):
    return task.tokenizer.encode(text) + ([task.tokenizer.eos_id] if eos else [])
