"""Runnable examples of using this project's parts from other frameworks (``python -m examples.<name>``)."""
