"""Settings: one typed tree, loaded once from layered sources (see `loader`)."""

from server.settings.loader import (
    LoadedSettings,
    LoggingSection,
    ServerSection,
    Settings,
    SettingsError,
    load_settings,
    redacted,
    resolve_path,
)

__all__ = [
    "LoadedSettings",
    "LoggingSection",
    "ServerSection",
    "Settings",
    "SettingsError",
    "load_settings",
    "redacted",
    "resolve_path",
]
