"""Reporting: the ablation report read back from MLflow, its JSON, Markdown and plots, the statistics behind
its intervals, and the allocation audit.

Nothing is imported here: import the module you need (``from trace.reporting.report import collect_results``).
"""
