"""Placeholder: the selection pass."""


def run(gm, debug_dir=None):
    return []
