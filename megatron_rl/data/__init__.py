"""The RL trainer's data layer: tokenizers with chat templates, and prompt sets.

Owns the ``tokenizer`` and ``data`` config sections and turns prompt files (JSONL, JSON,
Parquet) or a built-in task into tokenized :class:`PromptRecord` lists with a resumable
seeded order (``config``: the sections; ``tokenizer``, ``prompts``, ``tasks``: the loading).
It does not own generation, rewards or the trainer's use of the records.
"""
