"""Interchangeable implementations of the writer and decode attention (``quantmla_core.backends``).

One folder per backend; its ``__init__`` declares what it serves and must import no
optional package at import time (``quantmla_core.dispatch`` loads the ops lazily).
"""
