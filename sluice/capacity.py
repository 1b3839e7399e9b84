"""Will a compute config fit? The planner's answer for every live worker of a placement.

Workers record their device and usable memory in PostgreSQL (a heartbeat,
`worker.heartbeat`); before the control plane stores a change it plans the
model's memory for each live worker of the placement's pools and refuses the
change, with the planner's message, if any of them could not load it. Workers
that have not been seen for `LIVE_WINDOW_S` do not count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from schemas import ModelDeployment
from sluice.errors import InvalidConfigError

LIVE_WINDOW_S = 60
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as its heartbeat last recorded it; `live` if seen within LIVE_WINDOW_S."""

    instance_id: str
    model: str
    pool: str
    device: str
    device_memory_bytes: int
    started_at: datetime
    last_seen: datetime
    live: bool
    status: str = "unknown"  # warming, serving, serving (compiled), idle, stopping, ...
    process: str = ""  # host and pid


async def check_fits(conn: asyncpg.Connection, deployment: ModelDeployment) -> None:
    """Raise InvalidConfigError if a live worker of the placement could not load this."""
    rows = await conn.fetch(
        "SELECT instance_id, pool, device, device_memory_bytes, native_bf16 FROM workers "
        "WHERE model = $1 AND pool = ANY($2::text[]) "
        "AND last_seen > now() - make_interval(secs => $3)",
        deployment.model, list(deployment.placement.compute_pools), LIVE_WINDOW_S,
    )
    for row in rows:
        problem = plan_problem(deployment, row["device"], row["device_memory_bytes"],
                               row["native_bf16"])
        if problem is not None:
            raise InvalidConfigError(
                f"refused: worker {row['instance_id']} (pool {row['pool']}, {row['device']}) "
                f"could not load this config. {problem}"
            )


def plan_problem(deployment: ModelDeployment, device: str, memory_bytes: int,
                 native_bf16: bool = False) -> str | None:
    """Why a worker on `device` (a CPU with native bf16 or not) with `memory_bytes`
    could not load `deployment`; None if it could."""
    from gpu_runtime.config import ModelConfig
    from gpu_runtime.errors import InsufficientMemoryError, ModelLoadError
    from gpu_runtime.gguf_folder import servable_dir, weights_file
    from gpu_runtime.gguf_weights import gguf_weight_bytes
    from gpu_runtime.loader import default_dtype, resolve_dtype
    from gpu_runtime.planner import MemoryRequest, plan_memory

    cc = deployment.compute_config
    try:
        folder = servable_dir(deployment.path)
        config = ModelConfig.from_dir(folder)
        gguf_file = weights_file(folder)
        weight_bytes = None if gguf_file is None else gguf_weight_bytes(gguf_file)
    except (OSError, ValueError, KeyError, ModelLoadError) as exc:
        return f"the model at {deployment.path} cannot be read: {exc}"
    dtype = cc.dtype if cc.dtype != "auto" else (
        "float32" if gguf_file is not None else default_dtype(config, device, native_bf16))
    # A CPU worker packs a tied LM head apart from the embeddings (gpu_runtime.cpu_linear).
    on_cpu = device.split(":")[0] == "cpu"
    request = MemoryRequest(dtype=resolve_dtype(dtype), kv_cache_len=cc.kv_cache_len, tp=cc.tp,
                            quantization=cc.quantization,
                            lm_head_copy=on_cpu and cc.tp == 1 and cc.compile is not True
                            and gguf_file is None, weight_bytes=weight_bytes)
    try:
        plan_memory(config, request, memory_bytes)
    except (InsufficientMemoryError, ModelLoadError) as exc:
        return str(exc)
    return None
