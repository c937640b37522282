"""DP-SGD inside other libraries' training loops.

Each submodule imports the library it integrates with, so import it by name:
:mod:`dpfunc.integrations.transformers` (the ``hf`` extra) holds
:class:`~dpfunc.integrations.transformers.PrivateTrainer`, a
``transformers.Trainer`` that trains with DP-SGD.
"""
