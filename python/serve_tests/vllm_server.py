"""A real `vllm serve` process (vLLM's OpenAI server, `python -m
vllm.entrypoints.openai.api_server`) with kvtier as its KV connector, and the streaming
completion client the serve test measures time to first token with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar import stop_process  # python/tests, on the path the serve test sets

__all__ = ["Completion", "VllmServer", "start_vllm"]


@dataclass
class Completion:
    """One greedy completion: the time to its first token, its tokens, each token's top
    log-probabilities (vLLM's numbers, compared exactly) and the prompt tokens vLLM did not
    compute (`usage.prompt_tokens_details.cached_tokens`: its own cache plus the connector's)."""

    ttft_ms: float
    tokens: list[str]
    top_logprobs: list[dict[str, float]]
    cached_tokens: int


@dataclass
class VllmServer:
    """A running vLLM OpenAI server on loopback."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.url(path), json.dumps(body or {}).encode(),
                                     {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=600)

    def complete(self, prompt: list[int], max_tokens: int) -> Completion:
        """A streamed greedy completion of token ids `prompt` (end of text ignored)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.monotonic()
        ttft_ms = 0.0
        tokens: list[str] = []
        top: list[dict[str, float]] = []
        cached = -1
        with self.post("/v1/completions", body) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices", []):
                    lp = choice.get("logprobs") or {}
                    if lp.get("tokens") and not tokens:
                        ttft_ms = (time.monotonic() - start) * 1000
                    tokens += lp.get("tokens") or []
                    top += lp.get("top_logprobs") or []
                usage = chunk.get("usage")
                if usage:
                    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        return Completion(ttft_ms, tokens, top, cached)

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's own prefix cache (a dev-mode endpoint), so the next hit can only come
        from the connector."""
        with self.post("/reset_prefix_cache") as resp:
            assert resp.status == 200, resp.status

    def metric(self, name: str) -> float:
        """The sum of Prometheus series `name` on vLLM's /metrics."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL after 60 s."""
        stop_process(self.process, 60)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def cpu_binding(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: this process's cores split in `tp`
    runs (vLLM binds each worker's threads to one NUMA node otherwise, and this machine has one)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    runs = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(tp)]
    return "|".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def start_vllm(model_dir: Path, port: int, log_path: Path, sidecar: str, block_tokens: int,
               timeout_s: float = 600, tp: int = 1, **extra_config: Any) -> VllmServer:
    """Starts vLLM's OpenAI server on `model_dir` (tensor parallel over `tp` CPU workers) with
    kvtier (`sidecar`, and the connector's `extra_config`) as its KV connector and returns once
    /health answers; raises with the log's tail if it exits or times out."""
    # KVTIER_KV_PATH (default auto) picks the connector's kv_path, to compare in place and staging.
    extra_config = {"kv_path": os.environ.get("KVTIER_KV_PATH", "auto"), **extra_config}
    connector = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"sidecar": sidecar, **extra_config}}
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", "2"), "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--block-size", str(block_tokens), "--max-model-len", "8192", "--dtype", "bfloat16",
         "--enforce-eager", "--enable-prompt-tokens-details", "--tensor-parallel-size", str(tp),
         "--kv-transfer-config", json.dumps(connector)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = VllmServer(proc, port, log_path, "tiny")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url("/health"), timeout=5) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"vllm serve did not answer /health in {timeout_s} s:\n{server.log_tail()}")
        time.sleep(1)
