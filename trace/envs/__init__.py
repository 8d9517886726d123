"""Environments: one protocol (``base.Environment``), a conformance checker, one module per task."""
