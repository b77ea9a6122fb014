"""Serving from several processes (`--distributed`): one scheduler loop per process, kept in step.

Every process loads the target sharded over the same global mesh and runs the same `Scheduler`; each
step is one SPMD program over every process's devices, so every process must admit, prefill, move and
step the same rows in the same order. Process 0 (the leader) alone listens for HTTP. At the start of
every loop iteration it hands the others what the outside world changed since the last one: the new
requests (their token ids and sampling settings), the cancellations and whether to stop, through
`jax.experimental.multihost_utils.broadcast_one_to_all` (JAX's own collectives; no side channel).
Everything else the loop decides follows from that and from the steps' outputs, which are replicated,
so every process reads the same tokens. What could decide apart is kept out: the background
preparation (each process would compile in its own order) and the harness's timed choices
(`ServeConfig.mesh_problem` refuses speculation 'auto' with several processes).

An idle leader still syncs every `HEARTBEAT_S` seconds, so the others never wait long in a collective.
"""

from __future__ import annotations

import json

import jax
import numpy as np

HEARTBEAT_S = 1.0


class Channel:
    """The leader's word each loop iteration, delivered to every process."""

    def __init__(self):
        self.leader = jax.process_index() == 0
        self.heartbeat_s = HEARTBEAT_S

    def exchange(self, message: dict | None) -> dict:
        """Returns the leader's `message` on every process (the leader passes it; the others pass None)."""
        from jax.experimental.multihost_utils import broadcast_one_to_all

        data = json.dumps(message).encode() if self.leader else b""
        n = int(np.asarray(broadcast_one_to_all(np.asarray(len(data), np.int64))))
        size = 256
        while size < n:  # a few sizes only: each compiles a broadcast program once
            size *= 4
        buf = np.zeros(size, np.uint8)
        if self.leader:
            buf[:n] = np.frombuffer(data, np.uint8)
        buf = np.asarray(broadcast_one_to_all(buf))
        return message if self.leader else json.loads(buf[:n].tobytes().decode())

    def close(self) -> None:
        """Leaves the process group once the loop has ended (every process waits for the others here), so
        no process outlives the coordinator that process 0 hosts."""
        jax.distributed.shutdown()
