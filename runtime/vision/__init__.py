"""kiln.runtime.vision: images into a vision-language engine (decoding, preprocessing, the encoder graph).

Pillow is the vision extra's (`pip install kiln[vision]`); numpy and onnxruntime do the rest. Nothing here imports
torch or transformers.
"""
