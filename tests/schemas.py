"""Hypothesis strategies of JSON schemas whose every instance is short (strings of at most 4 characters, arrays of
at most 2 items, at most 6 leaves), so a constrained generation always completes within a small max_tokens: the
unit tests draw them against the fake model, the SmolLM2 tests against the real one through the server."""

from __future__ import annotations

from hypothesis import strategies as st

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(0, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 500}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda options: {"enum": options}),
    st.just({"type": "null"}),
)


def _object(children):
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


bounded_schemas = st.recursive(_leaf, lambda children: st.one_of(
    _object(children), children.map(lambda item: {"type": "array", "items": item, "maxItems": 2})), max_leaves=6)
