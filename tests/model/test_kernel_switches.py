"""The kernel switches (once the environment variables NANOSERVE_FUSED_ROPE_DECODE and NANOSERVE_PDL) are EngineArgs
fields: checked by EngineConfig.from_args, so a typo must not silently pick a path, and flags on the command line."""

import argparse

import pytest

from nanoserve.config import EngineArgs


@pytest.mark.parametrize("value,ok", [("auto", True), ("on", True), ("off", True), ("1", False), ("", False)])
def test_fused_rope_decode_field(value, ok):
    args = EngineArgs(fused_rope_decode=value)
    if ok:
        assert args.create_config().args.fused_rope_decode == value
    else:
        with pytest.raises(ValueError, match="^fused_rope_decode: must be auto, on or off"):
            args.create_config()


@pytest.mark.parametrize("value,ok", [(True, True), (False, True), ("0", False), (0, False)])
def test_pdl_field(value, ok):
    args = EngineArgs(pdl=value)
    if ok:
        assert args.create_config().args.pdl is value
    else:
        with pytest.raises(ValueError, match="^pdl: must be True or False"):
            args.create_config()


def test_defaults_and_flags():
    """The defaults pick the measured paths; the CLI takes both switches as flags generated from the fields."""
    from nanoserve.args import add_engine_args, engine_args_from

    assert EngineArgs().fused_rope_decode == "auto" and EngineArgs().pdl is True
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--fused-rope-decode", "off", "--no-pdl"]))
    assert args.fused_rope_decode == "off" and args.pdl is False
