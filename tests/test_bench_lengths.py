"""bench/lengths.py: a recipe's lengths scaled down to a shorter context, and a given length that cannot fit
refused naming its flag."""

import argparse

import pytest

from nanoserve.bench.lengths import fit_lengths

RECIPE = {"input_len": [100, 1024], "output_len": 512}


def need(n: dict) -> int:
    return n["input_len"][1] + n["output_len"]


def test_a_recipe_that_fits_is_used_as_it_is(capsys) -> None:
    ns = argparse.Namespace(input_len=None, output_len=None)
    assert fit_lengths(ns, RECIPE, need, 4096, "x") is None
    assert (ns.input_len, ns.output_len) == ([100, 1024], 512) and capsys.readouterr().err == ""


def test_a_recipe_over_the_context_is_scaled_down_and_said_so(capsys) -> None:
    ns = argparse.Namespace(input_len=None, output_len=None)
    note = fit_lengths(ns, RECIPE, need, 512, "x", floors={"output_len": 2})
    assert need(vars(ns)) <= 512 and ns.input_len[0] < ns.input_len[1] and ns.output_len >= 2
    assert "max_model_len 512" in note and "--input-len" in note and note in capsys.readouterr().err


def test_only_the_lengths_left_to_the_recipe_are_scaled() -> None:
    ns = argparse.Namespace(input_len=[10, 400], output_len=None)
    fit_lengths(ns, RECIPE, need, 512, "x")
    assert ns.input_len == [10, 400] and ns.output_len == 112


@pytest.mark.parametrize("output_len", [None, 300])
def test_a_given_length_that_cannot_fit_names_its_flag(output_len) -> None:
    ns = argparse.Namespace(input_len=[10, 600], output_len=output_len)
    with pytest.raises(ValueError, match=r"^--input-len 10 600.*max_model_len 512"):
        fit_lengths(ns, RECIPE, need, 512, "x")


def test_a_context_too_short_for_the_floors_names_every_flag() -> None:
    ns = argparse.Namespace(input_len=None, output_len=None)
    with pytest.raises(ValueError, match="^--input-len 1 1, --output-len 8: need 9 tokens"):
        fit_lengths(ns, RECIPE, need, 4, "x", floors={"output_len": 8})
