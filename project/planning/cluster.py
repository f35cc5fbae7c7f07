"""A cluster as the planner sees it: how many devices, how much memory each, how fast they compute and talk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from project.parallel.float8_rules import FLOAT8_GPUS, has_float8_products
from project.runtime.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    """One of conf/cluster/*.yaml. Peaks are dense FLOP/s per device; bandwidths GB/s per device, one direction."""

    name: str
    accelerator: str  # gpu | cpu: which trainer config the planned run uses
    nodes: int
    gpus_per_node: int
    memory_gib: float
    peak_tflops: Mapping[str, float]  # by compute dtype: bf16, fp32, and fp8 where the device has float8 products
    intra_node_gbps: float
    inter_node_gbps: float
    collective_latency_us: float = 10.0
    # Device memory's bandwidth, GB/s: what float8's casts (memory-bound: each tensor read for its maximum, read
    # again and written as float8) take their time from. None: unknown, and float8 is not planned.
    memory_gbps: float | None = None
    # What a transformer block costs under tensor parallelism beyond its share of the FLOPs and its
    # collectives' bytes and latency, per microbatch, forward and backward: DTensor's dispatch and the
    # collectives' set-up, on the host. On GPUs the host runs ahead of the kernels and this hides; on a
    # CPU it is time taken from the same cores (measured for conf/cluster/cpu.yaml).
    tensor_parallel_block_overhead_ms: float = 0.0
    # Whether collectives run beside compute (NCCL on its own streams). On a CPU whose cores all compute,
    # gloo's copies and sums take their time from the same cores, so nothing is hidden.
    overlaps_communication: bool = True

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, compute_dtype: str) -> float:
        return self.peak_tflops[compute_dtype] * 1e12

    @property
    def has_float8(self) -> bool:
        """Whether its devices have float8 matrix products."""
        return has_float8_products(self.peak_tflops)

    def check_float8(self) -> None:
        """Planning float8 needs the device's float8 peak and its memory bandwidth (the casts)."""
        if not self.has_float8 or not (self.memory_gbps or 0) > 0:
            raise ConfigError(
                f"float8 on cluster={self.name}: its preset gives no float8 peak (peak_tflops.fp8) or memory bandwidth "
                f"(memory_gbps); of float8 matrix products, {FLOAT8_GPUS} (conf/cluster/h100_80gb and h200). "
                "Plan with float8=null, or add both figures to the preset."
            )

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s per device of a collective over a group of consecutive ranks `group_span` wide:
        inside a node if the group fits in one, else limited by the links between nodes."""
        gbps = self.intra_node_gbps if group_span <= self.gpus_per_node else self.inter_node_gbps
        return gbps * 1e9

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Cluster:
        cluster = cls(**{key: cfg[key] for key in cls.__dataclass_fields__ if key in cfg})
        for key in ("nodes", "gpus_per_node", "memory_gib", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(cluster, key) > 0:
                raise ConfigError(
                    f"cluster.{key}={getattr(cluster, key)} must be positive: fix it in the cluster preset or on the "
                    "command line."
                )
        if not cluster.tensor_parallel_block_overhead_ms >= 0:
            raise ConfigError(
                f"cluster.tensor_parallel_block_overhead_ms={cluster.tensor_parallel_block_overhead_ms} must be 0 or "
                "more (milliseconds)."
            )
        for dtype in ("bf16", "fp32"):
            if not cluster.peak_tflops.get(dtype, 0) > 0:
                raise ConfigError(f"cluster.peak_tflops.{dtype} must be a positive dense TFLOP/s figure per device.")
        return cluster
