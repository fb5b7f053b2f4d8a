"""Helpers shared by the test modules (importable as ``support``: pyproject's pytest ``pythonpath``)."""
