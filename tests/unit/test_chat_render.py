"""Token-in/token-out rendering against the tokenizer's own chat template, and tool calls.

With the shipped tokenizer (ChatML with Qwen3's tool rendering) a trajectory is built by
hand the way the rollout builds it: the prompt's ids, a model turn's ids as generated, the
tool's answer through :meth:`ChatRenderer.observation_ids`, the answer turn. Its ids equal
the template's rendering of the whole conversation tokenized in one go, computed here with
transformers, and the loss mask is exactly the two model turns. A model turn whose ids are a
non-canonical tokenization of its text is reported at the position where the ids first
differ, and a template that rewrites history (drops earlier reasoning, as Qwen3's does) is
refused when it would be extended, and reported where it differs when compared.
Tool calls are parsed with transformers' ``parse_response`` and the tokenizer's response
template, or, without one, in the Hermes/Qwen JSON format; malformed calls are named.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from megatron_rl.data.chat import (
    ChatRenderer,
    MalformedToolCall,
    TemplateError,
    ToolCall,
)
from megatron_rl.data.config import TokenizerConfig
from megatron_rl.data.tokenizer import HFPromptTokenizer, load_tokenizer
from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.rollout.trajectory import TrajectoryBuilder

ASSET = Path(__file__).resolve().parents[2] / "megatron_rl" / "assets" / "tiny_qwen3_moe"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 8 + 15"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> HFPromptTokenizer:
    return load_tokenizer(TokenizerConfig(), str(ASSET))


def _turn(ids: list[int], output: list[int]) -> RolloutSample:
    return RolloutSample(prompt_ids=list(ids), output_ids=output, output_logprobs=torch.zeros(len(output)),
                         finish_reason="stop", weight_version=0)


def _hand_built(tokenizer, first_turn_ids: list[int]) -> tuple[TrajectoryBuilder, list[dict]]:
    """prompt -> tool call (``first_turn_ids``) -> tool answer -> boxed answer."""
    renderer = ChatRenderer(tokenizer)
    conversation = tokenizer.prompt_messages("What is 7 * 8 + 15?")
    b = TrajectoryBuilder(tokenizer.encode_prompt("What is 7 * 8 + 15?"))
    b.add_turn(_turn(b.ids, first_turn_ids), 0, with_routes=False)
    conversation.append({"role": "assistant", "content": renderer.turn_text(first_turn_ids)})
    tool = [{"role": "tool", "content": "71"}]
    b.add_observation(renderer.observation_ids(conversation, tool), reward=0.0)
    conversation += tool
    answer = tokenizer.encode_text("\\boxed{71}") + [tokenizer.stop_token_ids[0]]
    b.add_turn(_turn(b.ids, answer), 0, with_routes=False)
    conversation.append({"role": "assistant", "content": "\\boxed{71}"})
    return b, conversation


def test_trajectory_ids_equal_the_template_rendering_and_the_mask_is_the_model_turns(tokenizer):
    stop = tokenizer.stop_token_ids[0]
    call_ids = tokenizer.encode_text(CALL) + [stop]
    b, conversation = _hand_built(tokenizer, call_ids)
    rendered = tokenizer.hf_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert b.ids == list(rendered)[: len(b.ids)]
    # What the template writes after the last turn's stop token is not part of the trajectory.
    assert tokenizer.hf_tokenizer.decode(list(rendered)[len(b.ids):]) == "\n"
    assert ChatRenderer(tokenizer).first_mismatch(conversation, b.ids) is None
    sample = b.sample(with_routes=False)
    answer_len = len(tokenizer.encode_text("\\boxed{71}")) + 1
    env_len = len(sample.output_ids) - len(call_ids) - answer_len
    assert env_len > 0
    assert sample.loss_mask().tolist() == [True] * len(call_ids) + [False] * env_len + [True] * answer_len
    env_text = tokenizer.hf_tokenizer.decode(sample.output_ids[len(call_ids): len(call_ids) + env_len])
    assert env_text == "\n<|im_start|>user\n<tool_response>\n71\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_non_canonical_model_turn_is_reported_at_its_true_position(tokenizer):
    stop = tokenizer.stop_token_ids[0]
    canonical = tokenizer.encode_text(CALL)
    # The same text, one token spelled out character by character.
    at = next(i for i, t in enumerate(canonical) if len(tokenizer.hf_tokenizer.decode([t])) > 2)
    spelled = [tokenizer.encode_text(c)[0] for c in tokenizer.hf_tokenizer.decode([canonical[at]])]
    odd = canonical[:at] + spelled + canonical[at + 1:]
    assert tokenizer.hf_tokenizer.decode(odd) == CALL and odd != canonical
    b, conversation = _hand_built(tokenizer, odd + [stop])
    assert ChatRenderer(tokenizer).first_mismatch(conversation, b.ids) == len(b.prompt_ids) + at


def test_a_template_that_rewrites_history_is_refused_or_reported(tokenizer):
    rewriting = copy.deepcopy(tokenizer.hf_tokenizer)
    # Qwen3-style: reasoning of assistant turns before the last one is dropped.
    rewriting.chat_template = (
        "{%- for m in messages %}{%- set c = m['content'] %}"
        "{%- if m['role'] == 'assistant' and not loop.last %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok = HFPromptTokenizer(rewriting, TokenizerConfig(), tokenizer.stop_token_ids)
    renderer = ChatRenderer(tok)
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>a"}]
    with pytest.raises(TemplateError, match="not append-only|differently once messages follow"):
        renderer.observation_ids(conversation, [{"role": "user", "content": "more"}])
    prompt = tok.encode_prompt("q")
    turn = tok.encode_text("<think>hm</think>a") + [tok.stop_token_ids[0]]
    follow = tok.encode_text("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    ids = prompt + turn + follow + tok.encode_text("b") + [tok.stop_token_ids[0]]
    whole = conversation + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}]
    assert renderer.first_mismatch(whole, ids) == len(prompt)


def test_tool_calls_in_the_tokenizers_format(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert getattr(tokenizer.hf_tokenizer, "response_template", None) is not None
    prefix = tokenizer.hf_tokenizer.decode(tokenizer.encode_prompt("What is 7 * 8 + 15?"))
    expected = (ToolCall("calculator", {"expression": "7 * 8 + 15"}),)
    assert renderer.tool_calls(CALL + "<|im_end|>", prefix) == expected
    assert renderer.tool_calls("\\boxed{71}<|im_end|>", prefix) == ()
    hermes = copy.deepcopy(tokenizer.hf_tokenizer)
    hermes.response_template = None
    plain = ChatRenderer(HFPromptTokenizer(hermes, TokenizerConfig(), tokenizer.stop_token_ids))
    assert plain.tool_calls(CALL + "<|im_end|>", prefix) == expected
    for r in (renderer, plain):
        with pytest.raises(MalformedToolCall, match="JSON|json"):
            r.tool_calls('<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call><|im_end|>', prefix)
        with pytest.raises(MalformedToolCall, match="no string 'name'"):
            r.tool_calls('<tool_call>\n{"arguments": {}}\n</tool_call><|im_end|>', prefix)
        with pytest.raises(MalformedToolCall, match="not an object"):
            r.tool_calls('<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call><|im_end|>', prefix)
