"""How a prefill attention launch is laid out: query rows per tile, map rows, scratch slots for key splits, and
each step's map. The one planner of the eager path (a launch sized to its batch), the CUDA graphs (a launch sized
to a token bucket, the map filled in per step) and prefill_attention called without a map.

Plain Python and numpy, like tile_map.py, so that CPU-only installs (no Triton) can import it. The rules it
composes, with the measurements behind them, are in tile_map.py: prefill_block_m (query rows per tile),
prefill_programs_per_sm (how many programs run at once), max_kv_partials (the scratch bound) and kv_split_keys
(when and how finely long tiles' keys are split).
"""

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.kernels.prefill.split_scratch import SplitScratch, split_scratch_views
from nanoserve.kernels.prefill.tile_map import (
    max_kv_partials,
    max_prefill_tiles,
    prefill_block_m,
    prefill_programs_per_sm,
    prefill_split_map,
    split_slots_used,
)


@dataclass(frozen=True)
class PrefillLaunch:
    """What one prefill attention launch is sized for."""

    block_m: int  # query rows per tile
    num_rows: int  # map rows: the launch grid's second dimension
    max_partials: int  # scratch slots that key splits may use
    concurrency: int  # programs the device runs at once (kv_split_keys weighs splits against it)


class PrefillPlanner:
    """Prefill attention's launch for a model's heads on a device of num_sms SMs.

    pack: query heads per program (GQA packing: they share each load of a K/V tile); None packs all the query
    heads of a kv head, as the engine does. The map's rows are then run by num_q_heads // pack programs each.
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, num_sms: int, pack: int | None = None) -> None:
        self.pack = num_q_heads // num_kv_heads if pack is None else pack
        self.program_heads = num_q_heads // self.pack
        self.num_sms = num_sms

    def _launch(self, block_m: int, num_tiles: int, spare_rows: bool) -> PrefillLaunch:
        max_partials = max_kv_partials(block_m, self.program_heads)
        # A graph's grid is fixed at capture, so its pieces of split tiles take the rows its tiles leave free; an
        # eager launch may add a row for every scratch slot.
        num_rows = num_tiles + (max_partials if spare_rows else 0)
        return PrefillLaunch(block_m, num_rows, max_partials, self.num_sms * prefill_programs_per_sm(block_m))

    def for_bucket(self, num_tokens: int, max_num_seqs: int) -> PrefillLaunch:
        """The launch a CUDA graph of num_tokens tokens in at most max_num_seqs sequences captures: room for any
        batch that fits, unsplit (max_prefill_tiles)."""
        block_m = prefill_block_m(num_tokens, self.pack)
        return self._launch(block_m, max_prefill_tiles(num_tokens, max_num_seqs, block_m, self.pack), False)

    def split_map(self, launch: PrefillLaunch, cu_seqlens_q: list[int], seq_lens: list[int]) -> np.ndarray:
        """A step's map for `launch` (padded to its rows): long tiles split as far as its rows and slots allow."""
        return prefill_split_map(cu_seqlens_q, seq_lens, launch.block_m, launch.num_rows, self.program_heads,
                                 launch.concurrency, launch.max_partials, pack=self.pack)

    def for_batch(self, cu_seqlens_q: list[int], seq_lens: list[int], block_m: int | None = None,
                  ) -> tuple[PrefillLaunch, np.ndarray]:
        """An eager launch (no fixed grid) sized to this batch, and its map of just the rows it needs: every split
        the scratch bound allows. block_m: None picks it from the batch's longest query run."""
        if block_m is None:
            longest = max(cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(seq_lens)))
            block_m = prefill_block_m(longest, self.pack)
        launch = self._launch(block_m, max_prefill_tiles(cu_seqlens_q[-1], len(seq_lens), block_m, self.pack), True)
        split_map = self.split_map(launch, cu_seqlens_q, seq_lens)
        return launch, split_map[split_map[:, 0] >= 0]  # real rows come first

    def scratch_for(self, split_map: np.ndarray, block_m: int, head_dim: int,
                    device: torch.device | str) -> SplitScratch:
        """Scratch for an eager launch's map: just the slots it uses (eager steps may allocate)."""
        return SplitScratch.allocate(max(1, split_slots_used(split_map)), self.program_heads, block_m, head_dim,
                                     device)

    def shared_scratch(self, launches: list[PrefillLaunch], head_dim: int,
                       device: torch.device | str) -> list[SplitScratch]:
        """Scratch for launches that run one at a time (the graphs' buckets): views of one allocation."""
        return split_scratch_views([(launch.max_partials, launch.block_m) for launch in launches],
                                   self.program_heads, head_dim, device)
