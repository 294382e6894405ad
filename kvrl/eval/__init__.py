"""Evaluation jobs: accuracy under KV budgets."""
