"""K Tinker SDK clients against one server: the client loop of `tinker_vs_skyrl.py`.

    python scripts/bench/tinker_clients.py --base-url URL --base-model DIR --vocab 100 --clients 8
    {"op": "train", "k": 4, "steps": 3, "mode": "concurrent"}      # one JSON request a line on stdin
    {"op": "sample", "k": 4, "calls": 3, "mode": "sequential"}     # one JSON answer a line on stdout
    {"op": "quit"}

Needs only the `tinker` SDK and numpy, so the same file drives every server under the same
SDK (0.24.1 in SkyRL's virtualenv; ours speaks it too). At start it opens `--clients`
service clients (one session each, as separate users would), one LoRA training client on
each (rank `--rank`, attention and MLP layers, no unembedding: SkyRL 0.3.0 trains no other
layout), one training step each, then a sampling client of each one's saved weights and one
sample each: every compile and first load happens before a timed request. It prints
`{"ready": ...}` and answers requests until `quit`:

- `train`: clients 0..k-1 each run `steps` steps of `forward_backward` (`--datums` datums of
  `--seq-len` random tokens, cross_entropy, every weight 1) then `optim_step`, both sent
  before either result is read. `concurrent`: one thread per client, all at once;
  `sequential`: one client after the other. Answers the wall time, the tokens trained
  (`k * steps * datums * seq_len`) and each step's latency.
- `sample`: clients 0..k-1 each send `calls` sample requests in turn (a `--prompt-len`
  token prompt, `--num-samples` samples of `--max-tokens` tokens, temperature 1, no stop
  token: every sample is `--max-tokens` long), each read before the next is sent; same
  modes. Answers the wall time and the tokens generated (counted from the answers).

The random tokens, seeds and prompts are seeded (`--seed`), the same against every server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tinker
from tinker import types

FIRST_TOKEN = 4
"""Token ids from here up: past the special tokens of the benchmark's tokenizer."""


def resolved(value: Any) -> Any:
    """SDK 0.38 returns futures of clients where 0.24 returns the clients."""
    result = getattr(value, "result", None)
    return result() if callable(result) else value


class Clients:
    """`--clients` clients, each its own session, LoRA training client and sampling client,
    set up and warmed up at construction."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = np.random.default_rng(args.seed)
        self.services = [tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
                         for _ in range(args.clients)]
        self.trainers = [resolved(service.create_lora_training_client(
            args.base_model, rank=args.rank, seed=args.seed + i, train_unembed=False))
            for i, service in enumerate(self.services)]
        self.batches = [self.batch(rng) for _ in range(args.clients)]
        """Each client's datums: the same every step (the loop times calls, not learning)."""
        self.prompt = types.ModelInput.from_ints(
            rng.integers(FIRST_TOKEN, args.vocab, size=args.prompt_len).tolist())
        self.adam = types.AdamParams(learning_rate=1e-4)
        self.each(range(args.clients), lambda i: self.step(i), "concurrent")
        self.samplers = [resolved(trainer.save_weights_and_get_sampling_client()) for trainer in self.trainers]
        self.each(range(args.clients), lambda i: self.sample(i), "concurrent")

    def close(self) -> None:
        """Ends the sessions (their models are unloaded) where the SDK can: 0.24 has no close."""
        for service in self.services:
            close = getattr(service, "close", None)
            if close is not None:
                close()

    def batch(self, rng: np.random.Generator) -> list[types.Datum]:
        out = []
        for _ in range(self.args.datums):
            tokens = rng.integers(FIRST_TOKEN, self.args.vocab, size=self.args.seq_len + 1)
            out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                                   loss_fn_inputs={"target_tokens": tokens[1:].astype(np.int64),
                                                   "weights": np.ones(self.args.seq_len, dtype=np.float32)}))
        return out

    def step(self, i: int) -> float:
        start = time.perf_counter()
        fwd_bwd = self.trainers[i].forward_backward(self.batches[i], "cross_entropy")
        optim = self.trainers[i].optim_step(self.adam)
        fwd_bwd.result()
        optim.result()
        return time.perf_counter() - start

    def sample(self, i: int) -> int:
        params = types.SamplingParams(max_tokens=self.args.max_tokens, temperature=1.0, stop=[])
        response = self.samplers[i].sample(prompt=self.prompt, num_samples=self.args.num_samples,
                                           sampling_params=params).result()
        return sum(len(sequence.tokens) for sequence in response.sequences)

    @staticmethod
    def each(clients: range, run: Callable[[int], Any], mode: str) -> list[Any]:
        """`run(i)` for every client: one thread each at once, or one after the other."""
        if mode == "sequential":
            return [run(i) for i in clients]
        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            return list(pool.map(run, clients))

    def train(self, k: int, steps: int, mode: str) -> dict[str, Any]:
        latencies: list[float] = []
        lock = threading.Lock()

        def loop(i: int) -> None:
            for _ in range(steps):
                seconds = self.step(i)
                with lock:
                    latencies.append(seconds)

        start = time.perf_counter()
        self.each(range(k), loop, mode)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": k * steps * self.args.datums * self.args.seq_len,
                "step_seconds": latencies}

    def sampled(self, k: int, calls: int, mode: str) -> dict[str, Any]:
        start = time.perf_counter()
        tokens = self.each(range(k), lambda i: sum(self.sample(i) for _ in range(calls)), mode)
        return {"seconds": time.perf_counter() - start, "tokens": sum(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--base-model", required=True, help="the base model's name as the server knows it")
    parser.add_argument("--api-key", default="tml-bench", help="the SDK wants one that starts with tml-")
    parser.add_argument("--vocab", type=int, required=True, help="the base model's vocabulary size")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    start = time.perf_counter()
    clients = Clients(args)
    answer({"ready": True, "setup_seconds": time.perf_counter() - start, "sdk": tinker.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        if request["op"] == "train":
            answer(clients.train(request["k"], request["steps"], request["mode"]))
        elif request["op"] == "sample":
            answer(clients.sampled(request["k"], request["calls"], request["mode"]))
        else:
            answer({"error": f"unknown op {request['op']!r}"})
    clients.close()


def answer(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


if __name__ == "__main__":
    main()
