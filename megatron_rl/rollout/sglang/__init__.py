"""SGLang as the rollout engine: the HTTP client, SGLang 0.5.23's wire format, the engine
that routes generation and weight pushes, weight sync, starting and stopping servers, and
the CPU stand-in that serves SGLang's endpoints with SGLang's rules."""
