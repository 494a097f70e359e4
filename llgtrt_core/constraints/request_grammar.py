"""Request fields -> one llguidance grammar string.

Three families of fields ask for a constraint, on chat and completion requests alike:
OpenAI's `response_format` (plus llgtrt's `lark_grammar` and `llguidance` types), vLLM's
`structured_outputs`, and vLLM's older `guided_*` fields. A request may use one form only.

JSON is compact by default (`{"a":1,"b":[2,3]}`, no free whitespace), so a model cannot pad
with whitespace until max_tokens; `whitespace_pattern` (a regex for each gap between JSON
tokens, e.g. `[ ]?`) or `disable_any_whitespace` change that per request. A JSON schema is
enforced whether `strict` is true or false.

Requests are duck-typed: any object (or mapping) with these attributes will do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import llguidance
from llguidance import LLMatcher

from llgtrt_core.constraints.errors import GrammarRequestError

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

# The (param, kind) pairs of vLLM's `structured_outputs` and `guided_*` fields.
STRUCTURED_OUTPUT_FIELDS = (
    ("json", "json_schema"),
    ("regex", "regex"),
    ("choice", "choice"),
    ("grammar", "grammar"),
    ("json_object", "json_object"),
)
GUIDED_FIELDS = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


@dataclass(frozen=True)
class RequestGrammar:
    param: str  # the request field it came from; named in a 400 when it does not compile
    grammar: str  # llguidance grammar text (also the compile-cache key)


@dataclass(frozen=True)
class NumberBounds:
    """Default bounds on JSON numbers, so a model cannot write digits until max_tokens."""

    integer_digits: int = 18  # |value| <= 10**integer_digits (inside int64) unless the schema bounds it
    fraction_digits: int = 9  # digits after the point (a multipleOf 10**-fraction_digits); exponents go


@dataclass(frozen=True)
class JsonPolicy:
    """JSON options: the server default, which a schema's own `x-guidance` block overrides, and
    the request's options, which override both."""

    whitespace_flexible: bool = False  # server default; False = compact JSON (see dumps_compact)
    number_bounds: Optional[NumberBounds] = None  # bound_numbers's limits; None: numbers as the schema says
    whitespace_pattern: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def overrides(self) -> Optional[dict[str, Any]]:
        if self.whitespace_pattern is not None:
            return {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return None


def dumps_compact(value: Any) -> str:
    """`value` as JSON with no whitespace between tokens, as the default JSON grammar wants."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def grammar_for_request(request: Any, whitespace_flexible: bool = False,
                        number_bounds: Optional[NumberBounds] = None) -> Optional[str]:
    """The request's llguidance grammar, or None when its output is unconstrained. The server's
    defaults: `whitespace_flexible`, and `number_bounds` (None: off) unless the request's
    `bounded_numbers` says otherwise."""
    found = request_grammar(request, whitespace_flexible, number_bounds)
    return found.grammar if found else None


def request_grammar(request: Any, whitespace_flexible: bool = False,
                    number_bounds: Optional[NumberBounds] = None) -> Optional[RequestGrammar]:
    """Like `grammar_for_request`, also naming the field the grammar came from."""
    forms = _requested_forms(request)
    if not forms:
        return None
    if len(forms) > 1:
        first, second = forms[0][0], forms[1][0]
        raise GrammarRequestError(
            second, f"only one constraint may be given per request; got {first} and {second}"
        )
    param, kind, value = forms[0]
    policy = _json_policy(request, whitespace_flexible, number_bounds)
    return RequestGrammar(param, _build_grammar(param, kind, value, policy))


def asks_for_grammar(request: Any) -> bool:
    """Whether the request's fields ask for a constraint (`request_grammar` builds it, or refuses
    them); cheap: it builds nothing."""
    return bool(_requested_forms(request))


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _requested_forms(request: Any) -> list[tuple[str, str, Any]]:
    """Every constraint the request asks for, as (param, kind, value)."""
    forms: list[tuple[str, str, Any]] = []
    response_format = _get(request, "response_format")
    if response_format is not None:
        form = _response_format_form(response_format)
        if form is not None:
            forms.append(form)
    structured = _get(request, "structured_outputs")
    for name, kind in STRUCTURED_OUTPUT_FIELDS:
        value = _get(structured, name)
        if value is not None and value is not False:
            forms.append((f"structured_outputs.{name}", kind, value))
    for name, kind in GUIDED_FIELDS:
        value = _get(request, name)
        if value is not None:
            forms.append((name, kind, value))
    return forms


def _response_format_form(response_format: Any) -> Optional[tuple[str, str, Any]]:
    kind = _get(response_format, "type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ("response_format", "json_object", True)
    if kind == "json_schema":
        spec = _get(response_format, "json_schema")
        if spec is None:
            raise GrammarRequestError(
                "response_format.json_schema", "required when response_format.type is json_schema"
            )
        schema = _get(spec, "schema_")
        if schema is None:
            schema = _get(spec, "schema")
        return ("response_format.json_schema", "json_schema", ANY_JSON_OBJECT if schema is None else schema)
    if kind == "lark_grammar":
        return ("response_format.lark_grammar", "lark", _required(response_format, "lark_grammar", kind))
    if kind == "llguidance":
        return ("response_format.grammar", "llguidance", _required(response_format, "grammar", kind))
    raise GrammarRequestError("response_format.type", f"unsupported response_format type {kind!r}")


def _required(response_format: Any, name: str, kind: str) -> Any:
    value = _get(response_format, name)
    if value is None:
        raise GrammarRequestError(f"response_format.{name}", f"required when response_format.type is {kind}")
    return value


def _json_policy(request: Any, whitespace_flexible: bool, number_bounds: Optional[NumberBounds]) -> JsonPolicy:
    structured = _get(request, "structured_outputs")
    pattern = _get(structured, "whitespace_pattern")
    guided_pattern = _get(request, "guided_whitespace_pattern")
    if pattern is not None and guided_pattern is not None:
        raise GrammarRequestError(
            "guided_whitespace_pattern",
            "give structured_outputs.whitespace_pattern or guided_whitespace_pattern, not both",
        )
    pattern = pattern if pattern is not None else guided_pattern
    disable_whitespace = bool(_get(structured, "disable_any_whitespace"))
    if pattern is not None and disable_whitespace:
        raise GrammarRequestError(
            "structured_outputs.disable_any_whitespace", "cannot be combined with a whitespace_pattern"
        )
    return JsonPolicy(
        whitespace_flexible=whitespace_flexible,
        whitespace_pattern=pattern,
        disable_any_whitespace=disable_whitespace,
        disable_additional_properties=bool(_get(structured, "disable_additional_properties")),
        number_bounds=_number_bounds(_get(request, "bounded_numbers"), number_bounds),
    )


def _number_bounds(wanted: Optional[bool], default: Optional[NumberBounds]) -> Optional[NumberBounds]:
    if wanted is None:
        return default
    return (default or NumberBounds()) if wanted else None


def _build_grammar(param: str, kind: str, value: Any, policy: JsonPolicy) -> str:
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT, policy, param)
    if kind == "json_schema":
        return json_schema_grammar(value, policy, param)
    if kind == "choice":
        return choice_grammar(value, param)
    text = _text(value, param)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "lark":
        return LLMatcher.grammar_from_lark(text)
    if kind == "llguidance":
        return text  # llguidance JSON ({"grammars": [...]}) or Lark; the compiler validates it
    if kind == "grammar":
        _check_gbnf_rules(text, param)
        try:
            return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarRequestError(param, str(e)) from e
    raise AssertionError(f"unknown constraint kind {kind}")


_GBNF_RULE = re.compile(r"^[ \t]*([A-Za-z_][\w-]*)[ \t]*::=", re.MULTILINE)
_GBNF_COMMENT = re.compile(r"#[^\n]*")


def _check_gbnf_rules(text: str, param: str) -> None:
    """A GBNF rule with nothing after `::=` converts to one matching only the empty string: refused,
    as a grammar that would end every answer before it starts."""
    parts = _GBNF_RULE.split(text)  # [before, name, body, name, body, ...]
    for name, body in zip(parts[1::2], parts[2::2]):
        if not _GBNF_COMMENT.sub("", body).strip():
            raise GrammarRequestError(param, f"the GBNF rule `{name}` is empty (nothing after `::=`)")


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise GrammarRequestError(param, "must be a string")
    return value


def json_schema_grammar(schema: Any, policy: JsonPolicy = JsonPolicy(), param: str = "response_format") -> str:
    """Grammar for a JSON schema (dict or JSON text) under the bounded-whitespace default: the
    schema with its JSON options (`with_json_options`), written by Python's JSON encoder."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarRequestError(param, f"the schema is not valid JSON: {e}") from e
        except RecursionError as e:
            raise GrammarRequestError(param, "the schema nests too deeply") from e
    if schema is True:
        schema = {}  # the JSON Schema that accepts any value
    if not isinstance(schema, dict):
        raise GrammarRequestError(param, "the schema must be a JSON object")
    if policy.disable_additional_properties:
        schema = close_objects(schema)
    if policy.number_bounds is not None:
        schema = bound_numbers(schema, policy.number_bounds)
    try:
        text = json.dumps(with_json_options(schema, {"whitespace_flexible": policy.whitespace_flexible},
                                            policy.overrides()), separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as e:  # NaN or Infinity, which JSON has not; a value of no JSON type
        raise GrammarRequestError(param, f"the schema is not valid JSON: {e}") from e
    except RecursionError as e:
        raise GrammarRequestError(param, "the schema nests too deeply") from e
    return f'{{"grammars":[{{"json_schema":{text}}}]}}'


def with_json_options(schema: dict[str, Any], defaults: dict[str, Any],
                      overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`schema` with its llguidance JSON options (`x-guidance`) merged as llguidance's
    `grammar_from_json_schema` merges them: `defaults`, then the schema's own, then `overrides`.
    That function walks the whole schema holding the GIL (seconds for a schema of megabytes); this
    copies its top level only."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**defaults, **(own if isinstance(own, dict) else {}), **(overrides or {})}}


def choice_grammar(choices: Any, param: str = "choice") -> str:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise GrammarRequestError(param, "must be a non-empty list of strings")
    if not all(isinstance(choice, str) for choice in choices):
        raise GrammarRequestError(param, "must be a non-empty list of strings")
    return llguidance.grammar_from("choice", json.dumps(list(choices)))


# Keywords whose value is a schema, a list of schemas, or a mapping name -> schema.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where every object schema without `additionalProperties` gets `false` (vLLM's
    `disable_additional_properties`): the model may only write the properties it was given."""
    return _copy_visiting(schema, _close)


def bound_numbers(schema: dict[str, Any], bounds: NumberBounds) -> dict[str, Any]:
    """A copy where every integer or number schema gets the default bounds it lacks: a minimum and
    a maximum of -/+ 10**integer_digits (which also rules out exponents), and for numbers a
    multipleOf 10**-fraction_digits. Bounds the schema gives are kept."""
    return _copy_visiting(schema, lambda node: _bound(node, bounds))


def _close(schema: dict[str, Any]) -> None:
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        schema["additionalProperties"] = False


def _bound(schema: dict[str, Any], bounds: NumberBounds) -> None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "number" not in kinds and "integer" not in kinds:
        return
    limit = 10**bounds.integer_digits
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = limit
    if "number" in kinds and "multipleOf" not in schema:
        schema["multipleOf"] = 10.0**-bounds.fraction_digits


def _copy_visiting(schema: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of `schema` where `change` was applied to every (sub)schema. Iterative, copying each
    subschema it visits: schemas nest deeper than Python's recursion limit."""
    copied = dict(schema)
    pending = [copied]
    while pending:
        node = pending.pop()
        change(node)
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                node[key] = dict(node[key])
                pending.append(node[key])
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [dict(sub) if isinstance(sub, dict) else sub for sub in node[key]]
                pending += [sub for sub in node[key] if isinstance(sub, dict)]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: dict(sub) if isinstance(sub, dict) else sub for name, sub in node[key].items()}
                pending += [sub for sub in node[key].values() if isinstance(sub, dict)]
    return copied
