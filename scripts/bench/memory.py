"""Peak memory of one trainer with 8 adapter slots ÷ 8 PEFT trainers (one per adapter).

    python scripts/bench/memory.py [--model tiny|llama60m|smollm2|DIR] [--adapters 8] [--rows 4]
                                   [--micro-batch-size N] [--recompute-granularity full|selective]
                                   [--recompute-modules layernorm mlp] [--activation-budget-mb MB]

Each trainer runs in its own fresh Python process and trains one step: ours is one
`TorchTrainActor` with 8 slots training a mixed batch of 8 x 4 samples and stepping
all 8 adapters; the baseline is what serving 8 adapters with PEFT takes, 8 processes
each holding the base model, one LoRA adapter and its AdamW, training its 4 samples.
Peak memory is each process's peak resident set size (`ru_maxrss`, the whole process:
interpreter, torch and model); the baseline is the sum over its 8 processes. The
processes run one at a time, alternating ours and PEFT. Ours runs at the trainer's
defaults: on CPU, micro-batches whose activations fit `--activation-budget-mb` (1024 MiB;
0 forwards the whole mixed batch at once); `--micro-batch-size` (the trainer's flag)
forwards that many rows at a time instead; `--recompute-granularity full` (the trainer's flag)
has ours keep only each decoder layer's input and recompute the layer in the backward, and
`selective` has it drop the norm outputs and gated activations and form them again there
(`--recompute-modules`, the trainer's flag: `mlp` runs the MLP and its norm again as well).
Target: <= 0.25.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import benchlib
import torch
from benchlib import Figure

from miles.utils.arguments import TORCH_RECOMPUTE_MODULES


def worker(kind: str, model: str, adapters: int, rows: int, prompt_len: int, response_len: int, rank: int,
           micro_batch_size: int | None = None, recompute_granularity: str | None = None,
           recompute_modules: list[str] | None = None, activation_budget_mb: int | None = None) -> None:
    path = benchlib.model_dir(model)
    vocab = benchlib.vocab_size(path)
    if kind == "ours":
        from train_mixed import build_actor, step_fn

        from miles.backends.base import AdapterSpec

        names = [f"a{i}" for i in range(adapters)]
        actor = build_actor(path, adapters, rank, micro_batch_size, recompute_granularity, recompute_modules,
                            activation_budget_mb)
        for i, name in enumerate(names):
            actor.load_adapter(AdapterSpec(name=name, slot=i, rank=rank, alpha=2.0 * rank, global_batch_size=rows))
        samples, adv = benchlib.make_samples(adapters * rows, [(n, i) for i, n in enumerate(names)], prompt_len,
                                             response_len, vocab)
        step_fn(actor, samples, adv, names)()
    else:
        from peft_vs_mixed import peft_batches, peft_model, peft_step_fn

        model, optimizers = peft_model(path, 1, rank)
        samples, adv = benchlib.make_samples(rows, [("a0", 0)], prompt_len, response_len, vocab)
        peft_step_fn(model, optimizers, peft_batches(samples, adv, ["a0"]))()
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def measure(kind: str, args) -> int:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", args.model, "--adapters", str(args.adapters),
           "--rows", str(args.rows), "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
           "--rank", str(args.rank), "--threads", str(args.threads)]
    if args.micro_batch_size:
        cmd += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.recompute_granularity:
        cmd += ["--recompute-granularity", args.recompute_granularity]
    if args.recompute_modules:
        cmd += ["--recompute-modules", *args.recompute_modules]
    if args.activation_budget_mb is not None:
        cmd += ["--activation-budget-mb", str(args.activation_budget_mb)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_bytes"]


def main() -> None:
    parser = benchlib.base_parser(__doc__, default_reps=3)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="samples per adapter")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="rows per forward/backward of ours (default: the whole batch of adapters x rows)")
    parser.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                        help="the trainer's flag: full recomputes every decoder layer in the backward, "
                             "selective only the norm outputs and gated activations")
    parser.add_argument("--recompute-modules", nargs="+", default=None, choices=TORCH_RECOMPUTE_MODULES,
                        help="with --recompute-granularity selective: the trainer's --recompute-modules")
    parser.add_argument("--activation-budget-mb", type=int, default=None,
                        help="the trainer's flag: ours' micro-batches keep about this many MiB of activations "
                             "(default 1024 on CPU; 0: the whole batch in one forward)")
    parser.add_argument("--peft-processes", type=int, default=None,
                        help="PEFT processes actually run per repetition (default: one per adapter); the PEFT "
                             "side is their mean peak times the number of adapters (the processes are identical)")
    parser.add_argument("--worker", choices=("ours", "peft"), default=None, help=argparse_hidden())
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(args.threads)
        worker(args.worker, args.model, args.adapters, args.rows, args.prompt_len, args.response_len, args.rank,
               args.micro_batch_size, args.recompute_granularity, args.recompute_modules, args.activation_budget_mb)
        return
    benchlib.setup(args)
    if args.quick:
        args.adapters, args.rows, args.prompt_len, args.response_len = 2, 2, 4, 8
    benchlib.model_dir(args.model)  # build once, outside the measured processes
    ours, peft = [], []
    for rep in range(args.reps):
        order = ("ours", "peft") if rep % 2 == 0 else ("peft", "ours")
        for kind in order:
            if kind == "ours":
                ours.append(measure("ours", args) / 2**20)
            else:
                runs = [measure("peft", args) for _ in range(args.peft_processes or args.adapters)]
                peft.append(sum(runs) / len(runs) * args.adapters / 2**20)
    settings = [f"in micro-batches of {args.micro_batch_size}"] if args.micro_batch_size else []
    if args.activation_budget_mb is not None and not args.micro_batch_size:
        settings.append("as one whole batch" if args.activation_budget_mb == 0
                        else f"with --activation-budget-mb {args.activation_budget_mb}")
    if args.recompute_granularity:
        modules = f" --recompute-modules {' '.join(args.recompute_modules)}" if args.recompute_modules else ""
        settings.append(f"with --recompute-granularity {args.recompute_granularity}{modules}")
    figure = Figure(
        figure=f"peak memory, one trainer with {args.adapters} slots ÷ {args.adapters} PEFT trainers"
               + (f" (ours {', '.join(settings)})" if settings else ""), model=args.model,
        ours_label=f"ours, 1 process x {args.adapters} slots", baseline_label=f"PEFT, {args.adapters} processes",
        ours=ours, baseline=peft, unit="MiB", ratio_of="ours/baseline", target="<= 0.25",
        params={"adapters": args.adapters, "peft_processes_run": args.peft_processes or args.adapters,
                "rows": args.rows, "prompt_len": args.prompt_len, "response_len": args.response_len, "rank": args.rank,
                "micro_batch_size": args.micro_batch_size, "recompute_granularity": args.recompute_granularity,
                "recompute_modules": args.recompute_modules, "activation_budget_mb": args.activation_budget_mb},
    )
    benchlib.report([figure], args.json, sys.argv)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
