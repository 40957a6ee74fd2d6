"""Checkpoints the project writes itself: random-weight presets in HF format with a locally
trained BPE tokenizer (tests, demos and the embedded default model)."""
