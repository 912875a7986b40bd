"""Engine integrations: :mod:`kvtier.integrations.sglang` (an SGLang HiCache storage backend) and
:mod:`kvtier.integrations.vllm` (a vLLM KV connector); :mod:`kvtier.integrations.staging` is the
staging pool both use. Each imports its engine; import the one you use."""
