"""Configuration: the typed config tree mirroring ``params.yaml`` and its sections, params-file reading, the
params each DVC stage reads, and the process environment.

Nothing is imported here (``process_env`` must stay importable by the system Python before the virtual
environment exists): import the module you need (``from trace.configuration.config import Config``).
"""
