"""kiln: an ahead-of-time LLM compiler and a thin serving runtime."""

__version__ = "0.1.0"
