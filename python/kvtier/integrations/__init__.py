"""Engine integrations: :mod:`kvtier.integrations.sglang` (an SGLang HiCache storage backend).

Each imports its engine; import the one you use."""
