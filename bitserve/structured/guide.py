"""Guide: what one request constrains its output to. Torch-free and hashable, so SamplingParams
(frozen) can carry it to the engine; the runner compiles it with the grammar engine (grammars.py).

Kinds: a JSON schema (`response_format` json_schema, tool calls), any JSON object (`json_object`),
a regular expression (`guided_regex`), one of several strings (`guided_choice`), an EBNF/GBNF
grammar (`guided_grammar`) and a structural tag (a chat template's tool-call text, tool_formats.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from bitserve.errors import InvalidRequest

MAX_GUIDE_CHARS = 65_536  # a schema, regex or grammar; the request body limit caps it as well
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class GuideKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's structural tag JSON: a template's tool-call text


@dataclass(frozen=True, slots=True)
class Guide:
    """`spec`: the JSON schema text, the regex, the EBNF grammar, or the choices as a JSON list
    ("" for json_object). `param` names the request field it came from, for errors."""

    kind: GuideKind
    spec: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if len(self.spec) > MAX_GUIDE_CHARS:
            raise InvalidRequest(
                f"{self.param} is {len(self.spec)} characters long; the most is {MAX_GUIDE_CHARS}",
                param=self.param,
            )

    @classmethod
    def json_schema(cls, schema: object, param: str) -> Guide:
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{param} must be a JSON object (a JSON schema)", param=param)
        return cls(GuideKind.JSON_SCHEMA, json.dumps(schema, sort_keys=False), param)

    @classmethod
    def choice(cls, choices: object, param: str = "guided_choice") -> Guide:
        if not isinstance(choices, list) or not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(f"{param} must be a list of 1..{MAX_CHOICES} strings", param=param)
        for item in choices:
            if not isinstance(item, str) or not 1 <= len(item) <= MAX_CHOICE_CHARS:
                raise InvalidRequest(
                    f"each {param} entry must be a string of 1..{MAX_CHOICE_CHARS} characters, "
                    f"got {item!r:.60}",
                    param=param,
                )
        return cls(GuideKind.CHOICE, json.dumps(choices), param)

    def choices(self) -> list[str]:
        return list(json.loads(self.spec))
