"""Parallelisms applied to the model, each a small function over one device mesh."""
