"""The evaluation of a built engine (``kiln eval``): perplexity per corpus domain, greedy agreement with a
reference engine, decode speed and size."""
