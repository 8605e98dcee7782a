"""Tool-call formats: the chat template's own where it has one, else bitserve's JSON convention.

One registry, looked up once per model from its GGUF template source (`tool_format_for`). Each
format says how tools reach the prompt, what `required` / a named function force (a grammar), how a
reply is read back into calls, and how an assistant's earlier `tool_calls` are written back:

- **hermes** (Hermes 2 Pro, Qwen2.5; the template renders `tools` and writes `<tool_call>`): the
  template's own `tools` variable; the reply is one block per call,
  `<tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>`, blocks separated by "\\n";
  `role: "tool"` results go back as the template renders them (`<tool_response>`).
- **llama3_json** (Llama 3.1 / 3.2; the template renders `tools` and asks for `"parameters"`): the
  template's `tools`; the reply is one object `{"name": "get_weather", "parameters": {...}}`, possibly
  after `<|python_tag|>`. Those templates take one call per assistant turn, so one call is forced.
- **json** (anything else, SmolLM2's ChatML included): tools.py's convention, the tools described in
  the system message and a reply that is a JSON array of calls.

Assistant `tool_calls` reach a template format's template as its `tool_calls` field (arguments as
objects, as HF templates expect); the convention writes them back as its array text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bitserve.structured.guide import Guide, GuideKind
from bitserve.structured.tools import (
    CONVENTION_LAYOUT,
    CallLayout,
    Tool,
    ToolCall,
    ToolCallScanner,
    ToolChoice,
    assistant_tool_calls_text,
    parse_tool_calls,
    tool_call_guide,
    tools_prompt,
    with_tools_prompt,
)

_RENDERS_TOOLS = re.compile(r"\btools\b")  # the template reads a `tools` variable


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's parsed tool fields."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice.is_forced


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's convention. `markers`: template substrings of which one must appear (with a
    `tools` variable) for the family; `openings`: how a reply that calls starts (an `auto` stream
    holds such text back); `call_begin` / `call_end` / `separator`: each call's text around its
    arguments' JSON, `{name}` filled in (template families only)."""

    name: str
    layout: CallLayout
    openings: tuple[str, ...]
    markers: tuple[str, ...] = ()
    call_begin: str = ""
    call_end: str = ""
    separator: str = ""
    one_call_only: bool = False

    @property
    def template_renders_tools(self) -> bool:
        return bool(self.markers)

    def detect(self, source: str) -> bool:
        return bool(_RENDERS_TOOLS.search(source)) and any(marker in source for marker in self.markers)

    def prompt(
        self, messages: list[dict[str, Any]], request: ToolRequest | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, the template's `tools` variable) for a request's tools (None: no tools asked for
        or tool_choice "none", which leaves them out of the prompt)."""
        if request is None or request.choice.mode == "none":
            return messages, None
        if not self.template_renders_tools:
            return with_tools_prompt(
                messages, tools_prompt(request.tools, request.choice, request.parallel)
            ), None
        return messages, [_openai_tool(tool) for tool in request.tools]

    def assistant_fields(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """An assistant message's template fields for its checked calls (tools.assistant_tool_calls)."""
        if not self.template_renders_tools:
            return {"content": assistant_tool_calls_text(calls)}
        template_calls = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls
        ]
        return {"content": "", "tool_calls": template_calls}

    def guide(self, request: ToolRequest) -> Guide | None:
        """The grammar forcing this family's call text (`required` or a named function), else None."""
        if not request.forced:
            return None
        if not self.template_renders_tools:
            return tool_call_guide(request.tools, request.choice, request.parallel)
        one_call = self.one_call_only or request.choice.is_one_call(request.parallel)
        tags = [
            {
                "type": "tag",
                "begin": self.call_begin.format(name=tool.name),
                "content": {"type": "json_schema", "json_schema": tool.parameters},
                "end": self.call_end,
            }
            for tool in request.choice.allowed(request.tools)
        ]
        calls = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": one_call,
        }
        return Guide(
            GuideKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": calls}), "tools"
        )

    def scanner(self) -> ToolCallScanner:
        return ToolCallScanner(self.layout)

    def parse(self, text: str, tools: list[Tool]) -> list[ToolCall] | None:
        """The calls of a complete reply in this format, or None (then the reply is content)."""
        calls = parse_tool_calls(text, tools, self.layout)
        if calls is not None and self.one_call_only and len(calls) > 1:
            return None
        return calls

    def may_be_call(self, held: str) -> bool:
        """Whether a reply starting with `held` may still turn out to be calls."""
        start = held.lstrip()
        return any(start.startswith(opening) or opening.startswith(start) for opening in self.openings)


def _openai_tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


JSON_CONVENTION = ToolFormat("json", CONVENTION_LAYOUT, openings=("[",))
HERMES = ToolFormat(
    "hermes",
    CallLayout(
        call_depth=1,
        skeleton=re.compile(
            r"\s*<tool_call>\s*\x00\s*</tool_call>(\s*<tool_call>\s*\x00\s*</tool_call>)*\s*"
        ),
    ),
    openings=("<tool_call>",),
    markers=("<tool_call>",),
    call_begin='<tool_call>\n{{"name": "{name}", "arguments": ',
    call_end="}\n</tool_call>",
    separator="\n",
)
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    CallLayout(
        call_depth=1, arguments_key="parameters", skeleton=re.compile(r"\s*(<\|python_tag\|>)?\s*\x00\s*")
    ),
    openings=("{", "<|python_tag|>"),
    markers=('"parameters"', "<|python_tag|>", "tools_in_user_message"),
    call_begin='{{"name": "{name}", "parameters": ',
    call_end="}",
    separator="; ",
    one_call_only=True,
)
# Detection order: the first family whose markers the template holds (Hermes before Llama: a
# Hermes-style template may mention "parameters" in its instructions).
TEMPLATE_FORMATS = (HERMES, LLAMA3_JSON)
TOOL_FORMATS = {fmt.name: fmt for fmt in (*TEMPLATE_FORMATS, JSON_CONVENTION)}


def tool_format_for(template_source: str | None) -> ToolFormat:
    """The tool format of a model whose GGUF chat template is `template_source` (None: a named or
    built-in template, which has no tool format)."""
    if template_source:
        for fmt in TEMPLATE_FORMATS:
            if fmt.detect(template_source):
                return fmt
    return JSON_CONVENTION
