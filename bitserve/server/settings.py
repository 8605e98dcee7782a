"""Settings for `bitserve serve`: CLI values, `BITSERVE_*` environment variables and a TOML file with
dev / staging / prod profiles, merged into the frozen config dataclasses. The only module in
bitserve that reads the environment.

Precedence: CLI > environment > TOML profile table > TOML top level > dataclass default. Every
setting is a field of a config dataclass (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig,
ServerConfig), named flat (`port`, `max_num_seqs`, `kv_cache_dtype`); only values that are set
reach the constructors, so each default lives in config.py alone. A TOML file looks like:

    port = 8000                  # any setting, for every profile
    [prod]                       # applied with --profile prod (or BITSERVE_PROFILE=prod)
    host = "0.0.0.0"
    log_format = "json"
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.engine.devices import parse_devices
from bitserve.errors import InvalidRequest
from bitserve.server.batches.config import BatchConfig
from bitserve.server.plugins.config import PluginConfig
from bitserve.server.security.config import SecurityConfig

if typing.TYPE_CHECKING:
    from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "BITSERVE_"
OTEL_STANDARD_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # OpenTelemetry's own variable: tracing's endpoint too
PROFILES = ("dev", "staging", "prod")
# Config sections: (name, dataclass). EngineConfig contributes only its scalar fields.
SECTIONS: tuple[tuple[str, type[Any]], ...] = (
    ("model", ModelConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("engine", EngineConfig),
    ("server", ServerConfig),
    ("security", SecurityConfig),
    ("batch", BatchConfig),
    ("plugins", PluginConfig),
)
_NESTED_ENGINE_FIELDS = ("model", "cache", "scheduler")


@dataclass(frozen=True, slots=True)
class SettingField:
    name: str
    value_type: type[Any]  # int, float, str or bool
    help: str
    targets: tuple[tuple[str, str], ...]  # (section, dataclass field) pairs it sets


@dataclass(frozen=True, slots=True)
class Settings:
    engine: EngineConfig
    server: ServerConfig
    sources: dict[str, str]  # setting name -> "cli" | "env" | "toml" for every value that was set
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    plugins: PluginConfig = dataclasses.field(default_factory=PluginConfig)


def _scalar_type(annotation: Any) -> type[Any]:
    """int for `int | None`, etc."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported setting type {annotation}")
        return typing.cast(type[Any], args[0])
    return typing.cast(type[Any], annotation)


def setting_fields() -> dict[str, SettingField]:
    """Every setting, by flat name. Each name has one home: a name in two sections is a bug."""
    found: dict[str, SettingField] = {}
    for section, cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if section == "engine" and field.name in _NESTED_ENGINE_FIELDS:
                continue
            if field.name in found:
                raise TypeError(f"setting {field.name} is defined in two config sections")
            found[field.name] = SettingField(
                field.name,
                _scalar_type(hints[field.name]),
                field.metadata.get("help", ""),
                ((section, field.name),),
            )
    return found


def _field_definitions() -> dict[str, Any]:
    return {name: (Optional[field.value_type], None) for name, field in setting_fields().items()}  # noqa: UP045


def _error_text(exc: ValidationError, where: str) -> InvalidRequest:
    """`where` formats the setting name: "BITSERVE_{NAME}" or "file.toml [prod] {name}"."""
    first = exc.errors()[0]
    name = ".".join(str(part) for part in first.get("loc", ()))
    label = where.format(name=name, NAME=name.upper())
    return InvalidRequest(f"{label}: {first.get('msg', 'invalid value')}", param=name or None)


def read_env() -> dict[str, Any]:
    """BITSERVE_* variables that are set, parsed to their types (plus `config` and `profile`)."""
    # NOTE: pydantic is imported here, not at module level, so building the CLI parser stays fast.
    from pydantic import ValidationError, create_model
    from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

    class EnvBase(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", case_sensitive=False)

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            *sources: PydanticBaseSettingsSource,
            **named: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (named["env_settings"],)  # the environment only: no .env files, no secrets directory

    env_model = create_model(
        "BitserveEnv",
        __base__=EnvBase,
        config=(Optional[str], None),  # noqa: UP045
        profile=(Optional[str], None),  # noqa: UP045
        **_field_definitions(),
    )
    try:
        values = env_model().model_dump(exclude_none=True)
    except ValidationError as exc:
        raise _error_text(exc, ENV_PREFIX + "{NAME}") from None
    standard_otlp = os.environ.get(OTEL_STANDARD_ENV)
    if standard_otlp and "otel_endpoint" not in values:  # BITSERVE_OTEL_ENDPOINT wins over the standard one
        values["otel_endpoint"] = standard_otlp
    return values


def read_toml(path: str, profile: str | None) -> dict[str, Any]:
    """Top-level settings of `path`, overlaid with its `[profile]` table."""
    from pydantic import ConfigDict, ValidationError, create_model

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidRequest(f"cannot read the config file {path}: {exc.strerror}", param="config") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"the config file {path} is not valid TOML: {exc}", param="config") from None
    tables = {name: data.pop(name) for name in PROFILES if isinstance(data.get(name), dict)}
    if profile is not None and profile not in tables:
        raise InvalidRequest(f"the config file {path} has no [{profile}] table", param="profile")
    toml_model = create_model(
        "BitserveToml", __config__=ConfigDict(extra="forbid", strict=True), **_field_definitions()
    )
    merged: dict[str, Any] = {}
    for layer, where in ((data, ""), (tables.get(profile or "", {}), f"[{profile}] ")):
        try:
            merged.update(toml_model.model_validate(layer).model_dump(exclude_none=True))
        except ValidationError as exc:
            raise _error_text(exc, f"{path} {where}{{name}}") from None
    return merged


def load_settings(
    cli_values: Mapping[str, Any], *, config_path: str | None = None, profile: str | None = None
) -> Settings:
    """Merge CLI values (None = not given), the environment and the TOML file into configs."""
    env = read_env()
    config_path = config_path or env.pop("config", None)
    profile = profile or env.pop("profile", None)
    env.pop("config", None)
    env.pop("profile", None)
    if profile is not None and profile not in PROFILES:
        raise InvalidRequest(
            f"unknown profile {profile!r}", param="profile", hint=f"one of {', '.join(PROFILES)}"
        )
    if profile is not None and config_path is None:
        raise InvalidRequest("a profile needs a config file", param="profile", hint="pass --config path.toml")
    layers = (
        ("toml", read_toml(config_path, profile) if config_path else {}),
        ("env", env),
        ("cli", {name: value for name, value in cli_values.items() if value is not None}),
    )
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, values in layers:
        merged.update(values)
        sources.update(dict.fromkeys(values, source))
    return Settings(
        *build_configs(merged),
        sources=sources,
        security=build_security(merged),
        batch=build_batch(merged),
        plugins=build_plugins(merged),
    )


def _section_values(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Set values by config section; an unknown name raises InvalidRequest."""
    fields = setting_fields()
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise InvalidRequest(f"unknown setting(s): {', '.join(unknown)}", param=unknown[0])
    kwargs: dict[str, dict[str, Any]] = {section: {} for section, _ in SECTIONS}
    for name, value in values.items():
        for section, field_name in fields[name].targets:
            kwargs[section][field_name] = value
    return kwargs


def _build_section(values: Mapping[str, Any], section: str) -> Any:
    """One flat section's dataclass (security, batch) from set values; its checks become InvalidRequest."""
    try:
        return dict(SECTIONS)[section](**_section_values(values)[section])
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid settings: {exc}") from None


def build_security(values: Mapping[str, Any]) -> SecurityConfig:
    return typing.cast(SecurityConfig, _build_section(values, "security"))


def build_batch(values: Mapping[str, Any]) -> BatchConfig:
    return typing.cast(BatchConfig, _build_section(values, "batch"))


def build_plugins(values: Mapping[str, Any]) -> PluginConfig:
    return typing.cast(PluginConfig, _build_section(values, "plugins"))


def build_configs(values: Mapping[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """Construct the dataclasses from set values; their own checks turn into InvalidRequest."""
    kwargs = _section_values(values)
    try:
        engine = EngineConfig(
            model=ModelConfig(**kwargs["model"]),
            cache=CacheConfig(**kwargs["cache"]),
            scheduler=SchedulerConfig(**kwargs["scheduler"]),
            **kwargs["engine"],
        )
        server = ServerConfig(**kwargs["server"])
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid settings: {exc}") from None
    # the syntax now (a typo fails at startup, naming the choices); whether a GPU is there, at load
    parse_devices(engine.model.device)
    return engine, server
