# Submodules: kvstream.integrations.transformers (import it explicitly).
