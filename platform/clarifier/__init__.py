"""Clarifier: train, evaluate, promote and serve query-clarification models on Ray."""
__version__ = "0.1.0"
