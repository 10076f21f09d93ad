"""Structured output: specs of what a request's text must match, and the token masks that enforce them."""

from kiln.runtime.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
