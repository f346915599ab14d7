"""RayExecutor: tensor-parallel ranks as Ray actors in the replica's placement group.

Rank 0 runs in the calling process (the Serve replica, which Serve places in
bundle 0 of its `placement_group_bundles`); ranks 1..tp-1 are actors pinned
to bundles 1..tp-1 of the same placement group (STRICT_PACK keeps them on one
node, so NCCL runs over NVLink). Outside a placement group (tests, a driver
script) it creates one. Ranks meet over torch.distributed on a free port of
rank 0's node. Every call runs on all ranks, so their collectives pair up.

    EngineArgs(..., tensor_parallel_size=2, distributed_executor_backend="cluster.ray_executor:RayExecutor")
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replicas.executor import Rank0Executor
from replicas.model_runner import ModelRunner, RunnerConfig
from replicas.parallel import backend_for, destroy_distributed, free_port, init_distributed


@ray.remote(num_cpus=0)
class _RankActor:
    def __init__(self, rank: int, world: int, init_method: str, cfg: RunnerConfig) -> None:
        self.args = (rank, world, init_method, cfg)
        self.runner: ModelRunner | None = None

    def start(self) -> None:
        rank, world, init_method, cfg = self.args
        if cfg.device.startswith("cuda"):
            cfg.device = "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.runner = ModelRunner(cfg, init_distributed(rank, world, init_method, backend_for(cfg.device)))

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.runner, method)(*args)
        return None if method == "execute" else result

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.close()
        destroy_distributed()


class RayExecutor(Rank0Executor):
    def __init__(self, cfg: RunnerConfig, tp_size: int) -> None:
        pg = get_current_placement_group()
        if pg is None:
            unit = {"GPU": 1} if cfg.device.startswith("cuda") else {"CPU": 0.01}
            pg = placement_group([unit] * tp_size, strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=300)
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        gpu = 1 if cfg.device.startswith("cuda") else 0
        self._actors = [
            _RankActor.options(num_gpus=gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank)).remote(rank, tp_size, init_method, cfg)
            for rank in range(1, tp_size)]
        starts = [a.start.remote() for a in self._actors]  # they block in init until rank 0 joins
        if cfg.device.startswith("cuda"):
            cfg.device = "cuda:0"
        self.runner = ModelRunner(cfg, init_distributed(0, tp_size, init_method, backend_for(cfg.device)))
        ray.get(starts)

    def _send(self, method: str, args: tuple) -> list:
        return [a.call.remote(method, *args) for a in self._actors]

    def _gather(self, pending: list) -> tuple[BaseException | None, list]:
        try:
            return None, ray.get(pending)
        except BaseException as exc:  # a worker's failure (same input, same typed error usually)
            return exc, []

    def shutdown(self) -> None:
        self.runner.close()
        try:
            ray.get([a.stop.remote() for a in self._actors], timeout=30)
        except Exception:  # noqa: BLE001 - killing them below is enough
            pass
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        destroy_distributed()
