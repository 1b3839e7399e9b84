"""Which of a deployment's LoRA adapters a replica serves, changed while it serves.

Adapters are loaded into host memory on the engine's step thread, so a load
never overlaps a step; a removed adapter stops being accepted at once and is
dropped from the runtime once no running request uses it. A bad adapter is
logged and left out; it never takes the model down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from batcher.engine import Engine
from common.threads import in_own_thread
from gpu_runtime import Runtime
from schemas import AdapterSpec

log = logging.getLogger(__name__)


class ServedAdapters:
    def __init__(self, model: str):
        self.model = model
        self.names: set[str] = set()
        self._retired: set[str] = set()

    async def load(self, runtime: Runtime, specs: Iterable[AdapterSpec]) -> None:
        """Before serving starts: register every adapter of the deployment."""
        for spec in specs:
            await self._register(runtime, None, spec.name, spec.path)

    async def sync(self, runtime: Runtime, engine: Engine, specs: Iterable[AdapterSpec]) -> None:
        """The deployment's adapter list changed: add the new, retire the removed."""
        wanted = {spec.name: spec.path for spec in specs}
        for name in sorted(set(wanted) - self.names):
            await self._register(runtime, engine, name, wanted[name])
        for name in sorted(self.names - set(wanted)):
            self.names.discard(name)
            self._retired.add(name)
        await self.drop_retired(runtime, engine)

    async def drop_retired(self, runtime: Runtime, engine: Engine) -> None:
        """Unregister retired adapters that no running request uses any more."""
        for name in sorted(self._retired):
            dropped = await engine.run_between_steps(lambda n=name: runtime.unregister_adapter(n))
            if dropped:
                self._retired.discard(name)

    @property
    def has_retired(self) -> bool:
        return bool(self._retired)

    async def _register(self, runtime: Runtime, engine: Engine | None, name: str,
                        path: str) -> None:
        try:
            if engine is None:
                await in_own_thread(runtime.register_adapter, name, path)
            else:
                await engine.run_between_steps(lambda: runtime.register_adapter(name, path))
        except Exception as exc:  # a bad adapter must not take the model down
            log.error("adapter %s of %s not served: %s", name, self.model, exc)
            return
        self.names.add(name)
