"""Tensor-parallel ranks: rank 0 is the engine's own ModelRunner, each other rank a process of its own that runs
the steps rank 0 sends (StepInputs) on its GPU (or CPU, with gloo), from its own CUDA graphs.

On one node rank 0 starts the others (TensorParallelWorkers.start); on several, each other node starts its ranks
with `nanoserve worker` (run_node), and all of them meet at distributed_init_method.

A rank that dies must not leave the others waiting forever. Rank 0 watches its worker processes: once one has
exited, the next step fails at once, and a step already waiting in a collective with the lost peer fails through
gloo's closed connection on the CPU. On CUDA an NCCL collective (perhaps inside a CUDA graph, perhaps waited on
later by the host) can wait with no timeout that fires, so there rank 0's process exits (status 1) after a grace
period unless the engine has stopped the workers by then. A worker exits when its parent process is gone or its
gloo connection to rank 0 breaks.
"""

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.distributed import symm_all_reduce
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.distributed.shm_broadcast import ShmBroadcast, ShmHandle
from nanoserve.worker.model_runner import ModelRunner
from nanoserve.worker.step_inputs import NO_SAMPLES, StepInputs

logger = logging.getLogger(__name__)

# How long a step may wait on a lost peer before rank 0's process exits (see the module docstring).
LOST_PEER_GRACE_S = 10.0
# torch.distributed's own timeout for collectives and the rendezvous.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def init_rank(config: EngineConfig, rank: int, init_method: str,
              ring: ShmBroadcast | None = None) -> tuple[EngineConfig, TensorParallelGroup]:
    """Join the tensor-parallel world as `rank`: this rank's config (its GPU) and its groups. ring: node 0's step
    ring, rank 0's end or this rank's (None where it could not be made or attached, and on other nodes)."""
    size, nnodes = config.args.tensor_parallel_size, config.args.nnodes
    if config.device.type == "cuda":
        local_rank = rank % (size // nnodes)
        config = dataclasses.replace(config, device=torch.device("cuda", local_rank))
        torch.cuda.set_device(config.device)
    else:
        # Every rank of a node shares its cores: torch's default of one thread per core for each would oversubscribe
        # them (TP=2 on 2 cores: 4.2 s for a generate that takes 0.085 s with one thread a rank).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size // nnodes)))
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            timeout=COLLECTIVE_TIMEOUT)
    # Host messages go through gloo whatever moves the activations (distributed/group.py says why).
    cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    tp = TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)
    _connect_host_messages(tp, ring, size // nnodes, nnodes)
    if config.device.type == "cuda":
        tp.symm = symm_all_reduce.connect(tp.group, cpu_group, config.device, size // nnodes, nnodes,
                                          disabled=config.args.disable_custom_all_reduce)
    return config, tp


def _connect_host_messages(tp: TensorParallelGroup, ring: ShmBroadcast | None, per_node: int, nnodes: int) -> None:
    """Rank 0's step messages: through the ring to node 0's ranks if every one of them has its end (decided together:
    a rank left out would wait for a gloo broadcast that never comes), through gloo to the others."""
    on_node_0 = tp.rank < per_node
    use_ring = per_node > 1 and tp.all_reduce_min_host(int(ring is not None or not on_node_0)) == 1
    if not use_ring:
        if ring is not None:
            ring.close()
        tp.host_group = tp.cpu_group
        if tp.rank == 0 and per_node > 1:
            logger.warning("tensor parallel: step inputs go through gloo (a rank has no shared-memory ring)")
        return
    # Every rank makes every group, members or not (torch.distributed's rule).
    remote = dist.new_group([0, *range(per_node, tp.size)], backend="gloo", timeout=COLLECTIVE_TIMEOUT) \
        if nnodes > 1 else None
    tp.host_ring = ring if on_node_0 else None
    tp.host_group = remote if tp.rank == 0 or not on_node_0 else None


def free_local_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_worker(config: EngineConfig, rank: int, init_method: str, ring_handle: ShmHandle | None = None) -> None:
    """A rank other than 0: build the model's shard, then run the steps rank 0 sends until it says stop.
    ring_handle: rank 0's step ring, for the ranks of its node."""
    parent = os.getppid()
    ring = None
    if ring_handle is not None:
        try:
            ring = ShmBroadcast.attach(ring_handle, rank - 1)
        except OSError as exc:
            logger.warning("rank %d: cannot attach the step ring (%s): step inputs come through gloo", rank, exc)
    config, tp = init_rank(config, rank, init_method, ring)
    _exit_with_parent(parent)
    runner = ModelRunner(config, tp)
    prev_tokens = None
    with torch.inference_mode():
        while (step := StepInputs.recv(tp)) is not None:
            _, logits = runner.execute(step, prev_tokens)
            if logits is None or step.replica_call == NO_SAMPLES:
                prev_tokens = None
                continue
            # Rank 0's samples, for the next step's pending tokens: drawn here as rank 0 draws them, or its broadcast.
            if step.replica_call >= 0:
                prev_tokens = runner.sampler.sample_replica(logits, step.temperatures, step.replica_call)
            else:
                prev_tokens = tp.broadcast(torch.empty(logits.shape[0], dtype=torch.int64, device=config.device))
    runner.release_graphs()
    _release_symm(tp)
    dist.destroy_process_group()
    # Not a normal interpreter exit: a gloo thread still freeing the last broadcast's tensor needs the GIL while
    # the interpreter shuts down, and aborted the process ("terminate called without an active exception", exit 1)
    # in about 1 run of 3.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _release_symm(tp: TensorParallelGroup) -> None:
    """Free the symmetric buffers before the group they were made with goes, once no kernel reads them."""
    if tp.symm is not None:
        torch.cuda.synchronize()
        tp.symm = None


def _exit_with_parent(parent: int) -> None:
    """End this process when the one that started it is gone (it may be killed with no chance to stop us)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


@dataclasses.dataclass
class TensorParallelWorkers:
    """Rank 0's handle on the ranks of its node that it started, and its place in the group."""

    config: EngineConfig  # rank 0's: its device
    tp: TensorParallelGroup
    processes: list[mp.Process]
    lost: str | None = None  # why a worker is gone, once one is
    stopped: bool = False

    @classmethod
    def start(cls, config: EngineConfig) -> "TensorParallelWorkers":
        args = config.args
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process has a tensor-parallel engine already "
                             "(torch.distributed has one default group a process); shut it down first")
        init_method = args.distributed_init_method or free_local_init_method()
        per_node = args.tensor_parallel_size // args.nnodes
        ring = None
        if per_node > 1:
            try:
                ring = ShmBroadcast.create(num_readers=per_node - 1)
            except OSError as exc:
                logger.warning("tensor parallel: no shared memory for the step ring (%s): step inputs go through "
                               "gloo", exc)
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        handle = ring.handle if ring is not None else None
        processes = [ctx.Process(target=run_worker, args=(config, rank, init_method, handle), daemon=True,
                                 name=f"nanoserve-tp-rank{rank}") for rank in range(1, per_node)]
        for p in processes:
            p.start()
        try:
            config, tp = init_rank(config, 0, init_method, ring)
        except BaseException:  # the workers would wait in the rendezvous for its whole timeout
            for p in processes:
                p.kill()
            if ring is not None:
                ring.close()
            raise
        workers = cls(config, tp, processes)
        threading.Thread(target=workers._watch, daemon=True, name="tp-watch").start()
        return workers

    def _watch(self) -> None:
        if not self.processes:
            return
        gone = wait([p.sentinel for p in self.processes])
        if self.stopped:
            return
        dead = next(p for p in self.processes if p.sentinel in gone)
        dead.join(timeout=5)  # its sentinel fires before it is reaped: the exit code comes with the join
        self.lost = f"tensor-parallel rank {dead.name.removeprefix('nanoserve-tp-rank')} exited ({dead.exitcode})"
        logger.error("%s: the engine cannot run on", self.lost)
        if self.config.device.type != "cuda":
            return
        deadline = time.monotonic() + LOST_PEER_GRACE_S
        while time.monotonic() < deadline:
            if self.stopped:
                return
            time.sleep(0.1)
        logger.error("the engine may wait on the lost rank forever (NCCL): exiting")
        os._exit(1)

    def check(self) -> None:
        """Raise if a worker is gone: a step must not start (it would wait for it)."""
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def explain(self, exc: Exception) -> Exception:
        """What a step that failed in a collective should say: the lost rank, when one is gone (the watcher may not
        have seen it yet), rather than gloo's closed connection."""
        # The watcher thread reaps the ranks (the one thread that does: two threads waiting on one process race for
        # its exit status); give it a moment to see a rank that has just gone.
        deadline = time.monotonic() + 1.0
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return RuntimeError(self.lost) if self.lost is not None else exc

    def stop(self, release_graphs: Callable[[], None]) -> None:
        """Stop the workers. release_graphs: rank 0's, run before NCCL's destroy of the group, which waits for every
        CUDA graph that captured one of its collectives (ModelRunner.release_graphs)."""
        if self.stopped:
            return
        self.stopped = True
        # Every rank has the stop (gloo's send returns once the peer takes it), or some rank is gone.
        delivered = self.lost is None and all(p.is_alive() for p in self.processes)
        if delivered:
            try:
                StepInputs.send_stop(self.tp)
            except RuntimeError:  # a peer went away meanwhile
                delivered = False
        try:
            # Before the join, not after: NCCL frees a communicator collectively, so the ranks must destroy it
            # together. With a rank gone, NCCL's destroy would wait for it the same way (and releasing the graphs
            # could wait on a collective it never joins): the group stays, and this process can start no other
            # tensor-parallel engine (TensorParallelWorkers.start says so). gloo's needs no peer.
            if delivered or self.config.device.type != "cuda":
                release_graphs()
                _release_symm(self.tp)
                dist.destroy_process_group()
        finally:
            for p in self.processes:
                p.join(timeout=10 if delivered else 0)  # without the stop, the others would wait for their next step
                if p.is_alive():
                    p.kill()
                    p.join()
            if self.tp.host_ring is not None:
                self.tp.host_ring.close()


def run_node(config: EngineConfig) -> int:
    """`nanoserve worker`: the ranks of node node_rank > 0, until rank 0 stops them; the exit status is 1 if one
    of them failed."""
    args = config.args
    if args.node_rank == 0:
        raise ValueError("node_rank: node 0 runs the engine (nanoserve serve / LLM); workers run on nodes 1 ..")
    per_node = args.tensor_parallel_size // args.nnodes
    ctx = mp.get_context("spawn")
    first = args.node_rank * per_node
    processes = [ctx.Process(target=run_worker, args=(config, rank, args.distributed_init_method),
                             name=f"nanoserve-tp-rank{rank}") for rank in range(first, first + per_node)]
    for p in processes:
        p.start()
    logger.info("node %d: ranks %d-%d joining %s", args.node_rank, first, first + per_node - 1,
                args.distributed_init_method)
    for p in processes:
        p.join()
    return int(any(p.exitcode for p in processes))
