"""The one error type of the constraint layer: the API answers it with 400 naming `param`."""

from __future__ import annotations


class GrammarRequestError(ValueError):
    """A request's constraint cannot be honoured (bad schema, regex, grammar, conflicting forms)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param  # the request field at fault, e.g. "response_format.json_schema"
        self.message = message  # llguidance's own message when it found the fault
