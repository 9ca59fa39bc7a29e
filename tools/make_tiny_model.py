"""Build the shipped tiny pretrained Qwen3-MoE checkpoint and its arithmetic prompt files.

Owns the recipe behind ``megatron_rl/assets``: the problem split (``arithmetic/*.jsonl``),
the byte-level BPE tokenizer with a ChatML chat template, and the supervised warm start
of a small Qwen3-MoE model on the training problems only, stopped while the model is
still only partially competent so that RL has something visible to improve. It does not
own how the trainer reads those files, the rewards, or the Megatron model.

Run from the repository root (under a minute on 2 CPU cores)::

    python tools/make_tiny_model.py

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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 1234
OPERAND_MAX = 49
"""Operands are drawn from 0..OPERAND_MAX, both inclusive."""
NUM_EVAL = 200
"""Held-out problems; every other problem of the space is a training problem."""
TOKENIZER_VOCAB = 384
"""Target BPE vocabulary: 256 byte symbols, 3 special tokens, the rest merges."""
MODEL_VOCAB = 512
"""Model vocabulary: >= len(tokenizer) and divisible by 4, so TP up to 4 splits it."""
STEPS = 300
"""Supervised steps, calibrated with ``--eval-every 20`` so that held-out sampled accuracy is
about 0.3 (steps 260 / 280 / 300 / 320 / 340 gave 0.16 / 0.19 / 0.31 / 0.35 / 0.48)."""
BATCH = 64
LR = 1e-3
WARMUP = 50
MAX_NEW_TOKENS = 16
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen writes it, without Qwen's default system turn (prompts stay short)."""

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


def response_text(answer: str) -> str:
    """The assistant turn the warm start teaches (short: RL generates ~12-16 tokens)."""
    return f"\\boxed{{{answer}}}"


def build_tokenizer(train_rows: list[dict]) -> PreTrainedTokenizerFast:
    """A byte-level BPE with single-digit tokens, wrapped for transformers with the chat template."""
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
    turns = [f"user\n{row['prompt']}\nassistant\n{response_text(row['answer'])}\n" for row in train_rows]
    bpe.train_from_iterator(turns + _GENERIC_TEXT.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
        clean_up_tokenization_spaces=False,
    )


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """The ids the trainer conditions on: the user turn and the assistant header."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    """A freshly initialized Qwen3-MoE of the shape the project's Megatron model supports."""
    config = Qwen3MoeConfig(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
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


def sft_examples(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, response_ids)`` per row; the response ends with ``<|im_end|>``."""
    return [
        (
            prompt_ids(tokenizer, row["prompt"]),
            tokenizer.encode(response_text(row["answer"]), add_special_tokens=False) + [tokenizer.eos_token_id],
        )
        for row in rows
    ]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids_BT``, ``attention_mask_BT`` and ``labels_BT`` (-100 off the response)."""
    width = max(len(p) + len(r) for p, r in examples)
    input_ids_BT = torch.full((len(examples), width), pad_id)
    attention_mask_BT = torch.zeros((len(examples), width), dtype=torch.long)
    labels_BT = torch.full((len(examples), width), -100)
    for row, (prompt, response) in enumerate(examples):
        ids = prompt + response
        input_ids_BT[row, : len(ids)] = torch.tensor(ids)
        attention_mask_BT[row, : len(ids)] = 1
        labels_BT[row, len(prompt) : len(ids)] = torch.tensor(response)
    return input_ids_BT, attention_mask_BT, labels_BT


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, or None."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return found[-1].strip() if found else None


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], do_sample: bool, seed: int) -> dict[str, float]:
    """Accuracy and format rate (finished with ``<|im_end|>`` and holding a box) over ``rows``."""
    model.eval()
    torch.manual_seed(seed)
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for row in rows:
        ids = prompt_ids(tokenizer, row["prompt"])
        by_length.setdefault(len(ids), []).append((ids, row["answer"]))
    correct = formatted = 0
    # Prompts of one length batch without padding, so no attention-mask subtleties.
    for length in sorted(by_length):
        group = by_length[length]
        input_ids_BT = torch.tensor([ids for ids, _ in group])
        output_BT = model.generate(
            input_ids_BT,
            attention_mask=torch.ones_like(input_ids_BT),
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_k=0 if do_sample else None,
            top_p=1.0 if do_sample else None,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for response, (_, answer) in zip(output_BT[:, length:].tolist(), group):
            finished = tokenizer.eos_token_id in response
            text = tokenizer.decode(response[: response.index(tokenizer.eos_token_id)] if finished else response)
            boxed = boxed_answer(text)
            formatted += finished and boxed is not None
            correct += finished and boxed == answer
    model.train()
    return {"accuracy": correct / len(rows), "format": formatted / len(rows)}


def train(model, examples, pad_id: int, steps: int, eval_every: int, eval_fn) -> None:
    """AdamW, linear warmup then a constant rate; loss only on response tokens."""
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
            print(f"    held-out at step {step}: {eval_fn()}", flush=True)


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
    tokenizer_config["additional_special_tokens"] = tokenizer_config.pop("extra_special_tokens")
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("megatron_rl/assets"), help="assets directory")
    parser.add_argument("--steps", type=int, default=STEPS, help="supervised steps")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out sampled accuracy every N steps")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.time()

    train_rows, eval_rows = make_problems(SEED)
    write_jsonl(args.out / "arithmetic" / "train.jsonl", train_rows)
    write_jsonl(args.out / "arithmetic" / "eval.jsonl", eval_rows)
    tokenizer = build_tokenizer(train_rows)
    model = build_model(tokenizer)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters())} parameters")

    train(
        model,
        sft_examples(tokenizer, train_rows),
        tokenizer.pad_token_id,
        args.steps,
        args.eval_every,
        lambda: evaluate(model, tokenizer, eval_rows, do_sample=True, seed=SEED),
    )
    save_checkpoint(model, tokenizer, args.out / "tiny_qwen3_moe")

    sampled = evaluate(model, tokenizer, eval_rows, do_sample=True, seed=SEED)
    greedy = evaluate(model, tokenizer, eval_rows, do_sample=False, seed=SEED)
    print(f"held-out sampled (T=1): accuracy {sampled['accuracy']:.3f}  format {sampled['format']:.3f}")
    print(f"held-out greedy:        accuracy {greedy['accuracy']:.3f}  format {greedy['format']:.3f}")
    seen = evaluate(model, tokenizer, train_rows[:NUM_EVAL], do_sample=True, seed=SEED)
    print(f"train (first {NUM_EVAL}) sampled (T=1): accuracy {seen['accuracy']:.3f}  format {seen['format']:.3f}")
    print(f"done in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
