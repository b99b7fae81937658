"""Tool calling in the Hermes format: the grammar that enforces a required or named `tool_choice`, and
the parser that turns the model's `<tool_call>` blocks back into OpenAI `tool_calls`, streamed or not.

The model is asked (by its chat template, or by `engines.tokenizer.DEFAULT_TOOL_PROMPT`) to answer a
call as
```
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
```
`tool_choice: "required"` or a named function turns into an EBNF (GBNF) grammar of exactly that: one
block (or, with `parallel_tool_calls`, several) whose JSON has a declared function's name and
arguments following that function's parameter schema (`json_schema_grammar`: types, properties,
required properties, enums, consts, arrays, anyOf/oneOf and local $refs; other keywords, such as
string patterns or numeric ranges, are not enforced). `tool_choice: "auto"` leaves the model free and
parses what it wrote: a block whose JSON does not parse, or names no declared function, stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a call whose arguments can be streamed as they come: {"name": "...", "arguments":
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

# ---- the grammar -------------------------------------------------------------------------------
_JSON_RULES = r"""ws ::= " "?
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"
array ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] )
integer ::= "-"? ( "0" | [1-9] [0-9]* )
number ::= integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
boolean ::= "true" | "false"
null ::= "null"
"""
MAX_DEPTH = 16  # schema nesting followed; deeper values may be any JSON value
_TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "null": "null"}


def literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


@dataclass
class _Rules:
    """Named GBNF rules built from JSON schemas (each schema node becomes an expression; objects,
    arrays and $refs get rules of their own)."""

    root: dict[str, Any]
    rules: dict[str, str] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def add(self, hint: str, body: str) -> str:
        name = re.sub(r"[^a-zA-Z0-9-]", "-", hint).strip("-") or "r"
        name, k = f"s-{name}", 0
        while f"{name}{k or ''}" in self.rules:
            k += 1
        name = f"{name}{k or ''}"
        self.rules[name] = body
        return name

    def expr(self, schema: Any, hint: str, depth: int = 0) -> str:
        """A GBNF expression for values valid against `schema` (a subset of JSON Schema; see the module).
        What it does not understand, and nesting deeper than `MAX_DEPTH`, allows any JSON value."""
        if not isinstance(schema, dict) or not schema or depth > MAX_DEPTH:
            return "value"
        depth += 1
        if isinstance(schema.get("$ref"), str):
            return self.ref(schema["$ref"], depth)
        if "const" in schema:
            return literal(json.dumps(schema["const"], ensure_ascii=False))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "( " + " | ".join(literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]) + " )"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "( " + " | ".join(self.expr(s, hint, depth) for s in schema[key]) + " )"
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            return self.expr(schema["allOf"][0], hint, depth)
        kind = schema.get("type")
        if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
            return "( " + " | ".join(self.expr(schema | {"type": k}, hint, depth) for k in kind) + " )"
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            return self.object(schema, hint, depth)
        if kind == "array":
            return self.array(schema, hint, depth)
        return _TYPES.get(kind, "value") if isinstance(kind, str) else "value"

    def ref(self, ref: str, depth: int) -> str:
        if ref in self.refs:
            return self.refs[ref]
        target: Any = None
        if ref.startswith("#/"):
            target = self.root
            for part in ref[2:].split("/"):
                target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return "value"  # not a local reference: any JSON value
        name = self.refs[ref] = self.add(ref.rsplit("/", 1)[-1], "value")  # placeholder: recursion
        self.rules[name] = self.expr(target, name, depth)
        return name

    def object(self, schema: dict[str, Any], hint: str, depth: int) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return "object"
        needed = schema.get("required")
        required = [k for k in props if isinstance(needed, list) and k in needed]
        optional = [k for k in props if k not in required]

        def member(key: str) -> str:
            value = self.expr(props[key], f"{hint}-{key}", depth)
            return f'{literal(json.dumps(key, ensure_ascii=False))} ws ":" ws {value}'

        sep = ' ws "," ws '
        if required:
            body = sep.join(member(k) for k in required)
            body += "".join(f" ({sep}{member(k)} )?" for k in optional)
        else:  # the first member present decides whether the next ones need a comma
            alternatives = [
                member(k) + "".join(f" ({sep}{member(o)} )?" for o in optional[i + 1 :]) for i, k in enumerate(optional)
            ]
            body = "( " + " | ".join(alternatives) + " )?"
        return self.add(hint, f'"{{" ws {body} ws "}}"')

    def array(self, schema: dict[str, Any], hint: str, depth: int) -> str:
        item = self.expr(schema.get("items"), f"{hint}-item", depth)
        min_items = schema.get("minItems")
        at_least = min(min_items, 16) if isinstance(min_items, int) and min_items > 0 else 0
        if at_least == 0:
            body = f'"[" ws ( {item} ( ws "," ws {item} )* )? ws "]"'
        else:
            body = '"[" ws ' + ' ws "," ws '.join([item] * at_least) + f' ( ws "," ws {item} )* ws "]"'
        return self.add(hint, body)


def json_schema_grammar(schema: dict[str, Any] | None, rule: str = "root") -> str:
    """GBNF for JSON values valid against `schema` (see the module for the keywords enforced)."""
    rules = _Rules(schema or {})
    top = rules.expr(schema or {"type": "object"}, rule)
    lines = [f"{rule} ::= {top}"] + [f"{k} ::= {v}" for k, v in rules.rules.items()]
    return "\n".join(lines) + "\n" + _JSON_RULES


def tool_choice_grammar(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool = True) -> str:
    """GBNF for a required or named tool_choice: `<tool_call>` blocks (one, or with `parallel` one or
    more) calling one of `functions` ((name, parameters schema) pairs) with arguments valid against its
    parameters (an object; any JSON object where the function declares none)."""
    calls = []
    rules = _Rules({})
    for i, (name, params) in enumerate(functions):
        schema = params if params else {"type": "object"}
        rules.root, rules.refs = schema, {}  # $refs resolve within each function's schema
        args = rules.expr(schema, f"f{i}")
        calls.append(
            f'"{{" ws {literal(json.dumps("name"))} ws ":" ws {literal(json.dumps(name, ensure_ascii=False))} ws "," '
            f'ws {literal(json.dumps("arguments"))} ws ":" ws {args} ws "}}"'
        )
    head = [
        "root ::= block" + (' ( "\\n" block )*' if parallel else ""),
        f"block ::= {literal(OPEN + chr(10))} call {literal(chr(10) + CLOSE)}",
        "call ::= " + " | ".join(f"( {c} )" for c in calls),
    ]
    return "\n".join(head + [f"{k} ::= {v}" for k, v in rules.rules.items()]) + "\n" + _JSON_RULES


# ---- parsing the output ------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """One call found in the output: its id, function name and arguments' JSON text."""

    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolEvent:
    """What the parser found in new text: `content` text, or a piece of call `call` (its start, with
    `name`, or more of its `arguments`)."""

    content: str = ""
    call: int | None = None
    name: str | None = None
    id: str | None = None
    arguments: str = ""


def _held(text: str, marker: str) -> int:
    """Chars at the end of `text` that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _calls_in(body: str, names: set[str]) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) calls a whole block holds: an object with name and arguments (or
    parameters), or a list of them; None if it is not that or names an undeclared function."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    out = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        out.append((item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return out or None


class ToolCallParser:
    """Turns a choice's text, pushed as it streams, into content and tool-call events (OpenAI's order:
    a call's id, type and name first, then its arguments in pieces). Text that could start a
    `<tool_call>` tag is held until it is decided; text after the first call is kept only if it is
    not blank (and comes at the end)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.calls: list[ParsedCall] = []
        self.buf = ""
        self.in_call = False
        self.head: re.Match[str] | None = None  # the open call's streamed head
        self.sent = 0  # of the open call's arguments
        self.after = ""  # text after a call

    def push(self, text: str) -> list[ToolEvent]:
        """Events for newly generated text."""
        self.buf += text
        events: list[ToolEvent] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                cut = i if i >= 0 else len(self.buf) - _held(self.buf, OPEN)
                events += self._text(self.buf[:cut])
                if i < 0:
                    self.buf = self.buf[cut:]
                    return events
                self.buf, self.in_call, self.head, self.sent = self.buf[i + len(OPEN) :], True, None, 0
                continue
            j = self.buf.find(CLOSE)
            if j < 0:
                events += self._stream_call(self.buf)
                return events
            events += self._close(self.buf[:j])
            self.buf, self.in_call = self.buf[j + len(CLOSE) :], False

    def finish(self) -> list[ToolEvent]:
        """Events for what is still held when the choice ends: an unclosed call is taken as it stands; an
        unclosed block that is no call stays text, unless calls came before it (a cut-off extra call)."""
        events = self._close(self.buf, closed=False) if self.in_call else self._text(self.buf)
        self.buf, self.in_call = "", False
        if self.calls and self.after.strip():
            events.append(ToolEvent(content=self.after.strip()))
        self.after = ""
        return events

    def _text(self, text: str) -> list[ToolEvent]:
        if self.calls:
            self.after += text
            return []
        return [ToolEvent(content=text)] if text else []

    def _start(self, name: str) -> ToolEvent:
        self.calls.append(ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name))
        return ToolEvent(call=len(self.calls) - 1, name=name, id=self.calls[-1].id)

    def _more(self, text: str) -> list[ToolEvent]:
        if not text:
            return []
        self.calls[-1].arguments += text
        self.sent += len(text)
        return [ToolEvent(call=len(self.calls) - 1, arguments=text)]

    def _stream_call(self, body: str) -> list[ToolEvent]:
        """Stream an open call's head and the part of its arguments that is surely theirs (everything but
        a last `}`, which may close the call's object, and a partial closing tag)."""
        events = []
        if self.head is None:
            m = CALL_HEAD.match(body)
            if m is None or json.loads(f'"{m.group(1)}"') not in self.names:
                return []
            self.head = m
            events.append(self._start(json.loads(f'"{m.group(1)}"')))
        args = body[self.head.end() :].lstrip()
        args = args[: len(args) - _held(args, CLOSE)].rstrip()
        safe = args[:-1] if args.endswith("}") else args
        return events + self._more(safe[self.sent :])

    def _close(self, body: str, closed: bool = True) -> list[ToolEvent]:
        """A whole block: finish its streamed call, or parse it whole; a block that is no call is text."""
        if self.head is not None:
            args = body[self.head.end() :].strip()
            args = args if closed else args[: len(args) - _held(args, CLOSE)].rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args
            return self._more(args[self.sent :])
        found = _calls_in(body.strip(), self.names)
        if found is None:
            if not closed and self.calls:
                return []
            return self._text(OPEN + body + (CLOSE if closed else ""))
        events = []
        for name, arguments in found:
            events.append(self._start(name))
            self.sent = 0
            events += self._more(arguments)
        return events


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """A whole choice's text as (content or None, calls)."""
    parser = ToolCallParser(names)
    events = parser.push(text) + parser.finish()
    content = "".join(e.content for e in events).strip() if parser.calls else "".join(e.content for e in events)
    return (content or None) if parser.calls else content, parser.calls
