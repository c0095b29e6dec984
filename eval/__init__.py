"""Evaluation: accuracy metrics against the baseline, gates, and reports."""
