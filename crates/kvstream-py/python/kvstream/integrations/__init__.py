"""Integrations of kvstream with other libraries.

- :mod:`kvstream.integrations.transformers`: kvstream as a Hugging Face transformers attention
  implementation (``attn_implementation="kvstream"``) for the decode steps of ``generate``.

Importing this package imports none of those libraries; each submodule imports its library
when it is used.
"""
