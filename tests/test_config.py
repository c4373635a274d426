"""EngineArgs' device-dependent defaults, resolved without loading a model."""

import pytest
import torch

from nanoserve.config import EngineArgs, resolve_engine_process
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.thread_client import ThreadEngineClient


def test_engine_process_is_off_on_the_cpu_unless_asked_for():
    assert EngineArgs().engine_process is None
    assert resolve_engine_process(EngineArgs(device="cpu")) is False
    assert resolve_engine_process(EngineArgs(device="cpu", engine_process=True)) is True


def test_engine_process_is_on_on_cuda_unless_turned_off(monkeypatch):
    # The device is resolved through torch.cuda.is_available(): pretend, since nothing here touches CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_engine_process(EngineArgs()) is True
    assert resolve_engine_process(EngineArgs(device="cuda")) is True
    assert resolve_engine_process(EngineArgs(engine_process=False)) is False
    assert resolve_engine_process(EngineArgs(device="cpu")) is False


@pytest.mark.parametrize("available", [False, True])
def test_an_explicit_engine_process_is_kept_whatever_the_device(monkeypatch, available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert resolve_engine_process(EngineArgs(engine_process=True)) is True
    assert resolve_engine_process(EngineArgs(engine_process=False)) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default here is the thread only without CUDA")
def test_the_server_runs_the_engine_on_a_thread_by_default_on_the_cpu():
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=16))
    try:
        assert isinstance(engine.client, ThreadEngineClient)
        assert engine.engine.config.args.engine_process is False  # resolved, as the engine reports it
    finally:
        engine.shutdown()


def test_profile_engine_is_checked_at_start(tmp_path):
    def config(**kwargs):
        return EngineArgs(num_kv_blocks=16, **kwargs).create_config()

    assert config(engine_process=True, profile_engine=str(tmp_path / "p")).args.profile_engine == str(tmp_path / "p")
    with pytest.raises(ValueError, match="^profile_engine: only the engine process"):
        config(engine_process=False, profile_engine=str(tmp_path / "p"))
    with pytest.raises(ValueError, match="^profile_engine: the directory"):
        config(engine_process=True, profile_engine=str(tmp_path / "missing" / "p"))
    with pytest.raises(ValueError, match="^profile_engine: must be a file path"):
        config(engine_process=True, profile_engine="")


@pytest.mark.parametrize("head_dim, block_size, field", [(64, 4, "block_size"), (96, 16, "model")])
def test_shapes_the_cuda_kernels_cannot_take_are_refused_at_start(monkeypatch, tmp_path, head_dim, block_size, field):
    # The check runs where the device resolves to CUDA; here the device is faked so that it runs on the CPU.
    from checkpoints import write_checkpoint

    import nanoserve.config as config

    monkeypatch.setattr(config, "resolve_device", lambda device: torch.device("cuda"))
    model_dir = write_checkpoint(tmp_path / "m", "llama", head_dim=head_dim)
    args = EngineArgs(model=str(model_dir), block_size=block_size)
    with pytest.raises(ValueError, match=f"^{field}: "):
        args.create_config()
