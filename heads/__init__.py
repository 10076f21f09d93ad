"""Medusa and hydra draft heads (``kiln train-medusa``): trained on the reference model's own answers, saved as an
artifact that ``kiln build --medusa`` attaches to the engine graph."""
