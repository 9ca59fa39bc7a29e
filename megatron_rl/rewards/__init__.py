"""Rewards: scoring generated responses, in parallel worker processes, with timeouts.

``reward.function`` names a built-in ("math", "exact_match") or an import path
``"package.module:function"`` to a function with this signature::

    def my_reward(prompt, response, ground_truth, metadata) -> float | dict:
        ...

``prompt`` is the prompt text or its chat messages, ``response`` the generated text,
``ground_truth`` the data set's reference answer and ``metadata`` the sample's extra fields.
Return the score as a float, or a dict with a numeric ``"score"`` and any further numeric
fields, which are returned in ``RewardResult.extras`` and logged as ``reward/<name>``.
Anything else (another type, a dict without a numeric score, a NaN or infinite number) is
an error for that sample, like an exception or exceeding ``reward.timeout_s``: it scores
``reward.error_score`` and is logged with its sample id, or stops the run with
:class:`RewardError` when ``reward.fatal_errors`` is set.

Workers import the function by its path, so it must live in an importable module (on the
trainer's ``sys.path``), and may be called in several processes at once.

Modules: ``config`` (the ``reward`` section), ``core`` (records, resolving and calling a
function), ``pool`` (worker processes, timeouts), ``builtin`` (math, exact_match). Owns reward
config, scoring and the built-ins; does not own where prompts and ground
truths come from (``megatron_rl.data``) nor how scores become advantages
(``megatron_rl.algos``). Importing this package is light (no torch, no sympy), because
every reward worker process imports it.
"""
