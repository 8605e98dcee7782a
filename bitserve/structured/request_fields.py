"""The request fields that ask for structured output -> one Guide (or None).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", ...}) and the
extensions `guided_regex`, `guided_choice` and `guided_grammar` (vLLM's names); at most one of them
may constrain a request. Shapes are checked here; whether the schema / regex / grammar compiles is
the grammar engine's check (GrammarCompiler.compile), also before admission.
"""

from __future__ import annotations

import re
from typing import Any

from bitserve.errors import InvalidRequest
from bitserve.structured.guide import Guide, GuideKind

SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


def response_format_guide(response_format: Any) -> Guide | None:
    if response_format is None:
        return None
    param = "response_format"
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidRequest(
            'response_format must be an object with a "type": "text", "json_object" or "json_schema"',
            param=param,
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide(GuideKind.JSON_OBJECT, "", param)
    if kind == "json_schema":
        return _json_schema_guide(response_format.get("json_schema"))
    raise InvalidRequest(
        f"response_format.type {kind[:40]!r} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


def _json_schema_guide(spec: Any) -> Guide:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{param} must be an object with name and schema", param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise InvalidRequest(
            f"{param}.name must be 1..64 letters, digits, _ or -, got {name!r:.60}", param=f"{param}.name"
        )
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise InvalidRequest(f"{param}.strict must be true or false", param=f"{param}.strict")
    # NOTE: strict or not, the output is held to the schema (as vLLM does): a loose schema is the way
    # to ask for less.
    return Guide.json_schema(spec.get("schema", {}), f"{param}.schema")


def extension_guides(
    guided_regex: str | None, guided_choice: list[str] | None, guided_grammar: str | None
) -> list[Guide]:
    guides = []
    if guided_regex is not None:
        guides.append(Guide(GuideKind.REGEX, guided_regex, "guided_regex"))
    if guided_choice is not None:
        guides.append(Guide.choice(guided_choice))
    if guided_grammar is not None:
        guides.append(Guide(GuideKind.GRAMMAR, guided_grammar, "guided_grammar"))
    return guides


def one_guide(guides: list[Guide | None]) -> Guide | None:
    """The request's guide; two fields that both constrain the output are a 400."""
    present = [guide for guide in guides if guide is not None]
    if len(present) > 1:
        names = " and ".join(guide.param.split(".")[0] for guide in present)
        raise InvalidRequest(
            f"{names} each constrain the output; send one of them", param=present[1].param.split(".")[0]
        )
    return present[0] if present else None
