//! Models: shared tensor ops, the architectures, heads, loading and saving.
