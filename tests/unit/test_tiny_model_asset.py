"""The shipped tiny Qwen3-MoE checkpoint and arithmetic prompt files are usable as is.

Covers ``megatron_rl/assets`` (written by ``tools/make_tiny_model.py``): transformers
loads model and tokenizer, the chat template and special tokens are what the trainer
relies on, the checkpoint passes the project's HF inspection, and the prompt files parse
with unique ids and disjoint train / held-out prompts. Does not check accuracy.
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


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / "arithmetic" / name).read_text().splitlines()]


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


def test_prompt_files_parse_and_are_disjoint():
    train, held_out = _rows("train.jsonl"), _rows("eval.jsonl")
    assert len(held_out) >= 100 and len(train) >= 1000
    for row in train + held_out:
        assert set(row) == {"id", "prompt", "answer"}
        assert all(isinstance(value, str) and value for value in row.values())
    ids = [row["id"] for row in train + held_out]
    assert len(set(ids)) == len(ids)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in held_out}
