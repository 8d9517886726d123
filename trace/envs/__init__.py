"""Environments: one protocol and its optional capabilities (``base``), a conformance checker, one module per
task family, and the factory that builds the environment of a task by name (``registry``)."""
