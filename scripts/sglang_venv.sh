# Sourced by scripts/sglang_bench.sh and scripts/test_connectors.sh: the venv with sglang 0.5.14
# (--no-deps: its benchmark client and HiCache memory pools, not its GPU server) and what those
# import (scripts/sglang-requirements.txt); ~3 min and 6 GiB here (torch). Sets $venv.
. scripts/lib.sh
engine_venv "${SGLANG_VENV:-target/sglang-venv}" sglang==0.5.14 scripts/sglang-requirements.txt \
    -m sglang.bench_serving --help
