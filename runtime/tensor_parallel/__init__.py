"""Tensor parallelism within a host: an engine's rank graphs (kiln/tensor_parallel.py) run in one process per rank
behind one ModelRunner, so scheduling, prefix caching and preemption stay in one Engine.

rank.py runs one rank's graph in its process; group.py starts the ranks and drives a step through all of them;
runner.py is the ModelRunner."""
