"""Loading adapters ahead of their turn in the admission queue (server/core/admission.py), so
that an adapter slot changes hands without a load in the engine's path. A load that fails here
is left for the request's own load to report in its protocol's shape."""

from __future__ import annotations

import logging

from server.core.adapters import AdapterRegistry
from server.core.errors import GatewayError

logger = logging.getLogger("gateway.adapters")


class Prefetcher:
    def __init__(self, adapters: AdapterRegistry) -> None:
        self._adapters = adapters

    async def __call__(self, key: str) -> bool:
        """Load adapter `key` (an admission queue key) if there is room. False: no room yet.
        Compositions (their key joins names with "+") and unknown names are not loaded ahead."""
        if key not in self._adapters:
            return True
        try:
            return await self._adapters.prefetch(key)
        except GatewayError as exc:
            logger.info("adapter %s was not loaded ahead of its turn: %s", key, exc)
            return True
