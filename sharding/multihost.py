"""Multi-host runs: every process runs the same compiled steps; process 0 plans them.

Process 0 (the leader) runs the scheduler, the sampler and any server; before each compiled step it
broadcasts the step's batch plan (a small header, then the packed int32 arrays of the ``MeshBatch``) with
``multihost_utils.broadcast_one_to_all``. The other processes (followers) loop: receive a plan, run the same
step with the same inputs, repeat until the leader sends STOP. Every process holds its own shards of the
parameters and the KV cache; logits come out replicated, and only the leader samples, on one local device.
"""

from __future__ import annotations

import argparse
import logging
import os

import jax
import numpy as np

logger = logging.getLogger(__name__)

STOP, PREFILL, DECODE = 0, 1, 2
HEADER_SIZE = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-host flags every entry point takes (absent: single process, or JAX's environment)."""
    group = parser.add_argument_group("multi-host")
    group.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of process 0's coordinator (or JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=int, default=None, help="processes in the run (or JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, default=None, help="this process's index (or JAX_PROCESS_ID)")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Start ``jax.distributed`` when a multi-process run is asked for; returns whether one is running.

    Arguments fall back to ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. With none
    of them set nothing happens (one process). Must run before anything touches a JAX device.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes is None and process_id is None:
        return False
    if coordinator_address is None or num_processes is None or process_id is None:
        raise ValueError("a multi-process run needs all of --coordinator-address, --num-processes and --process-id "
                         f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id={process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("process %d of %d: %d local / %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return num_processes > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_ints(values) -> np.ndarray:
    """The leader's int32 array, on every process (the shape must agree everywhere)."""
    from jax.experimental import multihost_utils

    arr = np.ascontiguousarray(np.asarray(values, np.int32))
    return np.asarray(multihost_utils.broadcast_one_to_all(arr))


class StepChannel:
    """Leader -> followers: (kind, header fields, int32 payload) per step."""

    def send(self, kind: int, fields: tuple[int, ...] = (), payload: np.ndarray | None = None) -> None:
        if not is_leader():
            raise RuntimeError("only process 0 sends step plans")
        payload = np.zeros(0, np.int32) if payload is None else payload
        header = np.zeros(HEADER_SIZE, np.int32)
        header[0], header[1] = kind, payload.size
        header[2 : 2 + len(fields)] = fields
        broadcast_ints(header)
        if payload.size:
            broadcast_ints(payload)

    def recv(self) -> tuple[int, tuple[int, ...], np.ndarray]:
        header = broadcast_ints(np.zeros(HEADER_SIZE, np.int32))
        kind, size = int(header[0]), int(header[1])
        payload = broadcast_ints(np.zeros(size, np.int32)) if size else np.zeros(0, np.int32)
        return kind, tuple(int(x) for x in header[2:]), payload
