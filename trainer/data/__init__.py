"""Training data that needs no download, read through a deterministic, resumable loader."""
