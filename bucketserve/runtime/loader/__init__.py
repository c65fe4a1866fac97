"""Finding a model's files: a Hugging Face directory as given, a GGUF converted once (by its
family's `GGUFLayout`) into a cached one."""
