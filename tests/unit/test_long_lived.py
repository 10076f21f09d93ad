"""A serving process's start-up objects leave the garbage collector's view (runtime/long_lived.py): frozen before
`kiln serve` starts answering, so a full collection while serving walks only what requests made."""

from __future__ import annotations

import gc

import pytest

from kiln.runtime.long_lived import freeze_start_up_objects


def tracked(obj: object) -> bool:
    """Whether a collection would walk ``obj`` (frozen objects are in no generation gc.get_objects lists)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # back into the oldest generation: the test process collects as before


def test_objects_made_before_are_frozen_and_later_ones_collected(unfrozen):
    before = [object()]
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle  # unreachable already: collected, not frozen
    freeze_start_up_objects()
    after = [object()]
    assert not tracked(before) and tracked(after) and gc.get_freeze_count() > 0
    garbage: list[object] = []
    garbage.append(garbage)
    del garbage
    assert gc.collect() >= 1  # a cycle made after the freeze is still found


def test_serve_freezes_once_the_app_is_built_before_answering(monkeypatch, unfrozen):
    pytest.importorskip("uvicorn")
    from server_fake import FakeAsyncLLM

    from kiln.runtime.server import launch

    counts: list[int] = []
    monkeypatch.setattr(launch._DrainingServer, "run", lambda self: counts.append(gc.get_freeze_count()))
    gc.unfreeze()
    launch.serve_llm(FakeAsyncLLM(), "a fake engine", launch.ServeOptions(port=0))
    assert counts and counts[0] > 0
