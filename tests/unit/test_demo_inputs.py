"""The README's main road, checked from the config alone: the shipped checkpoint, its
tokenizer and chat template, and the prompt files it is meant for.

The prompt tokens a run builds must equal ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` of transformers' own tokenizer, token for token; and every
input the demo names is accepted by the same checks the entry points run first.
"""

from pathlib import Path

import pytest

from megatron_rl.data.prompts import load_prompts
from megatron_rl.config import load_config as load_run_config
from megatron_rl.train.prepare import (
    check_inputs,
    max_prompt_tokens,
    run_tokenizer,
)

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"


@pytest.fixture(scope="module")
def cfg():
    return load_run_config(DEMO, world_size=2)


def test_demo_model_section_comes_from_the_checkpoint(cfg):
    import json

    hf = json.loads((ASSET / "config.json").read_text())
    assert cfg.model.num_layers == hf["num_hidden_layers"] and cfg.model.num_experts == hf["num_experts"]
    assert cfg.model.vocab_size == hf["vocab_size"] and cfg.model.moe_router_topk == hf["num_experts_per_tok"]


def test_run_prompt_tokens_equal_transformers_chat_template(cfg):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)
    tokenizer = run_tokenizer(cfg)
    records = load_prompts(cfg.data, "train", tokenizer, max_prompt_tokens(cfg)).records
    assert len(records) > 100
    for record in records[:64]:
        expected = reference.apply_chat_template([{"role": "user", "content": record.prompt}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
        assert list(record.prompt_ids) == list(expected["input_ids"]), record.sample_id
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tokenizer.stop_token_ids


def test_demo_inputs_pass_the_entry_checks(cfg):
    summary = check_inputs(cfg)
    assert summary.init is not None and summary.init.kind == "hf"
    assert summary.train_prompts > 100 and summary.eval_prompts >= 100 and summary.dropped == 0
