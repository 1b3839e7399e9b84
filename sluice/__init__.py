"""sluice: a Kafka-native LLM inference engine — what `import sluice` means: the SDK
and the control plane's API.

    import sluice
    client = sluice.Client()
    client.models.register(model="tiny", path="models/tiny")

- `client.py`: `Client` — requests (`stream`, `complete`), `models`, `adapters`,
  `keys`; `replies.py` reads the reply topic; `errors.py` the typed errors.
- `control_plane.py`: the registry in PostgreSQL, published on `sluice.control`;
  `placements.py` (where a model's partitions are served), `capacity.py` (does a
  compute config fit the workers' memory).
- `batch.py` (`sluice batch`), `replay.py` and `replay_source.py` (`sluice replay`:
  the logged requests read back, then run again): bulk jobs over the SDK.

It may import the rooms below it (common, schemas, gpu_runtime's config and
planner, ingest's offsets), never the faces above it
(`gateway`, `demo`, `bench`, `cli`). `python -m sluice` is the command line
(`__main__` belongs to `cli`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sluice.client import Client


def __getattr__(name: str) -> Any:
    # The SDK pulls in aiokafka and asyncpg; load it on first use so the CLI's
    # unrelated commands start fast.
    if name == "Client":
        from sluice.client import Client

        return Client
    if name in {"RequestError", "RequestTimeoutError", "SluiceError"}:
        from sluice import errors

        return getattr(errors, name)
    raise AttributeError(name)


__all__ = ["Client", "RequestError", "RequestTimeoutError", "SluiceError", "__version__"]
