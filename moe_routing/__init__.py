"""Per-layer MoE routing records (top-K experts and router probabilities), replay and stats."""
