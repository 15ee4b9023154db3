"""DJL's settings, declared through its spec (`ProtocolSpec.options`): the LMI output schema
(`option.rolling_batch`, ProtocolConfig.rollingBatch) and the workflow files
(LoraConfig.workflows), which DJL registers at start."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.djl import workflows
from server.http.context import ProtocolContext, options_of


@dataclass(frozen=True, slots=True, kw_only=True)
class DjlOptions:
    # "auto" is LMI's async mode and its output schema (LMI's default); "vllm" (or "lmi-dist",
    # which DJL maps to vllm) is the legacy rolling-batch schema
    rolling_batch: str = "auto"
    workflows: tuple[str, ...] = ()  # workflow.json files or folders, resolved

    @property
    def legacy_rolling_batch(self) -> bool:
        return self.rolling_batch != "auto"


async def register_workflows(ctx: ProtocolContext) -> None:
    """The workflows of the settings, once the start-up adapters are registered: each makes
    its name an alias of its adapter (a bad one is logged and skipped)."""
    entries = list(options_of(DjlOptions, ctx).workflows)
    if not entries or ctx.server is None or not ctx.service.adapters.limits.enabled:
        return
    base = workflows.ServedBase(names=ctx.service.base_names, path=ctx.server.config.model_path)
    specs = workflows.load_workflows(entries, base)
    await workflows.register_workflows(ctx.service.adapters, specs)
