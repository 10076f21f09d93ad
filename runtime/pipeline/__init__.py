"""Pipeline parallelism: an engine's stages (kiln/pipeline_stages.py) run one after another behind one
ModelRunner, so scheduling, prefix caching, preemption and speculative verification stay in one Engine.

stage.py runs one stage's graph with its layers' KV pools; runner.py chains stages in this process;
ray_stages.py places each stage in a Ray actor and chains their calls; micro_batch.py cuts a step into
micro-batches of whole sequences, which the Ray stages overlap, and joins their outputs."""
