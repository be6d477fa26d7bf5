"""One reading of a boolean written as text: ``--set`` (words only) and ``--param`` (digits too)."""

from __future__ import annotations

import pytest

from kfp_nvrx.components.core.argtypes import parse_bool


@pytest.mark.parametrize("text,value", [("true", True), ("Yes", True), ("ON", True),
                                        ("false", False), ("no", False), ("Off", False)])
def test_words_in_any_case(text: str, value: bool) -> None:
    assert parse_bool(text) is value and parse_bool(text, digits=True) is value


@pytest.mark.parametrize("text", ["1", "0", "", "maybe", "truee", " true"])
def test_anything_else_is_none(text: str) -> None:
    assert parse_bool(text) is None


def test_digits_only_when_asked() -> None:
    assert parse_bool("1", digits=True) is True and parse_bool("0", digits=True) is False
    assert parse_bool("2", digits=True) is None
