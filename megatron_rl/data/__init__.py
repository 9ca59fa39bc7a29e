"""The RL trainer's data layer: tokenizers with chat templates, and prompt sets.

Owns the ``tokenizer`` and ``data`` config sections and turns prompt files (JSONL, JSON,
Parquet) or a built-in task into tokenized :class:`PromptRecord` lists with a resumable
seeded order. It does not own generation, rewards or the trainer's use of the records.
"""

from megatron_rl.data.config import DataConfig, TokenizerConfig
from megatron_rl.data.prompts import (
    PromptRecord,
    PromptSet,
    check_data_config,
    load_prompts,
)
from megatron_rl.data.tokenizer import (
    PromptTokenizer,
    char_tokenizer_adapter,
    check_tokenizer_config,
    load_tokenizer,
)

__all__ = [
    "DataConfig",
    "PromptRecord",
    "PromptSet",
    "PromptTokenizer",
    "TokenizerConfig",
    "char_tokenizer_adapter",
    "check_data_config",
    "check_tokenizer_config",
    "load_prompts",
    "load_tokenizer",
]
