"""What an SGLang 0.5.23 model loader does with the tensors of one weight update, per HF architecture.

A weight update (``/update_weights_from_tensor``, ``/update_weights_from_distributed``) hands its
tensors to the model's ``load_weights`` in one call. Two of its rules decide whether pushed
weights land:

* **Load groups.** DeepSeek-V2/V3 (and Kimi-K2, Moonlight: the same ``deepseek_v3`` loader) with a
  query LoRA (``q_lora_rank`` set) fuse ``self_attn.q_a_proj`` and ``self_attn.kv_a_proj_with_mqa``
  of a layer into one parameter. The loader caches each half in a dict local to one
  ``do_load_weights`` call and loads the pair only once both are there
  (``srt/models/deepseek_common/deepseek_weight_loader.py:280-283`` ``fuse_qkv_a_proj``/
  ``cached_a_proj``, ``:436-513`` the pairing); a half that arrives without its partner in the
  same request is dropped without a word, and the old fused weight stays. Stacked
  parameters (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, experts into
  ``w13``/``w2``) are written shard by shard and may travel apart
  (``srt/models/qwen3_moe.py:1160-1167``, ``:1229-1256``).
* **Unknown names.** Qwen3-MoE, Qwen2-MoE and GLM-4.5 skip them silently
  (``qwen3_moe.py:1224-1225``, ``:1244-1246``, ``:1266-1267``; ``qwen2_moe.py:1371-1372``,
  ``:1398-1399``; ``glm4_moe.py:1195-1196``, ``:1215-1217``, ``:1238-1239``); DeepSeek warns and
  skips, except a non-expert name with ``gate_proj``/``up_proj``, which raises ``KeyError``
  (``deepseek_weight_loader.py:370-390``, ``:528-533``); Mixtral raises ``KeyError`` for names with
  ``q_proj``/``k_proj``/``v_proj`` or ``w1``/``w2``/``w3`` (``srt/models/mixtral.py:425-435``,
  ``:440-450``); GPT-OSS skips them, Qwen3.5 skips them with a warning, Qwen3-Next raises
  ``KeyError`` for any but a bias or scale (the lines are cited at :data:`RULES`). A ``KeyError`` on the tensor path is uncaught and kills the server
  (``srt/managers/scheduler.py:6370-6376``); the distributed path answers 400
  (``srt/model_executor/model_runner_components/weight_updater.py:331-341``).

Weight sync uses the groups to never split one over two buckets, and refuses up front any
name the served architecture does not load; the CPU stand-in loads by the same rules, so a
split group or an unknown name behaves there as on a real server. Does not own the HF names
themselves (``megatron_rl.checkpoint.mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.sections import ModelConfig


@dataclass(frozen=True)
class LoaderRules:
    """One architecture's loader rules (see the module docstring for the SGLang lines)."""

    architecture: str
    """HF ``model_type`` served."""
    paired: tuple[str, str] | None = None
    """Name fragments (a, b) of tensors loaded together: a name with ``b`` and the same name with ``a``
    in its place form one group (weights and FP8 scales pair separately, by their full names)."""
    paired_needs: str | None = None
    """The :class:`ModelConfig` field that must be set for ``paired`` to apply (SGLang's condition)."""
    raises_on_unknown: tuple[str, ...] = ()
    """An unknown name holding one of these fragments raises ``KeyError`` in the loader."""
    raise_exempt: tuple[str, ...] = ()
    """... unless it holds one of these (DeepSeek skips unknown expert names)."""


RULES = {
    "qwen3_moe": LoaderRules("qwen3_moe"),
    "qwen2_moe": LoaderRules("qwen2_moe"),
    "glm4_moe": LoaderRules("glm4_moe"),
    "deepseek_v3": LoaderRules("deepseek_v3", paired=("q_a_proj", "kv_a_proj_with_mqa"), paired_needs="q_lora_rank",
                               raises_on_unknown=("gate_proj", "up_proj"), raise_exempt=("mlp.experts.",)),
    "mixtral": LoaderRules("mixtral", raises_on_unknown=("q_proj", "k_proj", "v_proj", ".w1.", ".w2.", ".w3.")),
    # models/gpt_oss.py:1253-1254, :1266-1267, :1287-1288: an unknown name is skipped without a word; each
    # layer's stacked experts load whole (make_expert_params_mapping_fused, :1215-1220).
    "gpt_oss": LoaderRules("gpt_oss"),
    # models/qwen3_next.py:1259-1270: outside the stacked and expert mappings a name is looked up in
    # params_dict and raises KeyError unless it is a bias or a scale; MTP names are skipped (:1186).
    "qwen3_next": LoaderRules("qwen3_next", raises_on_unknown=("",), raise_exempt=(".bias", "_scale", "mtp")),
    # models/qwen3_5.py:2955-2960 (ConditionalGeneration), :2363-2368 (CausalLM, which qwen3_5_text.py:236-265
    # serves with the "model." prefix stripped): an unknown name is skipped with a warning.
    "qwen3_5_moe": LoaderRules("qwen3_5_moe"),
    "qwen3_5_moe_text": LoaderRules("qwen3_5_moe_text"),
}
"""Rules by HF ``model_type``."""


def loader_rules(architecture: str) -> LoaderRules:
    """The rules of ``architecture`` (an error naming the known ones otherwise)."""
    if architecture not in RULES:
        raise ValueError(f"no SGLang loader rules for architecture {architecture!r} (known: {sorted(RULES)})")
    return RULES[architecture]


def load_group(rules: LoaderRules, model: ModelConfig, name: str) -> str | None:
    """The group ``name`` must travel in (None: it may travel alone), as the loader pairs it."""
    if rules.paired is None or getattr(model, rules.paired_needs) is None:
        return None
    first, second = rules.paired
    if first in name:
        return name
    if second in name:
        return name.replace(second, first)
    return None


def unknown_name_outcome(rules: LoaderRules, name: str) -> Literal["skipped", "KeyError"]:
    """What the loader does with a name its model does not have."""
    raises = any(f in name for f in rules.raises_on_unknown) and not any(f in name for f in rules.raise_exempt)
    return "KeyError" if raises else "skipped"


class Bucketer:
    """Cuts a stream of ``(name, tensor)`` into buckets of at most ``limit_bytes`` (a tensor or
    group larger than that travels alone) without ever splitting a load group: a group's
    members are held back until the last arrives, then placed together.

    Args:
        limit_bytes: largest bucket.
        group_of: the load group of a name (None: none).
        group_sizes: members of every group in the stream (from the plan of the push).
    """

    def __init__(self, limit_bytes: int, group_of, group_sizes: dict[str, int]) -> None:
        self.limit, self.group_of, self.group_sizes = limit_bytes, group_of, group_sizes
        self._bucket, self._bytes = [], 0
        self._held: dict[str, list] = {}

    def add(self, name: str, tensor) -> list[list]:
        """Take one tensor; returns the buckets it completed (usually none)."""
        group = self.group_of(name)
        if group is None:
            return self._place([(name, tensor)])
        held = self._held.setdefault(group, [])
        held.append((name, tensor))
        if len(held) < self.group_sizes[group]:
            return []
        return self._place(self._held.pop(group))

    def finish(self) -> list[list]:
        """The last buckets; raises if a group never got all its members."""
        if self._held:
            group, members = next(iter(self._held.items()))
            raise ValueError(f"load group {group!r} got {len(members)} of {self.group_sizes[group]} tensors")
        done, self._bucket, self._bytes = ([self._bucket] if self._bucket else []), [], 0
        return done

    def _place(self, items: list) -> list[list]:
        size = sum(t.numel() * t.element_size() for _, t in items)
        done = []
        if self._bucket and self._bytes + size > self.limit:
            done.append(self._bucket)
            self._bucket, self._bytes = [], 0
        self._bucket.extend(items)
        self._bytes += size
        return done
