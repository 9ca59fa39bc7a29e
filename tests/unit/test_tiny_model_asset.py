"""The shipped tiny Qwen3-MoE checkpoint and arithmetic prompt files are usable as is.

Covers ``megatron_rl/assets`` (written by ``tools/make_tiny_model.py``): transformers
loads model and tokenizer, the chat template and special tokens are what the trainer
relies on (tool calls and tool results rendered as Qwen3 renders them, the tool tags single
added tokens, Qwen3's response template for ``parse_response``), the checkpoint passes the
project's HF inspection, and both sets of prompt files parse with unique ids and disjoint
train / held-out prompts. Does not check accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megatron_rl
from megatron_rl.checkpoint.hf_source import inspect_hf_checkpoint

ASSETS = Path(megatron_rl.__file__).parent / "assets"
MODEL_DIR = ASSETS / "tiny_qwen3_moe"


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer, loaded through AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _rows(name: str, directory: str = "arithmetic") -> list[dict]:
    return [json.loads(line) for line in (ASSETS / directory / name).read_text().splitlines()]


def test_checkpoint_loads_and_runs(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % 4 == 0
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        logits_BTV = model(torch.tensor([ids])).logits
    assert logits_BTV.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits_BTV).all()


def test_chat_template_ends_with_assistant_header(tokenizer):
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header) :] == header
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_round_trip_and_single_digit_tokens(tokenizer):
    for text in ("\\boxed{42}", "17 + 25 = 42. The answer is \\boxed{42}.", "héllo ✓"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    digits = tokenizer.encode("1234567890", add_special_tokens=False)
    assert len(digits) == 10


def test_special_tokens_and_generation_config(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == im_end
    assert tokenizer.pad_token_id == endoftext
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in (im_end, endoftext, tokenizer.unk_token_id)
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end
    assert generation["pad_token_id"] == endoftext


def test_checkpoint_passes_inspection():
    source = inspect_hf_checkpoint(MODEL_DIR)
    assert source.architecture == "qwen3_moe"
    assert (source.model.num_experts, source.model.moe_router_topk, source.model.vocab_size) == (8, 2, 512)


@pytest.mark.parametrize("directory", ["arithmetic", "arithmetic_tools"])
def test_prompt_files_parse_and_are_disjoint(directory):
    train, held_out = _rows("train.jsonl", directory), _rows("eval.jsonl", directory)
    assert len(held_out) >= 100 and len(train) >= 1000
    for row in train + held_out:
        assert set(row) == {"id", "prompt", "answer"}
        assert all(isinstance(value, str) and value for value in row.values())
    ids = [row["id"] for row in train + held_out]
    assert len(set(ids)) == len(ids)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in held_out}


def test_tool_calls_and_results_render_as_qwen3_does(tokenizer):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7 * 8 + 15"}}}
    messages = [{"role": "user", "content": "What is 7 * 8 + 15?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "71"}, {"role": "tool", "content": "2"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ('<|im_start|>user\nWhat is 7 * 8 + 15?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
                    '{"name": "calculator", "arguments": {"expression": "7 * 8 + 15"}}\n</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\n71\n</tool_response>\n<tool_response>\n2\n</tool_response>'
                    '<|im_end|>\n<|im_start|>assistant\n')
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
        assert tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False), skip_special_tokens=True) == tag
    parsed = tokenizer.parse_response(text.split("<|im_start|>assistant\n")[1].split("<|im_start|>")[0], prefix="")
    assert parsed["tool_calls"] == [call]
