"""ModelRunner.run_model's choice between decode graphs, prefill graphs and an eager pass, for the inputs a draft
proposer builds on the device (worker/draft_model.py's _decode_pass): no host copies of the lengths."""

from types import SimpleNamespace

import torch

from nanoserve.layers.attention import AttentionMetadata, TorchBackend
from nanoserve.layers.step_plan import KernelPlanner
from nanoserve.worker.model_runner import ModelRunner


class _Graphs:
    """A graph runner that accepts any step it is asked about and records the ones it runs."""

    def __init__(self, fits: bool) -> None:
        self.fits, self.ran = fits, 0

    def can_run(self, *_) -> bool:
        return self.fits

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # PrefillGraphRunner.prepare builds the step's split map from the host lengths.
        assert meta.cu_seqlens_q_cpu is not None and meta.seq_lens_cpu is not None
        self.ran += 1
        return torch.zeros(input_ids.shape[0], 4)


def test_device_built_decodes_past_the_decode_graphs_run_eagerly():
    """More drafting rows than the decode graphs hold (max_num_seqs > 512): a pass whose lengths are on the device
    only cannot take a prefill graph (its map needs them on the host); it runs eagerly."""
    n = 3
    meta = AttentionMetadata(slot_mapping=torch.arange(n), cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.full((n,), 5, dtype=torch.int32),
                             block_tables=torch.zeros(n, 1, dtype=torch.int32), max_seqlen_q=1, num_decodes=n)
    prefill = _Graphs(fits=True)
    ran_eagerly = []
    runner = SimpleNamespace(graphs=_Graphs(fits=False), prefill_graphs=prefill, planner=KernelPlanner(),
                             attn_layers=[SimpleNamespace(backend=TorchBackend, head_dim=8)], device="cpu",
                             model=lambda ids, pos, m: ran_eagerly.append(m) or torch.ones(ids.shape[0], 4))
    hidden = ModelRunner.run_model(runner, torch.zeros(n, dtype=torch.int64), torch.full((n,), 4), meta)
    assert prefill.ran == 0 and len(ran_eagerly) == 1 and hidden.shape == (n, 4)
