"""--data-parallel-size N (vLLM's flag): N replicas of the engine behind the server, each request to one of them.

For a model that fits one GPU, N engines on N GPUs serve more than one engine split over them: no collective per
layer, and N schedulers batching on their own. Each replica is an engine core process (engine_core_process.py),
started with a Placement: its GPUs (CUDA_VISIBLE_DEVICES: tensor_parallel_size of them, so N x T GPUs in all, taken
in order from those this process sees) or, on the CPU, its share of this process's threads. All load their models
at once. The API server holds a ChannelEngineClient to each (a ProcessEngineClient, which also owns the process),
and a DataParallelClient over them, which AsyncEngine uses as it would one engine:

- add: each request goes to one replica, chosen by runtime/routing.py's policy (EngineArgs.data_parallel_routing,
  cache-aware by default) over the prompt's token ids, with each replica's load taken as the requests it has
  running or queued, plus those sent to it that its stats do not count yet;
- abort goes to every replica (a replica that does not have the request ignores it; aborts are rare, so this
  spares a table of which replica has which request), and setup (the tool loop, the web page's Watch) and
  abort_all go to every replica;
- stats: the replicas' EngineStats summed (merge_stats: the KV pools side by side, the web page's block grids one
  after the other); `replica_stats` keeps each one's for /metrics' per-engine series and /health;
- error: the first replica's death is the deployment's: the server stops (exit 1, as with a lost tensor-parallel
  rank), rather than serve on at a fraction of its capacity with no one noticing.
"""

import dataclasses
import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from nanoserve.config import EngineArgs
from nanoserve.engine.block_view import BlockGrid
from nanoserve.engine.frontend import engine_config, load_tokenizer
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.step_view import EngineView, StepShape
from nanoserve.runtime.engine_core import EngineStats
from nanoserve.runtime.engine_core_process import EngineCoreProcess, Placement
from nanoserve.runtime.process_client import ProcessEngineClient
from nanoserve.runtime.routing import RoutingConfig, RoutingPolicy
from nanoserve.runtime.streams import EngineDeadError, RequestStream
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

_SUMMED = (
    "num_waiting",
    "num_running",
    "num_blocks",
    "num_free_blocks",
    "prefix_queries",
    "prefix_hits",
    "prompt_tokens",
    "generation_tokens",
    "num_added",
    "num_preemptions",
    "num_cpu_blocks",
    "num_cpu_blocks_used",
    "cpu_prefix_hits",
    "iteration_tokens_sum",
)


def placements(args: EngineArgs) -> list[Placement]:
    """Where each replica runs; raises ValueError if this machine has too few GPUs for them."""
    n, tp = args.data_parallel_size, args.tensor_parallel_size
    if engine_config(args).device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if n * tp > len(gpus):
            raise ValueError(
                f"data_parallel_size: {n} replicas of tensor_parallel_size {tp} need {n * tp} GPUs, "
                f"but this process sees {len(gpus)}"
            )
        return [Placement(i, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])}) for i in range(n)]
    # torch.get_num_threads() honours OMP_NUM_THREADS and the CPUs this process may use.
    share = max(1, torch.get_num_threads() // n)
    return [Placement(i, {}, share) for i in range(n)]


def replica_args(args: EngineArgs, index: int) -> EngineArgs:
    """A replica's own arguments: its profile (--profile-engine) written to a file of its own."""
    if args.profile_engine is None:
        return args
    return dataclasses.replace(args, profile_engine=f"{args.profile_engine}.{index}")


class DataParallelClient:
    def __init__(self, replicas: list, routing: RoutingConfig) -> None:
        """Route over `replicas`, running EngineClients (ChannelEngineClient or ProcessEngineClient), one a
        replica, all of one model."""
        self.replicas = replicas
        self.engine = replicas[0].engine  # the model's frontend (config, tokenizer): the same in every replica
        self.policy = RoutingPolicy(routing, range(len(replicas)))
        self._sent = [0] * len(replicas)  # requests added per replica, as its stats' num_added will count them
        self._merged: tuple[tuple[EngineStats, ...], EngineStats] | None = None

    @classmethod
    def start(cls, args: EngineArgs) -> "DataParallelClient":
        """Start args.data_parallel_size engine processes, wait until every one has loaded its model, and route
        over them; if any fails to load, the others are stopped and its error raised."""
        config = engine_config(args)  # bad arguments fail here, before any process starts
        where = placements(args)
        spawned = [EngineCoreProcess.spawn(replica_args(args, p.index), placement=p) for p in where]
        replicas: list[ProcessEngineClient] = []
        try:
            tokenizer = load_tokenizer(config.tokenizer_dir)  # while the replicas load their models
            for core in spawned:
                replicas.append(ProcessEngineClient(args, core_process=core, tokenizer=tokenizer))
        except BaseException:
            for core in spawned[len(replicas) :]:
                core.kill()
                core.close()
            for replica in replicas:
                replica.shutdown()
            raise
        logger.info(
            "%d replicas of the engine, in processes %s%s",
            len(replicas),
            ", ".join(str(r.process.pid) for r in replicas),
            "".join(f"; replica {p.index} on GPUs {p.env['CUDA_VISIBLE_DEVICES']}" for p in where if p.env),
        )
        return cls(replicas, RoutingConfig(policy=args.data_parallel_routing))

    # -- state --------------------------------------------------------------------------------------------------
    @property
    def replica_stats(self) -> list[EngineStats]:
        return [replica.stats for replica in self.replicas]

    @property
    def stats(self) -> EngineStats:
        current = tuple(self.replica_stats)
        # The same object while no replica has stepped: readers (the engine view's events) tell changes by identity.
        if self._merged is None or any(a is not b for a, b in zip(self._merged[0], current, strict=True)):
            self._merged = (current, merge_stats(list(current)))
        return self._merged[1]

    @property
    def error(self) -> str | None:
        for index, replica in enumerate(self.replicas):
            if replica.error is not None:
                return f"engine {index}: {replica.error}"
        return None

    def loads(self) -> dict[int, int]:
        """Each live replica's requests running or queued, counting those still on their way to it."""
        loads = {}
        for index, replica in enumerate(self.replicas):
            if replica.error is None:
                s = replica.stats
                loads[index] = s.num_running + s.num_waiting + max(0, self._sent[index] - s.num_added)
        return loads

    # -- what AsyncEngine calls ---------------------------------------------------------------------------------
    def add(self, requests: list[tuple[str, list[int], SamplingParams, RequestStream]]) -> None:
        """Send each request to its replica; raises EngineDeadError, sending none, if a replica has died."""
        if (error := self.error) is not None:
            raise EngineDeadError(error)
        loads = self.loads()
        batches: dict[int, list] = {}
        for request in requests:
            index = self.policy.choose(request[1], loads)
            loads[index] += 1  # the next prompt of the same HTTP request sees this one
            batches.setdefault(index, []).append(request)
        for index, batch in batches.items():
            self.replicas[index].add(batch)
            self._sent[index] += len(batch)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            replica.abort(request_id)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def setup(self, fn: Callable[[LLMEngine], object]) -> None:
        for replica in self.replicas:
            replica.setup(fn)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()


# -- the replicas' stats as one -------------------------------------------------------------------------------
def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts summed, KV usage over all pools, the view merged (None until
    every replica has one)."""
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    num_blocks = sums["num_blocks"]
    kv_usage = sum(s.kv_usage * s.num_blocks for s in stats) / num_blocks if num_blocks else 0.0
    iteration = [s.iteration_tokens for s in stats if s.iteration_tokens]
    iteration_tokens = tuple(map(sum, zip(*iteration, strict=True))) if iteration else ()
    views = [s.view for s in stats]
    view = merge_views(views) if all(v is not None for v in views) else None
    return EngineStats(
        **sums,
        kv_usage=kv_usage,
        iteration_tokens=iteration_tokens,
        spec_decode=merge_spec_decode([s.spec_decode for s in stats if s.spec_decode is not None]),
        view=view,
    )


def merge_spec_decode(stats: list[SpecDecodeStats]) -> SpecDecodeStats | None:
    """The replicas' speculative decoding counts summed (None when it is off: in every replica, one config)."""
    if not stats:
        return None
    return SpecDecodeStats(
        stats[0].num_speculative_tokens,
        num_drafts=sum(s.num_drafts for s in stats),
        num_draft_tokens=sum(s.num_draft_tokens for s in stats),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        accepted_per_pos=[sum(pos) for pos in zip(*(s.accepted_per_pos for s in stats), strict=True)],
    )


def merge_views(views: list[EngineView]) -> EngineView:
    """Counters summed, busy time averaged (the share of time the replicas step, 0..1), grids side by side."""
    steps = [v.last_step for v in views]
    cpu_grids = [v.cpu_grid for v in views]
    return EngineView(
        time=max(v.time for v in views),
        finished=sum(v.finished for v in views),
        last_step=StepShape(
            sum(s.decode_tokens for s in steps),
            sum(s.prefill_tokens for s in steps),
            sum(s.num_seqs for s in steps),
            max(s.seconds for s in steps),
        ),
        steps=sum(v.steps for v in views),
        decode_tokens=sum(v.decode_tokens for v in views),
        prefill_tokens=sum(v.prefill_tokens for v in views),
        batch_seqs=sum(v.batch_seqs for v in views),
        busy_seconds=sum(v.busy_seconds for v in views) / len(views),
        ttft_count=sum(v.ttft_count for v in views),
        ttft_sum=sum(v.ttft_sum for v in views),
        itl_count=sum(v.itl_count for v in views),
        itl_sum=sum(v.itl_sum for v in views),
        grid=concat_grids([v.grid for v in views]),
        cpu_grid=concat_grids(cpu_grids) if all(g is not None for g in cpu_grids) else None,
    )


def concat_grids(grids: list[BlockGrid]) -> BlockGrid:
    """The pools one after the other, each keeping its cells (the web page draws replica after replica)."""
    counts = np.concatenate([g.array() for g in grids]) if grids else np.zeros((0, 0))
    return BlockGrid(grids[0].states, sum(g.num_blocks for g in grids), counts.astype("<u2").tobytes())
