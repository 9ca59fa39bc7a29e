"""The CPU stand-in for an SGLang 0.5.23 server: a program users run (``python -m
megatron_rl.sglang_standin.server``) that serves SGLang's endpoints by SGLang's rules over a
local engine. It imports the client's wire definitions (``megatron_rl.rollout.sglang``);
nothing in the client imports it."""
