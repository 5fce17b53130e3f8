"""Triton device code and autotune configs only (installed as ``revtriton.kernels``).

Nothing here knows about autograd or modules: launchers, references and autograd
Functions live in ``revtriton.ops``.
"""
