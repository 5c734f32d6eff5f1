"""The Llama-style decoder scaletrain trains."""
