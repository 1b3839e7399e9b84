"""sluice: a Kafka-native LLM inference engine. The public face: SDK, CLI, control plane.

    import sluice
    client = sluice.Client()
    client.models.register(model="tiny", path="models/tiny")
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
