"""The routing record's pure math: its types (top-K expert ids and router probabilities per MoE
layer), router scores, RSPO's router shift, routing statistics and record validation.
Imports nothing of ``megatron_rl``; recording on Megatron's routers, replay and the layout
over ranks are ``megatron_rl.parallel.routing_record`` / ``routing_replay`` / ``routing_layout``."""
