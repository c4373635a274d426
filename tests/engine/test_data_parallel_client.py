"""runtime/data_parallel.py without processes: DataParallelClient over stand-in replicas (routing, load, aborts,
a replica's death), merge_stats, the CPU placements, and the arguments data parallelism refuses."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from nanoserve import LLM
from nanoserve.config import EngineArgs
from nanoserve.engine.block_view import GPU_STATES, grid_of
from nanoserve.engine.step_view import EngineView, StepShape
from nanoserve.runtime.data_parallel import DataParallelClient, merge_stats, placements
from nanoserve.runtime.engine_core import EngineStats
from nanoserve.runtime.routing import RoutingConfig
from nanoserve.runtime.streams import EngineDeadError
from nanoserve.sampling_params import SamplingParams

SHARED = list(range(100, 164))  # four blocks of 16 tokens


@dataclass
class Replica:
    """What DataParallelClient uses of a ChannelEngineClient."""

    engine: object = None
    stats: EngineStats = field(default_factory=EngineStats)
    error: str | None = None
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def add(self, requests) -> None:
        self.added += [request_id for request_id, *_ in requests]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _request(request_id: str, ids: list[int]):
    return (request_id, ids, SamplingParams(max_tokens=1), None)


def test_requests_follow_their_prefix_and_spread_by_load():
    replicas = [Replica(), Replica()]
    client = DataParallelClient(replicas, RoutingConfig())
    for i in range(4):
        client.add([_request(f"shared-{i}", SHARED + [i])])
    assert [len(r.added) for r in sorted(replicas, key=lambda r: -len(r.added))] == [4, 0]
    # Unrelated prompts go to the replica with fewer requests on their way (its stats have not counted them yet).
    client.add([_request("other", list(range(500, 540)))])
    idle = next(r for r in replicas if "shared-0" not in r.added)
    assert idle.added == ["other"]
    # A replica whose stats show it busy is passed over.
    busy = next(r for r in replicas if "shared-0" in r.added)
    busy.stats = EngineStats(num_running=20, num_added=4)
    client.add([_request("shared-late", SHARED + [9])])
    assert idle.added[-1] == "shared-late"
    client.abort("shared-1")
    assert all(r.aborted == ["shared-1"] for r in replicas)  # every replica is told; the one without it ignores it


def test_a_dead_replica_is_the_deployments_error():
    replicas = [Replica(), Replica()]
    client = DataParallelClient(replicas, RoutingConfig())
    replicas[1].error = "the engine process was killed by SIGKILL"
    assert client.error == "engine 1: the engine process was killed by SIGKILL"
    with pytest.raises(EngineDeadError, match="engine 1"):
        client.add([_request("late", [1, 2, 3])])
    assert not replicas[0].added


def _view(blocks: int, steps: int, busy: float) -> EngineView:
    grid = grid_of(np.zeros(blocks, dtype=np.int64), GPU_STATES)
    return EngineView(
        time=1.0,
        finished=steps,
        last_step=StepShape(1, 2, 3, 0.5),
        steps=steps,
        decode_tokens=steps,
        prefill_tokens=0,
        batch_seqs=steps,
        busy_seconds=busy,
        ttft_count=1,
        ttft_sum=0.1,
        itl_count=steps,
        itl_sum=0.01 * steps,
        grid=grid,
        cpu_grid=None,
    )


def test_merge_stats_sums_the_replicas():
    a = EngineStats(
        num_running=2,
        num_blocks=100,
        num_free_blocks=50,
        kv_usage=0.5,
        prefix_queries=10,
        prefix_hits=5,
        num_added=3,
        iteration_tokens=(1, 0) + (0,) * 13,
        iteration_tokens_sum=1,
        view=_view(100, 4, 1.0),
    )
    b = EngineStats(
        num_running=1,
        num_blocks=300,
        num_free_blocks=300,
        kv_usage=0.0,
        prefix_queries=30,
        prefix_hits=0,
        num_added=1,
        view=_view(300, 6, 0.0),
    )
    merged = merge_stats([a, b])
    assert (merged.num_running, merged.num_blocks, merged.num_free_blocks, merged.num_added) == (3, 400, 350, 4)
    assert merged.kv_usage == pytest.approx(50 / 400) and merged.prefix_hit_rate == pytest.approx(5 / 40)
    assert merged.iteration_tokens == a.iteration_tokens and merged.iteration_tokens_sum == 1
    view = merged.view
    assert view.steps == 10 and view.busy_seconds == 0.5 and view.last_step == StepShape(2, 4, 6, 0.5)
    assert view.grid.num_blocks == 400 and view.grid.num_cells == a.view.grid.num_cells + b.view.grid.num_cells
    assert merge_stats([a, EngineStats()]).view is None  # until every replica has one


def test_cpu_replicas_share_the_threads(monkeypatch):
    monkeypatch.setattr("torch.get_num_threads", lambda: 8)
    where = placements(EngineArgs(device="cpu", data_parallel_size=3, num_kv_blocks=16))
    assert [(p.index, p.env, p.num_threads) for p in where] == [(0, {}, 2), (1, {}, 2), (2, {}, 2)]


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 2, "engine_process": False}, "engine_process"),
        (
            {
                "data_parallel_size": 2,
                "nnodes": 2,
                "tensor_parallel_size": 2,
                "distributed_init_method": "tcp://127.0.0.1:1",
            },
            "data_parallel_size",
        ),
        ({"data_parallel_size": 2, "distributed_init_method": "tcp://127.0.0.1:1"}, "distributed_init_method"),
        ({"data_parallel_routing": "random"}, "data_parallel_routing"),
    ],
)
def test_what_data_parallelism_refuses(kwargs, field_name):
    with pytest.raises(ValueError, match=f"^{field_name}: "):
        EngineArgs(num_kv_blocks=16, device="cpu", **kwargs).create_config()


def test_llm_refuses_replicas():
    with pytest.raises(ValueError, match="^data_parallel_size: only `nanoserve serve` runs replicas"):
        LLM(data_parallel_size=2)
