"""Settings: the internal snake_case model (`model`) and its loader from the config file's
MindIE/DJL names (`loader`, the only module that knows those names)."""

from server.settings.loader import (
    LoadedSettings,
    SettingsError,
    load_settings,
    redacted,
    resolve_path,
    settings_from_config,
)
from server.settings.model import (
    LISTENER_ROLES,
    AdapterEntry,
    LimitsSettings,
    Listener,
    LoggingSettings,
    LoraSettings,
    ModelSettings,
    SecuritySettings,
    ServerSettings,
    Settings,
    Tls,
)

__all__ = [
    "LISTENER_ROLES",
    "AdapterEntry",
    "LimitsSettings",
    "Listener",
    "LoadedSettings",
    "LoggingSettings",
    "LoraSettings",
    "ModelSettings",
    "SecuritySettings",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "Tls",
    "load_settings",
    "redacted",
    "resolve_path",
    "settings_from_config",
]
