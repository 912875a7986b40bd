#!/usr/bin/env bash
# SGLang's own benchmark client, bench_serving.py from the sglang 0.5.14 package, unmodified,
# against `kvtier engine` (qwen3-30b-a3b cut to 1 layer, random weights) with a `kvtier serve`
# sidecar behind it, on loopback: `--backend sglang` (streaming /generate), `--cache-report`,
# the random-ids and generated-shared-prefix workloads. Nothing is downloaded at run time: the
# tokenizer is a local byte tokenizer written here (token id = ASCII byte, which is what the
# engine's byte codec does for the presets), so both sides count the same tokens.
#
# Usage: scripts/sglang_bench.sh [--full] [path/to/kvtier]
#   default: ~4 min of benchmarks on 2 cores (plus ~2 min to make the venv the first time);
#   --full: the seed-003-like sizes (longer prompts, more requests).
# Environment: SGLANG_VENV (default target/sglang-venv), PORT (default a free one).
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
bin=${1:-target/release/kvtier}
[ -x "$bin" ] || { echo "sglang_bench: $bin: no kvtier binary (cargo build --release first)" >&2; exit 2; }
bin=$(realpath "$bin")
. scripts/lib.sh
. scripts/sglang_venv.sh
start_processes sglang-bench

# A byte tokenizer for AutoTokenizer: ids 0..127 are the ASCII characters, as the engine's
# byte codec encodes them, so random prompts decode to text that encodes back to the same ids.
"$venv/bin/python" - "$work/tokenizer" <<'PY'
import json, os, sys
from tokenizers import Tokenizer, decoders, models
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
tok = Tokenizer(models.BPE(vocab={chr(b): b for b in range(128)}, merges=[]))
tok.decoder = decoders.Fuse()
tok.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 40960,
               "clean_up_tokenization_spaces": False}, f)
PY

port=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
"$bin" serve --socket "$work/kvtier.sock" --metrics off --host-capacity 4GiB \
    --set model.layers=1 >"$work/serve.log" 2>&1 &
pids+=($!)
wait_for "$work/serve.log" "serving" "${pids[-1]}"
"$bin" engine --model qwen3-30b-a3b --layers 1 --sidecar "unix://$work/kvtier.sock" \
    --listen "127.0.0.1:$port" >"$work/engine.log" 2>&1 &
pids+=($!)
wait_for "$work/engine.log" "serving http" "${pids[-1]}"
head -1 "$work/engine.log"

bench() {
    HOME="$work" "$venv/bin/python" -m sglang.bench_serving --backend sglang \
        --base-url "http://127.0.0.1:$port" --tokenizer "$work/tokenizer" \
        --request-rate inf --cache-report --disable-tqdm --seed 1 \
        --output-file "$work/results.jsonl" "$@"
}
if [ $full = 1 ]; then
    random=(--random-input-len 4096 --random-output-len 64 --num-prompts 64 --max-concurrency 16)
    gsp=(--gsp-num-groups 8 --gsp-prompts-per-group 16 --gsp-system-prompt-len 4096
         --gsp-question-len 512 --gsp-output-len 64 --max-concurrency 16)
else
    random=(--random-input-len 1024 --random-output-len 32 --num-prompts 32 --max-concurrency 16)
    gsp=(--gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024
         --gsp-question-len 128 --gsp-output-len 16 --max-concurrency 16)
fi
echo "## random-ids (no shared prefix; token ids sent as input_ids)"
bench --dataset-name random-ids --tokenize-prompt --random-range-ratio 1.0 "${random[@]}"
echo "## generated-shared-prefix (each group's system prompt shared by its questions)"
bench --dataset-name generated-shared-prefix "${gsp[@]}"
# The same prompts again after /flush_cache (bench_serving's --flush-cache) empties the
# engine's device cache: what the first pass stored, kvtier's host tier now serves.
echo "## generated-shared-prefix again, device cache flushed (hits from kvtier's host tier)"
bench --dataset-name generated-shared-prefix "${gsp[@]}" --flush-cache
