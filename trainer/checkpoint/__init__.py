"""Saving and restoring the whole training state through DCP and ckptd."""
