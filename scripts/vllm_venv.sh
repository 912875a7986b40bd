# Sourced by scripts/test_connectors.sh: the venv with vllm 0.34.0 (--no-deps: its scheduler, KV
# connector base and KV cache allocation, not its GPU server) and what those import
# (scripts/vllm-requirements.txt); ~2 min and 6 GiB here (torch). Sets $venv.
. scripts/lib.sh
engine_venv "${VLLM_VENV:-target/vllm-venv}" vllm==0.34.0 scripts/vllm-requirements.txt \
    -c "import vllm.v1.core.sched.scheduler, kvtier.integrations.vllm"
