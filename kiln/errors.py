"""The errors kiln reports as one sentence: the CLI prints one line, the server answers with it.

Every error a user can act on (a bad option or request field, an engine directory that cannot
be served, a model that cannot be built, a calibration artifact that does not fit) derives from
KilnError; anything else reaching the CLI or the server is a bug and keeps its traceback.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


class KilnError(Exception):
    """An error whose message is one sentence saying what is wrong and, where it can, what to do."""


class InvalidParamError(KilnError, ValueError):
    """A value kiln does not accept; `param` names the field it came from (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def require(ok: bool, param: str, rule: str, value: object) -> None:
    """Raise InvalidParamError("{param} must be {rule}, got {value!r}") unless ok."""
    if not ok:
        raise InvalidParamError(f"{param} must be {rule}, got {value!r}", param)


def parse_choice(kind: type[E], name: str, what: str, param: str) -> E:
    """kind's member whose value is name, or InvalidParamError("unknown {what} ...; choose one of [...]")."""
    try:
        return kind(name)
    except ValueError:
        choices = [member.value for member in kind]
        raise InvalidParamError(f"unknown {what} {name!r}; choose one of {choices}", param) from None


class RequestFailedError(RuntimeError):
    """The engine could not advance this one request (sampling its row raised, say) and ended it, while the
    step and the other requests went on. Not a KilnError: it is a bug to report. Raised from the request's
    stream (AsyncLLM), a 500 over HTTP; LLM.generate returns the request's output with `error` set."""
