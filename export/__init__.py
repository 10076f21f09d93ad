"""kiln.export: model sources (HF checkpoint dirs, GGUF files) and the reference PyTorch model."""

from .checkpoint import default_model_path, load_checkpoint
from .checkpoint_types import Checkpoint, TokenizerFiles
from .reference import ReferenceModel

__all__ = ["Checkpoint", "TokenizerFiles", "ReferenceModel", "default_model_path", "load_checkpoint"]
