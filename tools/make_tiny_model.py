"""Build the shipped tiny pretrained Qwen3-MoE checkpoint and its arithmetic prompt files.

Owns the recipe behind ``megatron_rl/assets``: the problem splits (``arithmetic/*.jsonl``:
"a + b"; ``arithmetic_tools/*.jsonl``: "a * b + c"), the byte-level BPE tokenizer with a
ChatML chat template that renders tool calls and tool results as Qwen3 does (and Qwen3's
response template, so ``tokenizer.parse_response`` finds tool calls), and the supervised
warm start of a small Qwen3-MoE model on the training problems only: "a + b" answered
directly, "a * b + c" answered directly or, in a share of the transcripts, through a
``calculator`` tool call, its result and the answer. It is stopped while the model is still
only partially competent (and calls the tool only sometimes), so that RL has something
visible to improve. It does not own how the trainer reads those files, the rewards, the
environments or the Megatron model.

Run from the repository root (a few minutes on 2 CPU cores)::

    python tools/make_tiny_model.py

``--teacher`` writes instead the distillation demo's teacher (``tiny_qwen3_moe_teacher``): the
same tokenizer (read back from the shipped student, so every id is the same token), a larger
model (hidden 96, expert FFN 96, and a vocabulary of 576 rows against the student's
512: the ids past the student's are padding to it) trained longer, on the "a + b" training
problems only, until it answers the held-out ones well (``docs/distillation.md``)::

    python tools/make_tiny_model.py --teacher

Reproducibility: every random draw is seeded, training runs on one CPU thread with
deterministic algorithms, and the files are written with sorted keys, so a re-run with the
same torch / tokenizers / transformers versions on the same kind of CPU writes
byte-identical files (checked by comparing sha256 of two runs). Another CPU or library
version may differ in the last float bits of the weights.

Shape legend: B sequences in a batch, T tokens per sequence, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.data.chat import ChatRenderer, MalformedToolCall
from megatron_rl.data.config import TokenizerConfig
from megatron_rl.data.tokenizer import HFPromptTokenizer
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.envs.builtin import (
    CalculatorError,
    evaluate_expression,
    format_number,
)
from megatron_rl.rollout.local.hf_generate import generate

SEED = 1234
OPERAND_MAX = 49
"""Operands are drawn from 0..OPERAND_MAX, both inclusive."""
NUM_EVAL = 200
"""Held-out problems; every other problem of the space is a training problem."""
TOKENIZER_VOCAB = 448
"""Target BPE vocabulary: 256 byte symbols, 3 special tokens, the rest merges (the 4 tool
tags are added after training, as Qwen3's are)."""
MODEL_VOCAB = 512
"""Model vocabulary: >= len(tokenizer) and divisible by 4, so TP up to 4 splits it."""
STEPS = 500
"""Supervised steps, calibrated with ``--eval-every 100`` so that RL has room on both tasks:
held-out sampled accuracy on "a + b" was 0.03 / 0.09 / 0.32 / 0.46 / 0.55 at steps 200 /
300 / 400 / 500 / 600, and on "a * b + c" 0.02 / 0.11 / 0.16 / 0.32 / 0.25, calling the
calculator in 19% / 33% / 24% / 27% / 28% of the answers (greedy decoding never does)."""
BATCH = 64
LR = 1e-3
WARMUP = 50
MAX_NEW_TOKENS = 16
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added (not special) tokens, as in Qwen3's tokenizer: they stay in decoded text."""
FACTOR_RANGE = range(2, 13)
"""Multi-step problems "a * b + c": a and b from here."""
ADDEND_RANGE = range(1, 31)
"""... and c from here."""
TOOL_SHARE = 0.3
"""Share of the multi-step training problems whose transcript calls the calculator."""
TOOL_MAX_NEW_TOKENS = 32
"""Tokens per model turn when evaluating tool use (a tool call is about 20)."""
TEACHER_SHAPE = dict(hidden_size=96, intermediate_size=96, head_dim=24, num_experts=8, moe_intermediate_size=96,
                     vocab_size=576)
"""The teacher's dimensions where they differ from the student's (``build_model``)."""
TEACHER_STEPS = 2000
"""Supervised steps of the teacher, on "a + b" only."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen writes it, without Qwen's default system turn (prompts stay short), with
Qwen3's rendering of tool calls and of "tool" messages (a user turn of ``<tool_response>``
blocks); no tool list: the tiny model learned its one tool in this warm start."""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""Qwen3's response template (transformers' ``parse_response``) without its reasoning field."""

# Generic text so the BPE learns some ordinary English merges besides the task's words;
# written for this script.
_GENERIC_TEXT = """\
You are a helpful assistant. Answer the question and put the final answer in a box.
The sum of two numbers is the number you get when you add them together.
When you subtract one number from another, the result is called the difference.
Please think step by step, then write the result. What is the answer to this problem?
A small model learns to add by reading many examples and checking its own work.
Reinforcement learning rewards the answers that are correct and discourages the rest.
"""


def make_problems(seed: int) -> tuple[list[dict], list[dict]]:
    """Returns ``(train_rows, eval_rows)``: every ``a + b`` with operands in range, split disjointly."""
    rows = [
        {"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(OPERAND_MAX + 1)
        for b in range(OPERAND_MAX + 1)
    ]
    random.Random(seed).shuffle(rows)
    return rows[NUM_EVAL:], rows[:NUM_EVAL]


def make_tool_problems(seed: int) -> tuple[list[dict], list[dict]]:
    """Returns ``(train_rows, eval_rows)``: every ``a * b + c`` in range, split disjointly."""
    rows = [
        {"id": f"mul-{a}-{b}-{c}", "prompt": f"What is {a} * {b} + {c}?", "answer": str(a * b + c)}
        for a in FACTOR_RANGE
        for b in FACTOR_RANGE
        for c in ADDEND_RANGE
    ]
    random.Random(seed + 1).shuffle(rows)
    return rows[NUM_EVAL:], rows[:NUM_EVAL]


def response_text(answer: str) -> str:
    """The assistant turn the warm start teaches (short: RL generates ~12-16 tokens)."""
    return f"\\boxed{{{answer}}}"


def tool_call_text(expression: str) -> str:
    """A calculator call as Qwen3 writes one (what the chat template renders for ``tool_calls``)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def transcript(row: dict, use_tool: bool) -> list[dict]:
    """The conversation the warm start teaches for ``row``: a direct answer, or a calculator
    call on the prompt's expression, its result, and the answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    if use_tool:
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        messages += [{"role": "assistant", "content": tool_call_text(expression)},
                     {"role": "tool", "content": row["answer"]}]
    return messages + [{"role": "assistant", "content": response_text(row["answer"])}]


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE with single-digit tokens, wrapped for transformers with the chat and
    response templates; the tool tags are added tokens."""
    bpe = Tokenizer(models.BPE())
    # Digits first so no merge ever spans two digits: the model sees numbers digit by digit.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text encodes and decode(encode(x)) == x.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts + _GENERIC_TEXT.splitlines(), trainer)
    bpe.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """The ids the trainer conditions on: the user turn and the assistant header."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def build_model(tokenizer: PreTrainedTokenizerFast, **shape) -> Qwen3MoeForCausalLM:
    """A freshly initialized Qwen3-MoE of the shape the project's Megatron model supports
    (``shape``: dimensions that differ from the student's, the teacher's)."""
    dims = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=64, head_dim=16, num_experts=8,
                moe_intermediate_size=64)
    dims.update(shape)
    config = Qwen3MoeConfig(
        **dims,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        use_sliding_window=False,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        attention_bias=False,
        router_aux_loss_coef=0.0,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    return Qwen3MoeForCausalLM(config)


def sft_example(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of a conversation: the template's ids up to the last ``<|im_end|>``,
    labels on every assistant turn's tokens (its ``<|im_end|>`` included), -100 elsewhere."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    labels = [-100] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        upto = tokenizer.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False)
        assert ids[: len(upto)] == upto and upto[: len(before)] == before, "the chat template is not append-only"
        end = len(upto) - 1 - upto[::-1].index(tokenizer.eos_token_id)  # the turn's <|im_end|>
        labels[len(before): end + 1] = ids[len(before): end + 1]
    last = len(ids) - 1 - ids[::-1].index(tokenizer.eos_token_id)
    return ids[: last + 1], labels[: last + 1]


def sft_examples(tokenizer: PreTrainedTokenizerFast, rows: list[dict], tool_rows: list[dict]) -> list:
    """The warm start's examples: every "a + b" answered directly, every "a * b + c" through the
    calculator in a ``TOOL_SHARE`` of them (a seeded choice) and directly in the others."""
    choice = random.Random(SEED + 2)
    examples = [sft_example(tokenizer, transcript(row, use_tool=False)) for row in rows]
    examples += [sft_example(tokenizer, transcript(row, use_tool=choice.random() < TOOL_SHARE)) for row in tool_rows]
    return examples


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids_BT``, ``attention_mask_BT`` and ``labels_BT`` (-100 off the assistant turns)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids_BT = torch.full((len(examples), width), pad_id)
    attention_mask_BT = torch.zeros((len(examples), width), dtype=torch.long)
    labels_BT = torch.full((len(examples), width), -100)
    for row, (ids, labels) in enumerate(examples):
        input_ids_BT[row, : len(ids)] = torch.tensor(ids)
        attention_mask_BT[row, : len(ids)] = 1
        labels_BT[row, : len(ids)] = torch.tensor(labels)
    return input_ids_BT, attention_mask_BT, labels_BT


def boxed_answer(text: str | None) -> str | None:
    """The content of the last ``\\boxed{...}``, or None."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return found[-1].strip() if found else None


def calculator_message(call, answer: str) -> tuple[dict, bool]:
    """The tool message answering one call, and whether it returned the reference answer."""
    expression = call.arguments.get("expression")
    try:
        text = format_number(evaluate_expression(expression)) if call.name == "calculator" else "error: unknown tool"
    except (CalculatorError, AttributeError) as err:
        text = f"error: {err}"
    return {"role": "tool", "content": text}, text == answer


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], temperature: float, seed: int, max_turns: int,
             max_new_tokens: int) -> dict[str, float]:
    """Accuracy, format rate and tool use over ``rows``, decoded with the rollout engine's own
    batched generation and rendered with its chat renderer; up to ``max_turns`` model turns,
    calls answered by the calculator. ``format``: the answer turn finished with ``<|im_end|>``
    and holds a box; ``tool_use``: called the tool; ``correct_tool_use``: a call returned the
    reference answer."""
    model.eval()
    renderer = ChatRenderer(HFPromptTokenizer(tokenizer, TokenizerConfig(), (tokenizer.eos_token_id,)))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,))
    generator = torch.Generator().manual_seed(seed)
    conversations = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    ids = [prompt_ids(tokenizer, row["prompt"]) for row in rows]
    answers: dict[int, str | None] = {}
    used, correct_use = set(), set()
    live = list(range(len(rows)))
    for _ in range(max_turns):
        if not live:
            break
        outputs = generate(model, [ids[i] for i in live], params, generator=generator, return_routes=False,
                           max_length=model.config.max_position_embeddings)
        going = []
        for i, g in zip(live, outputs):
            text = renderer.turn_text(g.output_ids)
            try:
                calls = renderer.tool_calls(tokenizer.decode(g.output_ids), prefix="") if g.stopped else ()
            except MalformedToolCall:
                calls = ()
            if not g.stopped or not calls:
                answers[i] = text if g.stopped else None
                continue
            used.add(i)
            conversations[i].append({"role": "assistant", "content": text})
            replies = [calculator_message(call, rows[i]["answer"]) for call in calls]
            correct_use.update([i] if any(ok for _, ok in replies) else [])
            observation = renderer.observation_ids(conversations[i], [m for m, _ in replies])
            conversations[i] += [m for m, _ in replies]
            ids[i] = ids[i] + g.output_ids + observation
            if len(ids[i]) + max_new_tokens <= model.config.max_position_embeddings:
                going.append(i)
        live = going
    model.train()
    n = len(rows)
    correct = sum(boxed_answer(answers.get(i)) == row["answer"] for i, row in enumerate(rows))
    formatted = sum(boxed_answer(answers.get(i)) is not None for i in range(n))
    return {"accuracy": correct / n, "format": formatted / n, "tool_use": len(used) / n,
            "correct_tool_use": len(correct_use) / n}


def train(model, examples, pad_id: int, steps: int, eval_every: int, eval_fn) -> None:
    """AdamW, linear warmup then a constant rate; loss only on the assistant turns."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    # No decay: then the model after N steps is the same whatever --steps says, so the
    # --eval-every curve of one long run tells directly where to stop.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    # A private generator: evaluation's sampling must not change which batches training sees.
    batch_rng = torch.Generator().manual_seed(SEED)
    order: list[int] = []
    model.train()
    start = time.time()
    for step in range(1, steps + 1):
        if len(order) < BATCH:
            order += torch.randperm(len(examples), generator=batch_rng).tolist()
        batch, order = [examples[i] for i in order[:BATCH]], order[BATCH:]
        input_ids_BT, attention_mask_BT, labels_BT = collate(batch, pad_id)
        loss = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:6.1f}s", flush=True)
        if eval_every and step % eval_every == 0:
            print(f"    held-out at step {step}:", flush=True)
            eval_fn()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, keys in a fixed order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def save_checkpoint(model, tokenizer, directory: Path) -> None:
    """``save_pretrained`` both, chat template kept inside ``tokenizer_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    # Hub Qwen3-MoE checkpoints (and SGLang, transformers 4.x) spell these two keys so;
    # transformers 5 writes num_local_experts and rope_parameters, which stay as well.
    config["num_experts"] = config["num_local_experts"]
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # transformers 5 names its fast-tokenizer class TokenizersBackend and lists extra special
    # tokens under extra_special_tokens; 4.x (which SGLang pins) knows only the older
    # spellings, which 5 reads as well.
    tokenizer_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for loader_only in ("is_local", "local_files_only"):  # from_pretrained's own arguments (the teacher's)
        tokenizer_config.pop(loader_only, None)
    tokenizer_config["additional_special_tokens"] = tokenizer_config.pop(
        "extra_special_tokens", tokenizer_config.get("additional_special_tokens"))
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def make_teacher(out: Path, steps: int, eval_every: int) -> None:
    """The distillation demo's teacher: the shipped student's tokenizer, :data:`TEACHER_SHAPE`,
    trained on the "a + b" training problems (the student's prompt files) only."""
    started = time.time()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out / "tiny_qwen3_moe"))
    tokenizer.response_template = RESPONSE_TEMPLATE
    train_rows, eval_rows = make_problems(SEED)
    model = build_model(tokenizer, **TEACHER_SHAPE)
    print(f"teacher: {sum(p.numel() for p in model.parameters())} parameters")

    def report(tag: str) -> None:
        for label, temperature in (("sampled (T=1)", 1.0), ("greedy", 0.0)):
            got = evaluate(model, tokenizer, eval_rows, temperature, SEED, 1, MAX_NEW_TOKENS)
            print(f"{tag} a + b {label:13s} accuracy {got['accuracy']:.3f}  format {got['format']:.3f}", flush=True)

    examples = [sft_example(tokenizer, transcript(row, use_tool=False)) for row in train_rows]
    train(model, examples, tokenizer.pad_token_id, steps, eval_every, lambda: report("    held-out"))
    save_checkpoint(model, tokenizer, out / "tiny_qwen3_moe_teacher")
    report("held-out")
    print(f"done in {time.time() - started:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("megatron_rl/assets"), help="assets directory")
    parser.add_argument("--steps", type=int, default=None, help="supervised steps (default: the model's own)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out sampled accuracy every N steps")
    parser.add_argument("--teacher", action="store_true", help="write the distillation demo's teacher instead")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.teacher:
        make_teacher(args.out, args.steps or TEACHER_STEPS, args.eval_every)
        return
    args.steps = args.steps or STEPS
    started = time.time()

    train_rows, eval_rows = make_problems(SEED)
    tool_train, tool_eval = make_tool_problems(SEED)
    write_jsonl(args.out / "arithmetic" / "train.jsonl", train_rows)
    write_jsonl(args.out / "arithmetic" / "eval.jsonl", eval_rows)
    write_jsonl(args.out / "arithmetic_tools" / "train.jsonl", tool_train)
    write_jsonl(args.out / "arithmetic_tools" / "eval.jsonl", tool_eval)
    texts = [f"user\n{row['prompt']}\nassistant\n{response_text(row['answer'])}\n" for row in train_rows]
    texts += [m["content"] for row in tool_train[:500] for m in transcript(row, use_tool=True)]
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters())} parameters")

    def report(tag: str, sample_seed: int = SEED) -> None:
        for name, rows, turns, new in (("a + b", eval_rows, 1, MAX_NEW_TOKENS),
                                       ("a * b + c", tool_eval, 3, TOOL_MAX_NEW_TOKENS)):
            for label, temperature in (("sampled (T=1)", 1.0), ("greedy", 0.0)):
                got = evaluate(model, tokenizer, rows, temperature, sample_seed, turns, new)
                print(f"{tag} {name:9s} {label:13s} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)

    train(model, sft_examples(tokenizer, train_rows, tool_train), tokenizer.pad_token_id, args.steps,
          args.eval_every, lambda: report("    held-out"))
    save_checkpoint(model, tokenizer, args.out / "tiny_qwen3_moe")
    report("held-out")
    print(f"done in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
