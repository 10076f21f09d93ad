"""The objects a serving process makes while starting (the engine, its tokenizer, the HTTP framework's
routes and schemas, imported modules) live until it exits, yet the cyclic garbage collector walks all of
them in every full collection, holding the GIL, so the engine thread and the event loop both stop. Frozen
into the collector's permanent generation, they are no longer walked: `kiln serve` on a small engine held
~79,000 tracked objects and a full collection under load took 25.6 ms; frozen, ~4,000 and 1.1 ms
(benchmarks/RESULTS.md, "Server under hostile traffic")."""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> None:
    """Collect what start-up left unreachable, then take every surviving object out of later collections.
    Called once a serving process has loaded its engine; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
