"""Policy models, tokenizers, ReAct formatting and generation backends."""
