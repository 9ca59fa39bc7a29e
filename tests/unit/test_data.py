"""Data layer: HF tokenizer with chat template, stop ids, prompt files, ordering, task source."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.config_loading import ConfigError
from megatron_rl.data.config import DataConfig, TaskConfig, TokenizerConfig
from megatron_rl.data.prompts import (
    PromptRecord,
    PromptSet,
    check_data_config,
    load_prompts,
)
from megatron_rl.data.tasks import build_task
from megatron_rl.data.tokenizer import (
    char_tokenizer_adapter,
    check_tokenizer_config,
    load_tokenizer,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["what is two plus two", "the answer is four", "you are a helpful assistant", "hello world"]


def _save_tokenizer(directory: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    kwargs = {"chat_template": chat_template} if chat_template else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs
    )
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    _save_tokenizer(directory, CHATML)
    # eos_token_id as a list, repeating the tokenizer's eos: the stop ids must deduplicate.
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def _reference(hf, messages) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- tokenizer


def test_encode_prompt_matches_the_chat_template(tok_dir, hf):
    tok = load_tokenizer(TokenizerConfig(), default_path=str(tok_dir))
    user = [{"role": "user", "content": "what is two plus two"}]
    assert tok.encode_prompt("what is two plus two") == _reference(hf, user)
    messages = [{"role": "system", "content": "hello"}, *user]
    assert tok.encode_prompt(messages) == _reference(hf, messages)
    assert tok.vocab_size == len(hf)


def test_system_prompt_is_prepended_only_when_missing(tok_dir, hf):
    tok = load_tokenizer(TokenizerConfig(path=str(tok_dir), system_prompt="be brief"), default_path=None)
    user = [{"role": "user", "content": "hello world"}]
    assert tok.encode_prompt("hello world") == _reference(hf, [{"role": "system", "content": "be brief"}, *user])
    own = [{"role": "system", "content": "you are a helpful assistant"}, *user]
    assert tok.encode_prompt(own) == _reference(hf, own)


def test_template_off_is_plain_encode_and_rejects_messages(tok_dir, hf):
    tok = load_tokenizer(TokenizerConfig(chat_template=False), default_path=str(tok_dir))
    assert tok.encode_prompt("the answer is four") == hf.encode("the answer is four")
    assert tok.encode_text("four") == hf.encode("four", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template"):
        tok.encode_prompt([{"role": "user", "content": "hi"}])


def test_stop_ids_and_decode_response(tok_dir, hf):
    tok = load_tokenizer(TokenizerConfig(extra_stop_tokens=["<|im_start|>"]), default_path=str(tok_dir))
    assert hf.eos_token_id == 2
    assert tok.stop_token_ids == (2, 0, 1)
    answer = tok.encode_text("the answer is four")
    assert tok.decode_response([*answer, 2, *tok.encode_text("hello")]) == "the answer is four"
    assert tok.decode_response(torch.tensor([*answer, 1, 5])) == "the answer is four"
    assert tok.decode_response(answer) == "the answer is four"


def test_char_adapter_matches_task_problems():
    task = build_task(TaskConfig(num_train_prompts=5, num_eval_prompts=3))
    tok = char_tokenizer_adapter(task.tokenizer)
    problem = task.train_prompts[0]
    assert tuple(tok.encode_prompt(problem.prompt_text)) == problem.prompt_ids
    assert tok.stop_token_ids == (task.tokenizer.eos_id,)
    assert tok.vocab_size == task.tokenizer.vocab_size
    assert tok.decode_response([*tok.encode_text("42"), task.tokenizer.eos_id, 5]) == "42"
    with pytest.raises(ValueError, match="string prompts"):
        tok.encode_prompt([{"role": "user", "content": "1+1="}])


def test_check_tokenizer_config_errors(tok_dir, tmp_path):
    check_tokenizer_config(TokenizerConfig(), str(tok_dir), model_vocab_size=400)
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"tokenizer.path: {re.escape(str(missing))} is not a directory"):
        check_tokenizer_config(TokenizerConfig(path=str(missing)), None, None)
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        check_tokenizer_config(TokenizerConfig(), str(tmp_path), None)
    with pytest.raises(ConfigError, match="tokenizer.path: not set"):
        check_tokenizer_config(TokenizerConfig(), None, None)
    no_template = tmp_path / "plain"
    _save_tokenizer(no_template, chat_template=None)
    with pytest.raises(ConfigError, match=r"tokenizer.chat_template: .* has no chat template"):
        check_tokenizer_config(TokenizerConfig(path=str(no_template)), None, None)
    check_tokenizer_config(TokenizerConfig(path=str(no_template), chat_template=False), None, None)
    with pytest.raises(ConfigError, match=r"tokenizer.path: the tokenizer has \d+ ids but model.vocab_size is 100"):
        check_tokenizer_config(TokenizerConfig(), str(tok_dir), model_vocab_size=100)
    with pytest.raises(ConfigError, match=r"tokenizer.extra_stop_tokens\[1\]: 'the answer'"):
        cfg = TokenizerConfig(extra_stop_tokens=["<|endoftext|>", "the answer"])
        check_tokenizer_config(cfg, str(tok_dir), None)


# --------------------------------------------------------------------------- prompt files

ROWS = [
    {"id": f"q{i}", "prompt": f"what is {w} plus {w}", "answer": i * 2, "level": i % 3}
    for i, w in enumerate(["one", "two", "three", "four", "five", "six"])
]


def test_jsonl_json_and_parquet_give_the_same_records(tok_dir, tmp_path):
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    jsonl = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps(ROWS))
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    import datasets

    bars_before = datasets.utils.logging.is_progress_bar_enabled()
    verbosity_before = datasets.logging.get_verbosity()
    loaded = []
    for path in (jsonl, as_json, parquet):
        cfg = DataConfig(train_files=[str(path)], metadata_keys=["level"])
        check_data_config(cfg)
        loaded.append(load_prompts(cfg, "train", tok, max_prompt_tokens=1000))
    assert loaded[0] == loaded[1] == loaded[2]
    first = loaded[0].records[0]
    assert first == PromptRecord(
        sample_id="q0",
        prompt="what is one plus one",
        prompt_ids=tuple(tok.encode_prompt("what is one plus one")),
        ground_truth="0",
        metadata={"level": 0},
    )
    assert [r.sample_id for r in loaded[0].records] == [row["id"] for row in ROWS]
    # The quiet scope leaves the global datasets settings as it found them.
    assert datasets.utils.logging.is_progress_bar_enabled() == bars_before
    assert datasets.logging.get_verbosity() == verbosity_before


def test_messages_prompts_in_jsonl_and_parquet(tok_dir, tmp_path):
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], "answer": "a"},
        {"prompt": [{"role": "user", "content": "hello world"}], "answer": "b"},
    ]
    jsonl = _write_jsonl(tmp_path / "chat.jsonl", rows)
    parquet = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    sets = [load_prompts(DataConfig(train_files=[str(p)]), "train", tok, 1000) for p in (jsonl, parquet)]
    assert sets[0] == sets[1]
    assert [r.sample_id for r in sets[0].records] == ["chat:0", "chat:1"]
    assert sets[0].records[0].prompt == rows[0]["prompt"]
    assert list(sets[0].records[1].prompt_ids) == tok.encode_prompt(rows[1]["prompt"])


def test_length_filter_counts_and_keeps_order(tok_dir, tmp_path):
    tok = load_tokenizer(TokenizerConfig(chat_template=False), str(tok_dir))
    rows = [{"prompt": "hello there", "answer": 1}, {"prompt": "hello world " * 8, "answer": 2},
            {"prompt": "what is two", "answer": 3}, {"prompt": "four " * 20, "answer": 4}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    limit = max(len(tok.encode_prompt(rows[i]["prompt"])) for i in (0, 2))
    prompt_set = load_prompts(DataConfig(train_files=[str(path)]), "train", tok, limit)
    assert prompt_set.num_filtered == 2
    assert [r.ground_truth for r in prompt_set.records] == ["1", "3"]
    with pytest.raises(ConfigError, match="data.max_prompt_tokens: all 4 train prompts"):
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 1)
    empty_eval = load_prompts(DataConfig(train_files=[str(path)]), "eval", tok, limit)
    assert empty_eval.records == [] and empty_eval.num_filtered == 0


def test_bad_rows_name_file_and_row(tok_dir, tmp_path):
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    rows = [{"id": i, "prompt": "hello", "answer": "x"} for i in range(4)]
    rows[2]["prompt"] = None
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=f"data.prompt_key: row 2 of {re.escape(str(path))} has no 'prompt'"):
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 100)
    del rows[2]["prompt"]
    rows[2]["prompt"], rows[3]["answer"] = "hello", None
    path = _write_jsonl(tmp_path / "bad_answer.jsonl", rows)
    with pytest.raises(ConfigError, match="data.answer_key: row 3 of .*bad_answer.jsonl has no 'answer'"):
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 100)
    path = _write_jsonl(tmp_path / "no_column.jsonl", [{"question": "hi", "answer": "x"}])
    with pytest.raises(ConfigError, match="data.prompt_key: row 0 of .*no_column.jsonl has no 'prompt'"):
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 100)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "hi", "answer": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"data.train_files\[1\]: cannot read .*broken.jsonl: line 2: not valid JSON"):
        good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "hi", "answer": 1}])
        load_prompts(DataConfig(train_files=[str(good), str(broken)]), "train", tok, 100)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.eval_files\[0\]: .*empty.jsonl is empty"):
        load_prompts(DataConfig(eval_files=[str(tmp_path / "empty.jsonl")]), "eval", tok, 100)
    path = _write_jsonl(tmp_path / "bad_msg.jsonl", [{"prompt": [{"role": "user"}], "answer": "x"}])
    with pytest.raises(ConfigError, match="row 0 of .*bad_msg.jsonl: message 0 must be a dict"):
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 100)


@pytest.mark.parametrize("name, content, culprit", [
    ("middle.jsonl", b'{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": \n{"prompt": "c", "answer": 3}\n',
     "line 3: not valid JSON (Expecting value at column 27)"),
    ("latin1.jsonl", b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n',
     "line 2: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"),
    ("not_a_row.jsonl", b'{"prompt": "a", "answer": 1}\n[1, 2]\n', "line 2: a JSON list, not an object (one row per line)"),
    ("document.json", b'[\n {"prompt": "a", "answer": 1},\n {"prompt": "b" "answer": 2}\n]\n',
     "line 3: not valid JSON (Expecting ',' delimiter at column 17)"),
])
def test_unparsable_file_names_the_file_and_line(tok_dir, tmp_path, name, content, culprit):
    """datasets' own message gives a byte offset within a block, or a traceback for bytes that
    are not UTF-8; the message names the line an editor shows."""
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 100)
    assert str(caught.value) == f"data.train_files[0]: cannot read {path}: {culprit}"


def test_duplicate_ids_are_named(tok_dir, tmp_path):
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    a_rows = [{"id": "x1", "prompt": "hi", "answer": 1}, {"id": "x2", "prompt": "hi", "answer": 1}]
    a = _write_jsonl(tmp_path / "a.jsonl", a_rows)
    b = _write_jsonl(tmp_path / "b.jsonl", [{"id": "x2", "prompt": "hi", "answer": 1}])
    with pytest.raises(ConfigError, match="sample id 'x2' repeats"):
        load_prompts(DataConfig(train_files=[str(a), str(b)]), "train", tok, 100)
    with pytest.raises(ConfigError, match=r"row 1 of .*a\.jsonl and row 0 of .*b\.jsonl"):
        load_prompts(DataConfig(train_files=[str(a), str(b)]), "train", tok, 100)
    # Without ids the fallback "<stem>:<row>" repeats when one file is listed twice.
    with pytest.raises(ConfigError, match="sample id 'b:0' repeats"):
        load_prompts(DataConfig(train_files=[str(b), str(b)], id_key=None), "train", tok, 100)


def test_check_data_config_errors(tmp_path):
    good = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    check_data_config(DataConfig(train_files=[str(good)]))
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError, match=f"data.train_files\\[0\\]: {re.escape(str(missing))} does not exist"):
        check_data_config(DataConfig(train_files=[str(missing)]))
    with pytest.raises(ConfigError, match=r"data.eval_files\[1\]: .*\.csv has unsupported suffix '.csv'"):
        check_data_config(DataConfig(train_files=[str(good)], eval_files=[str(good), "x.csv"]))
    with pytest.raises(ConfigError, match="data.train_files: empty"):
        check_data_config(DataConfig())
    check_data_config(DataConfig(source="task"))
    with pytest.raises(ConfigError, match="data.task.name: unknown task 'nope'"):
        check_data_config(DataConfig(source="task", task=TaskConfig(name="nope")))


# --------------------------------------------------------------------------- order and task source


def _records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(sample_id=str(i), prompt="p", prompt_ids=(i,), ground_truth="", metadata={})
        for i in range(n)
    ]


def test_at_is_a_seeded_permutation_per_epoch_and_resumes():
    records = _records(7)
    prompt_set = PromptSet(records=records, num_filtered=0)
    drawn = [prompt_set.at(p, seed=3).sample_id for p in range(21)]
    epochs = [drawn[e * 7 : (e + 1) * 7] for e in range(3)]
    assert all(sorted(epoch) == sorted(r.sample_id for r in records) for epoch in epochs)
    assert epochs[0] != epochs[1]
    expected = torch.randperm(7, generator=torch.Generator().manual_seed(3 + 1))
    assert epochs[1] == [str(int(i)) for i in expected]
    resumed = PromptSet(records=list(records), num_filtered=0)
    assert [resumed.at(p, seed=3).sample_id for p in (16, 9, 20, 0)] == [drawn[p] for p in (16, 9, 20, 0)]
    assert [prompt_set.at(p, seed=4).sample_id for p in range(7)] != epochs[0]
    with pytest.raises(IndexError):
        PromptSet(records=[], num_filtered=0).at(0, seed=0)


def test_task_source_gives_the_task_problems():
    task_cfg = TaskConfig(name="reverse", num_train_prompts=6, num_eval_prompts=4, seed=5)
    task = build_task(task_cfg)
    tok = char_tokenizer_adapter(task.tokenizer)
    cfg = DataConfig(source="task", task=task_cfg)
    for split, problems in (("train", task.train_prompts), ("eval", task.eval_prompts)):
        prompt_set = load_prompts(cfg, split, tok, max_prompt_tokens=100)
        assert prompt_set.num_filtered == 0
        assert [(r.sample_id, r.prompt, r.prompt_ids, r.ground_truth) for r in prompt_set.records] == [
            (f"reverse:{p.problem_id}", p.prompt_text, p.prompt_ids, p.answer_text) for p in problems
        ]


def test_two_processes_read_the_same_file_at_once(tok_dir, tmp_path):
    rows = [{"id": i, "prompt": f"hello {i}", "answer": i} for i in range(200)]
    path = _write_jsonl(tmp_path / "shared.jsonl", rows)
    script = textwrap.dedent(
        f"""
        import json
        from megatron_rl.data.config import DataConfig, TokenizerConfig
        from megatron_rl.data.prompts import load_prompts
        from megatron_rl.data.tokenizer import load_tokenizer
        tok = load_tokenizer(TokenizerConfig(), {str(tok_dir)!r})
        cfg = DataConfig(train_files=[{str(path)!r}])
        sets = [load_prompts(cfg, "train", tok, 1000) for _ in range(5)]
        assert all(s == sets[0] for s in sets)
        print(json.dumps([[r.sample_id, list(r.prompt_ids)] for r in sets[0].records]))
        """
    )
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [reader.communicate(timeout=120) for reader in readers]
    for reader, (_, err) in zip(readers, outputs):
        assert reader.returncode == 0, err
    tok = load_tokenizer(TokenizerConfig(), str(tok_dir))
    here = load_prompts(DataConfig(train_files=[str(path)]), "train", tok, 1000)
    expected = [[r.sample_id, list(r.prompt_ids)] for r in here.records]
    assert json.loads(outputs[0][0]) == json.loads(outputs[1][0]) == expected
    # Quiet: no progress bar or log line from datasets.
    assert "Generating" not in outputs[0][1] + outputs[1][1]
