"""PEFT one adapter at a time (`set_adapter`) ÷ ours in one mixed batch, same samples.

    python scripts/bench/peft_vs_mixed.py [--model tiny|llama60m|smollm2|DIR]
                                          [--adapters 4] [--rows 8] [--prompt-len 16] [--response-len 48]

The same 4 x 8 samples (8 rows per adapter, rank 16 on all linears) are trained the
way PEFT users do it, one `PeftModel` with 4 adapters: `set_adapter(name)`, forward
and backward the adapter's 8 rows (policy-gradient loss on the response tokens),
step that adapter's own AdamW; and the way this project does it: one `TorchTrainActor`
trains the 32 samples as one mixed batch and steps the 4 adapters (at the trainer's
defaults: on SmolLM2 the batch goes in three micro-batches within the activation budget).
Alternating.
The figure is time(PEFT) / time(ours). Target: >= 1.3 on the tiny base, >= 1.0 on
larger models.
"""

from __future__ import annotations

import sys

import benchlib
import torch
from benchlib import Figure
from train_mixed import build_actor, step_fn

from miles.backends.base import AdapterSpec


def peft_model(path, n_adapters: int, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, config, adapter_name="a0")
    for i in range(1, n_adapters):
        model.add_adapter(f"a{i}", config)
    optimizers = {}
    for i in range(n_adapters):
        name = f"a{i}"
        params = [p for n, p in model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizers[name] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    return model, optimizers


def peft_step_fn(model, optimizers, batches):
    """`batches`: adapter name -> (input_ids_BL, response_mask_BT, advantages_B)."""

    def run() -> None:
        for name, (ids_BL, mask_BT, adv_B) in batches.items():
            model.set_adapter(name)
            logits = model(input_ids=ids_BL, use_cache=False).logits
            logprobs_BT = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids_BL[:, 1:, None]).squeeze(-1)
            per_sample = (logprobs_BT * mask_BT).sum(1) / mask_BT.sum(1)
            loss = -(adv_B * per_sample).sum() / len(adv_B)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(optimizers[name].param_groups[0]["params"], 1.0)
            optimizers[name].step()
            optimizers[name].zero_grad()

    return run


def peft_batches(samples, advantages, names):
    out = {}
    for name in names:
        rows = [i for i, s in enumerate(samples) if s.adapter == name]
        ids = torch.tensor([samples[i].prompt_ids + samples[i].response_ids for i in rows])
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        mask[:, len(samples[rows[0]].prompt_ids) - 1 :] = 1.0
        out[name] = (ids, mask, torch.tensor([advantages[i] for i in rows]))
    return out


def main() -> None:
    parser = benchlib.base_parser(__doc__)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="samples per adapter")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--target", type=float, default=None, help="target ratio (default 1.3 on tiny, 1.0 otherwise)")
    args = parser.parse_args()
    benchlib.setup(args)
    if args.quick:
        args.adapters, args.rows, args.prompt_len, args.response_len = 2, 2, 4, 8
    path = benchlib.model_dir(args.model)
    names = [f"a{i}" for i in range(args.adapters)]
    samples, adv = benchlib.make_samples(
        args.adapters * args.rows, [(n, i) for i, n in enumerate(names)], args.prompt_len, args.response_len,
        benchlib.vocab_size(path),
    )
    actor = build_actor(path, args.adapters, args.rank)
    for i, name in enumerate(names):
        actor.load_adapter(AdapterSpec(name=name, slot=i, rank=args.rank, alpha=2.0 * args.rank,
                                       global_batch_size=args.rows, lr=1e-4))
    model, optimizers = peft_model(path, args.adapters, args.rank)
    cases = {
        "ours": step_fn(actor, samples, adv, names),
        "peft": peft_step_fn(model, optimizers, peft_batches(samples, adv, names)),
    }
    times = benchlib.alternate(cases, args.reps)
    target = args.target if args.target is not None else (1.3 if args.model == "tiny" else 1.0)
    # Both sides run args.threads torch threads; the trainer's are --actor-num-cpus-per-worker.
    threads = "" if args.threads == 1 else f" ({args.threads} torch threads each)"
    figure = Figure(
        figure=f"PEFT one adapter at a time ({args.adapters}x{args.rows} rows) ÷ ours one mixed batch{threads}",
        model=args.model,
        ours_label=f"ours, one batch of {args.adapters * args.rows}", baseline_label="PEFT set_adapter loop",
        ours=times["ours"], baseline=times["peft"], unit="s/step", ratio_of="baseline/ours", target=f">= {target}",
        params={"adapters": args.adapters, "rows": args.rows, "prompt_len": args.prompt_len,
                "response_len": args.response_len, "rank": args.rank, "threads": args.threads},
    )
    benchlib.report([figure], args.json, sys.argv)


if __name__ == "__main__":
    main()
