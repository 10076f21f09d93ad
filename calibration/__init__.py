"""Calibration: activation statistics on real text, saved as an offline artifact."""
