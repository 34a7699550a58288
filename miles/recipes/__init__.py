"""Demo and test material: tiny models, the tiny pretrained base, its synthetic tasks.

Nothing in the trainer depends on this package; it builds what `make demo` and the
tests train on, with no download.
"""
