"""SGLang as the rollout engine: the HTTP client, SGLang 0.5.23's wire format, the engine
that routes generation and weight pushes, weight sync, starting and stopping servers. The CPU
stand-in that serves SGLang's endpoints with SGLang's rules is a program of its own
(``megatron_rl.sglang_standin``), which imports this package's wire definitions."""
