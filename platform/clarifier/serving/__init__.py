"""Ray Serve application for Clarifier (``clarifier.serving.app``).

Importing this package does not import Ray; use ``from clarifier.serving.app import build_app``.
"""
