"""Train step (forward + backward + optimizer) of one mixed batch over K adapters ÷ K = 1.

    python scripts/bench/train_mixed.py [--model tiny|llama60m|smollm2|DIR] [--ks 2,4,8]
                                        [--batch 32] [--prompt-len 16] [--response-len 48]
                                        [--recompute [full|selective]] [--recompute-modules M ...]
                                        [--whole-batch] [--device cuda [--dtype bfloat16]]

One `TorchTrainActor` with 8 slots of rank 16 (all linears) holds 8 adapters. Each
repetition trains the same 32 samples once with every sample on adapter 0 (K = 1) and
once spread round-robin over K adapters, then steps every adapter present, alternating
the order. The figure is time(K) / time(1): what mixing adapters in a batch costs.
Target: <= 1.10 at K = 8, <= 1.15 past it (`--ks 8,32,64`: one actor with 64 slots, so
the slot page table is as large for K = 1 as for K = 64; give `--batch` at least the largest
K, or only that many adapters get samples). With `--recompute [full|selective]` (bare: full), a second actor
built with `--recompute-granularity` of that value trains the largest K's batch too,
alternating with the first: time(recompute) / time(keeping every activation), what the
memory saving costs; `--recompute-modules` is the trainer's flag for `selective`.
The actors run at the trainer's defaults: on CPU, micro-batches within the activation
budget (`--activation-budget-mb`, 1024 MiB; a small model's batch stays whole). With
`--whole-batch` a second actor trains the largest K's batch in one forward
(`--activation-budget-mb 0`), alternating: time(default) / time(whole batch).
"""

from __future__ import annotations

import sys
import time

import benchlib
from benchlib import Figure

from miles.backends.base import AdapterSpec
from miles.backends.rank.config import TrainActorConfig
from miles.backends.torch.actor import TorchTrainActor
from miles.utils.arguments import TORCH_RECOMPUTE_MODULES


def build_actor(path, n_slots: int, rank: int, micro_batch_size: int | None = None,
                recompute_granularity: str | None = None,
                recompute_modules: list[str] | None = None,
                activation_budget_mb: float | None = None, device: str = "cpu",
                dtype: str = "float32") -> TorchTrainActor:
    return TorchTrainActor(TrainActorConfig(hf_checkpoint=str(path), n_slots=n_slots, lora_rank=rank,
                                            device=device, dtype=dtype,
                                            micro_batch_size=micro_batch_size,
                                            activation_budget_mb=activation_budget_mb,
                                            recompute_granularity=recompute_granularity,
                                            recompute_modules=tuple(recompute_modules) if recompute_modules else None))


def step_fn(actor: TorchTrainActor, samples, advantages, names: list[str],
            parts: dict[str, list[float]] | None = None):
    """One train call and the optimizer step of every adapter in it; `parts` gets each one's
    seconds under "train" and "step"."""
    counts = {n: sum(1 for s in samples if s.adapter == n) for n in names}

    def run() -> None:
        start = time.perf_counter()
        actor.train(samples, advantages, counts)
        benchlib.synchronize()
        trained = time.perf_counter()
        actor.step_adapters(names)
        benchlib.synchronize()
        if parts is not None:
            parts["train"].append(trained - start)
            parts["step"].append(time.perf_counter() - trained)

    return run


def main() -> None:
    parser = benchlib.base_parser(__doc__)
    benchlib.add_device_args(parser)
    parser.add_argument("--ks", default="2,4,8", help="numbers of adapters in the mixed batch (compared with K = 1)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--recompute", nargs="?", const="full", default=None, choices=("full", "selective"),
                        help="also time the largest K with --recompute-granularity of this value (a second "
                             "actor; bare: full)")
    parser.add_argument("--recompute-modules", nargs="+", default=None, choices=TORCH_RECOMPUTE_MODULES,
                        help="with --recompute selective: the trainer's --recompute-modules")
    parser.add_argument("--activation-budget-mb", type=int, default=None,
                        help="the trainer's flag for the timed actors (default 1024 on CPU; 0: whole batches)")
    parser.add_argument("--whole-batch", action="store_true",
                        help="also time the largest K's batch in one forward (--activation-budget-mb 0), "
                             "against the default micro-batches")
    args = parser.parse_args()
    benchlib.setup(args)
    if args.quick:
        args.batch, args.prompt_len, args.response_len, args.ks = 8, 4, 8, "8"
    ks = [int(k) for k in args.ks.split(",")]
    path = benchlib.model_dir(args.model)
    n_slots = max(ks)
    actor = build_actor(path, n_slots, args.rank, activation_budget_mb=args.activation_budget_mb,
                        device=args.device, dtype=args.dtype)
    names = [f"a{i}" for i in range(n_slots)]
    for i, name in enumerate(names):
        # global_batch_size is only the gradient divisor here: every adapter steps each time.
        actor.load_adapter(AdapterSpec(name=name, slot=i, rank=args.rank, alpha=2.0 * args.rank,
                                       global_batch_size=args.batch, lr=1e-4))
    vocab = benchlib.vocab_size(path)
    cases = {}
    parts: dict[str, dict[str, list[float]]] = {}
    for k in [1, *ks]:
        samples, adv = benchlib.make_samples(args.batch, [(names[i], i) for i in range(k)], args.prompt_len,
                                             args.response_len, vocab)
        parts[f"K={k}"] = {"train": [], "step": []}
        cases[f"K={k}"] = step_fn(actor, samples, adv, names[:k], parts[f"K={k}"])
    if args.recompute:
        k = max(ks)
        recompute = build_actor(path, n_slots, args.rank, recompute_granularity=args.recompute,
                                recompute_modules=args.recompute_modules,
                                activation_budget_mb=args.activation_budget_mb, device=args.device, dtype=args.dtype)
        for i, name in enumerate(names):
            recompute.load_adapter(AdapterSpec(name=name, slot=i, rank=args.rank, alpha=2.0 * args.rank,
                                               global_batch_size=args.batch, lr=1e-4))
        samples, adv = benchlib.make_samples(args.batch, [(names[i], i) for i in range(k)], args.prompt_len,
                                             args.response_len, vocab)
        cases["recompute"] = step_fn(recompute, samples, adv, names[:k])
    if args.whole_batch:
        k = max(ks)
        whole = build_actor(path, n_slots, args.rank, activation_budget_mb=0, device=args.device, dtype=args.dtype)
        for i, name in enumerate(names):
            whole.load_adapter(AdapterSpec(name=name, slot=i, rank=args.rank, alpha=2.0 * args.rank,
                                           global_batch_size=args.batch, lr=1e-4))
        samples, adv = benchlib.make_samples(args.batch, [(names[i], i) for i in range(k)], args.prompt_len,
                                             args.response_len, vocab)
        cases["whole"] = step_fn(whole, samples, adv, names[:k])
        budget = actor.core.budget_tokens(samples)
        default_label = (f"micro-batches of up to {budget} tokens" if budget
                         else "one forward (the batch fits the budget)")
    times = benchlib.alternate(cases, args.reps)
    figures = [
        Figure(
            figure=f"train step, batch mixed over K={k} adapters ÷ K=1", model=args.model,
            ours_label=f"K={k}", baseline_label="K=1", ours=times[f"K={k}"], baseline=times["K=1"], unit="s/step",
            ratio_of="ours/baseline", target="<= 1.10" if k <= 8 else "<= 1.15",
            params={"batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                    "rank": args.rank, "k": k, "slots": n_slots},
        )
        for k in ks
    ]
    # The two parts of the largest K's step, each against K = 1's: the train call (forward and
    # backward of the mixed batch) and the optimizer step (AdamW over every adapter stepped:
    # K adapters' weights, moments and gradients instead of one's). Warm-up calls excluded.
    k = max(ks)
    for part, what in (("train", "train call (forward + backward)"), ("step", "optimizer step of every adapter")):
        ours, base = (parts[f"K={n}"][part][-args.reps:] for n in (k, 1))
        figures.append(Figure(
            figure=f"{what}, batch mixed over K={k} adapters ÷ K=1", model=args.model,
            ours_label=f"K={k}", baseline_label="K=1", ours=ours, baseline=base, unit="s",
            ratio_of="ours/baseline", target="report",
            params={"batch": args.batch, "rank": args.rank, "k": k, "slots": n_slots, "part": part}))
    if args.recompute:
        k = max(ks)
        recomputed = {"full": "recomputing every decoder layer",
                      "selective": "forming norm outputs and gated activations again"}[args.recompute]
        modules = f" --recompute-modules {' '.join(args.recompute_modules)}" if args.recompute_modules else ""
        if "mlp" in (args.recompute_modules or ()):
            recomputed = "running the MLP and its norm again"
        figures.append(Figure(
            figure=f"train step with --recompute-granularity {args.recompute}{modules} ÷ without, "
                   f"batch mixed over K={k} adapters",
            model=args.model, ours_label=recomputed, baseline_label="keeping every activation",
            ours=times["recompute"], baseline=times[f"K={k}"], unit="s/step", ratio_of="ours/baseline", target="report",
            params={"batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                    "rank": args.rank, "k": k},
        ))
    if args.whole_batch:
        k = max(ks)
        figures.append(Figure(
            figure=f"train step at the default activation budget ÷ the whole batch in one forward, "
                   f"batch mixed over K={k} adapters",
            model=args.model, ours_label=default_label, baseline_label="one forward (--activation-budget-mb 0)",
            ours=times[f"K={k}"], baseline=times["whole"], unit="s/step", ratio_of="ours/baseline", target="report",
            params={"batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                    "rank": args.rank, "k": k, "micro_batch_tokens": budget},
        ))
    benchlib.report(figures, args.json, sys.argv)


if __name__ == "__main__":
    main()
