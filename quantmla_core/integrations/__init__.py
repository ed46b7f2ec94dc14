"""Integrations of QuantMLA with model libraries.

Each integration is its own submodule and imports its library only when it is imported itself,
so ``import quantmla_core`` never pulls in an optional package:

- :mod:`quantmla_core.integrations.transformers` -- Hugging Face ``transformers``:
  ``QuantMLACache`` (a ``transformers`` ``Cache`` on packed pages) and ``enable_quantmla(model)``
  (absorbed-MLA decode on that cache). Needs the ``transformers`` extra
  (``pip install 'quantmla[transformers]'``).
"""

__all__: list[str] = []
