"""kiln.export.vision: a vision-language checkpoint's image side (vision tower + projector) as its own graph."""
