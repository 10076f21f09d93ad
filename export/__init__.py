"""kiln.export: model sources (HF checkpoint dirs, GGUF files) and the reference PyTorch model."""

from .checkpoint import Checkpoint, TokenizerFiles, default_model_path, load_checkpoint
from .reference import ReferenceModel

__all__ = ["Checkpoint", "TokenizerFiles", "ReferenceModel", "default_model_path", "load_checkpoint"]
