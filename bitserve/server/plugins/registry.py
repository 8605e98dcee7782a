"""Which plugins a server runs: each name `--plugin` lists is an entry point of the `bitserve.plugins`
group (what an installed distribution registers; bitserve's own `content_filter` among them) or a
`module:attr` reference; its object is a Plugin subclass or a factory `(PluginConfig) -> Plugin`. A name
that does not resolve fails the start, naming the plugins that are installed."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

from bitserve.errors import InvalidRequest
from bitserve.server.plugins.base import Plugin
from bitserve.server.plugins.chain import PluginChain, PluginEventSink
from bitserve.server.plugins.config import PluginConfig

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "bitserve.plugins"


def installed_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of the `bitserve.plugins` group, by name."""
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_plugins(config: PluginConfig, on_event: PluginEventSink | None = None) -> PluginChain:
    """The chain `config.plugins` names, each plugin built with `config`; an empty chain when none.
    Raises InvalidRequest (a failed start) for a name that does not resolve or a plugin that cannot
    start (its own error, e.g. an unreadable rules file)."""
    names = config.plugin_names
    if len(set(names)) != len(names):
        raise InvalidRequest(f"plugins: a plugin is listed twice: {', '.join(names)}", param="plugins")
    plugins = [_build(name, _resolve(name), config) for name in names]
    if plugins:
        logger.info("plugins enabled: %s", ", ".join(plugin.name for plugin in plugins))
    return PluginChain(plugins, config.plugin_timeout_s, on_event)


def _resolve(name: str) -> Callable[..., Any]:
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            target: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidRequest(f"plugin {name!r} cannot be imported: {exc}", param="plugins") from None
        return target
    installed = installed_plugins()
    entry = installed.get(name)
    if entry is None:
        raise InvalidRequest(
            f"plugin {name!r} is not installed (entry points of {ENTRY_POINT_GROUP}: "
            f"{', '.join(sorted(installed)) or 'none'})",
            param="plugins",
            hint="install the distribution that provides it (for bitserve's own: pip install -e . again), "
            "or name it as module:attr",
        )
    try:
        loaded: Callable[..., Any] = entry.load()
    except (ImportError, AttributeError) as exc:
        raise InvalidRequest(
            f"plugin {name!r} ({entry.value}) cannot be loaded: {exc}", param="plugins"
        ) from None
    return loaded


def _build(name: str, factory: Callable[..., Any], config: PluginConfig) -> Plugin:
    try:
        plugin = factory(config)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidRequest(f"plugin {name!r} could not start: {exc}", param="plugins") from None
    if not isinstance(plugin, Plugin):
        raise InvalidRequest(
            f"plugin {name!r} gave a {type(plugin).__name__}, not a bitserve Plugin", param="plugins"
        )
    plugin.name = plugin.name or name  # its own name, else the one it was enabled by
    return plugin
