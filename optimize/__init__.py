"""kiln.optimize: rewrite an exported ONNX graph into the engine graph, and build engine dirs.

Each fusion lives in its own module (pattern, check, rewrite) and reports how often it
fired; ``kiln.optimize.pipeline.optimize_model`` runs them in order, and
``kiln.optimize.build.build_engine`` goes from a checkpoint to an engine directory.
"""
