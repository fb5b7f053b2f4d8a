"""Clarifier inside other frameworks' pipelines (optional extras; each module imports its framework)."""
