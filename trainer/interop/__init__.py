"""Interoperability with the ecosystem: Hugging Face weights in (`--init-from-hf`) and out
(`scaletrain ckpt export --format hf`)."""
