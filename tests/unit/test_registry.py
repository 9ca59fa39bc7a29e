"""The generic name registry: unique names, helpful errors for unknown ones."""

from __future__ import annotations

import pytest

from megatron_rl.registry import Registry, UnknownNameError


def test_register_get_and_names():
    reg: Registry = Registry("widget")

    @reg.register("beta")
    def beta():
        return "b"

    @reg.register("alpha")
    def alpha():
        return "a"

    assert reg.get("alpha") is alpha and reg.get("beta")() == "b"
    assert reg.names() == ("alpha", "beta")
    assert "alpha" in reg and "gamma" not in reg and len(reg) == 2
    assert list(reg) == ["alpha", "beta"]


def test_duplicate_name_is_rejected():
    reg: Registry = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 2)
    assert reg.get("a")() == 1


def test_duplicate_between_decorator_creation_and_application_is_rejected():
    reg: Registry = Registry("widget")
    first, second = reg.register("a"), reg.register("a")
    first(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        second(lambda: 2)


def test_unknown_name_lists_available_names():
    reg: Registry = Registry("widget")
    reg.register("x")(1)
    reg.register("y")(2)
    with pytest.raises(UnknownNameError) as info:
        reg.get("z")
    assert str(info.value) == "unknown widget 'z'; available: x, y"
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownNameError, match="\\(none registered\\)"):
        Registry("empty").get("anything")


@pytest.mark.parametrize("bad", ["", None, 3])
def test_invalid_names_are_rejected(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        Registry("widget").register(bad)
    with pytest.raises(ValueError, match="kind"):
        Registry("")
