"""``megatron-rl-smoke`` rejects what the config alone decides before any worker starts:
one line naming the key (and the layout), exit code 2."""

import subprocess
import sys

import pytest

import megatron_rl.smoke as smoke

CASES = {
    "override not YAML": (["model.num_experts=[a"], "model.num_experts: override value '[a' is not valid YAML"),
    "unknown key": (["model.num_expert=8"], "model.num_expert: unknown key"),
    "EP of the config": (["parallel.expert_model_parallel_size=3"],
                         "parallel.expert_model_parallel_size: EP (3) must divide model.num_experts (8)"),
    "experts the EP2 layout cannot split": (
        ["model.num_experts=5"],
        "parallel.expert_model_parallel_size: EP (2) must divide model.num_experts (5) "
        "(in the smoke run's EP2 alltoall layout, 2 processes)"),
    "heads the TP2 layout cannot split": (
        ["model.num_attention_heads=3", "model.num_query_groups=3"],
        "parallel.tensor_model_parallel_size: TP (2) must divide model.num_attention_heads (3) "
        "(in the smoke run's TP2+SP layout, 2 processes)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_config_errors_are_one_line_exit_2_before_any_worker(case, capsys, monkeypatch):
    overrides, expected = CASES[case]

    def no_run(*args, **kwargs):
        raise AssertionError("the smoke run started for a bad config")

    monkeypatch.setattr(smoke, "_run", no_run)
    monkeypatch.delenv("MEGATRON_RL_TRACEBACK", raising=False)
    assert smoke.main(overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron-rl-smoke: error: {expected}") and "\n" not in err, err


def test_a_bad_override_is_refused_before_megatron_is_imported():
    """Megatron-Core's import is most of the seconds a refusal took (22.6 s wall, 8.1 s of CPU
    on a loaded 2-core machine; 5.7 s and 2.3 s without it)."""
    code = ("import sys, megatron_rl.smoke as smoke; code = smoke.main(['model.num_experts=5']); "
            "assert 'megatron.core' not in sys.modules, 'imported Megatron'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("megatron-rl-smoke: error: parallel.expert_model_parallel_size")
