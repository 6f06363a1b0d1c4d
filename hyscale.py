"""The log name of the hyscale torch.compile backend (the package is ``hyscale_compile``).

    TORCH_LOGS="hyscale" python train.py    # one line per site: rewritten, or left alone and why
    TORCH_LOGS="+hyscale" python train.py   # and the details explain() shows (shapes, sizes, every reason)

torch parses TORCH_LOGS when it is imported, before any backend is loaded, and accepts a name it has no
registration for only when the name is an importable module: it then routes the logger of that name
(``logging.getLogger("hyscale")``, where hyscale_compile logs) to its own handlers. This module exists so
that the name is importable. It imports nothing and defines nothing; use ``hyscale_compile``.
"""
