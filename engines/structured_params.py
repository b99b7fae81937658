"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, an EBNF grammar
or one of a list of choices (vLLM's structured-output kinds). Plain data, validated at the edge;
engines/structured_output.py compiles it to a grammar."""

from __future__ import annotations

from dataclasses import dataclass

from engines.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one constraint on the output. `json_schema` is the schema's JSON text; `grammar` is
    EBNF (GBNF syntax); `choice` lists the only outputs allowed. `param` names the request field it
    came from, for error messages (e.g. "response_format")."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    param: str = "response_format"

    @property
    def kind(self) -> str:
        """Which constraint is set: json_schema, json_object, regex, grammar or choice."""
        return next(k for k in ("json_schema", "json_object", "regex", "grammar", "choice") if getattr(self, k))

    def validate(self) -> StructuredOutputParams:
        """Raise InvalidRequestError unless exactly one constraint is set (and set to something)."""
        set_ = [k for k in ("json_schema", "json_object", "regex", "grammar", "choice") if getattr(self, k)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"exactly one structured-output constraint must be given, got {set_ or 'none'}", param=self.param
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidRequestError("choice must be a list of non-empty strings", param=self.param)
        return self
