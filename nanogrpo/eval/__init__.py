"""Evaluation: held-out generation and grading, paired statistics, pairwise Elo, the run page."""
