"""PluginConfig: the single home of the plugin settings (which plugins run, in which order, their time
budget, and the content filter's knobs). `server/settings.py` fills it like the other config dataclasses
(flags, BITSERVE_* variables, TOML). Imports no other bitserve module."""

from __future__ import annotations

from dataclasses import dataclass, field


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class PluginConfig:
    # NOTE: nothing runs unless named here: installing a distribution that registers a plugin changes
    # no server's behaviour until its operator enables it.
    plugins: str | None = field(
        default=None,
        metadata=_help(
            "server plugins to run, in order (comma-separated; --plugin is repeatable): entry points of "
            "the bitserve.plugins group (e.g. content_filter) or module:attr; a missing one fails the start"
        ),
    )
    plugin_timeout_s: float = field(
        default=1.0,
        metadata=_help(
            "seconds each plugin hook may take; over it, that request fails (500 naming the plugin)"
        ),
    )
    content_filter_rules: str | None = field(
        default=None,
        metadata=_help(
            "the content_filter plugin's rules file: a literal phrase a line, or re:REGEX "
            "(case-insensitive; # starts a comment line)"
        ),
    )
    content_filter_max_match_chars: int = field(
        default=64,
        metadata=_help(
            "the longest text a content_filter regex may match: streamed output is held back by this "
            "many characters (by a phrase's own length for phrases)"
        ),
    )

    def __post_init__(self) -> None:
        if self.plugin_timeout_s <= 0:
            raise ValueError(f"plugin_timeout_s must be > 0, got {self.plugin_timeout_s}")
        if self.content_filter_max_match_chars < 1:
            raise ValueError(
                f"content_filter_max_match_chars must be >= 1, got {self.content_filter_max_match_chars}"
            )

    @property
    def plugin_names(self) -> list[str]:
        """`plugins` as the operator listed them."""
        return [name.strip() for name in (self.plugins or "").split(",") if name.strip()]
