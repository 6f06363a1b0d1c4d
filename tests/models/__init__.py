"""Test models: unmodified HF transformers DSA models (hf.py) and indexer spellings found in the wild (spellings.py)."""
