"""A watch on the scheduler for the window-pool tests: every scheduled sequence holds no more window blocks than its
window and chunk can touch, and the most each pool's table held."""

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler


def watch_window_blocks(monkeypatch: pytest.MonkeyPatch, bm: BlockManager, window: int,
                        block_size: int) -> dict[str, int]:
    """Asserts the bound at every schedule; returns {"local": most window blocks, "global": most table entries} of a
    sequence, filled in as the engine runs."""
    most = {"local": 0, "global": 0}
    schedule = Scheduler.schedule

    def watched(self):
        out = schedule(self)
        for entry in out.scheduled:
            seq = entry.seq
            # The window's blocks, those of the chunk, and one each where the window and the chunk cut a block.
            assert bm.local.blocks_in_use(seq) <= -(-(window - 1 + entry.num_new_tokens) // block_size) + 1
            most["local"] = max(most["local"], bm.local.blocks_in_use(seq))
            most["global"] = max(most["global"], len(seq.block_table))
        return out

    monkeypatch.setattr(Scheduler, "schedule", watched)
    return most
