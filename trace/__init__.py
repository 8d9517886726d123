"""trace: Tree Rollout Allocation for Contrastive Exploration (TRACE), arXiv 2606.11119.

The library behind the pipeline in ``flows/``. Core modules (tree, allocation, advantages) use numpy only;
torch, transformers, DeepSpeed and vLLM are imported where they are needed, never at package import.

The package name shadows the standard-library ``trace`` module: run code as modules from the repository
root (``python -m flows.pipeline``) so this folder comes first on ``sys.path``.
"""

__version__ = "0.1.0"
IS_TRACE_PROJECT = True
