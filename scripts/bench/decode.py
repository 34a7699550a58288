"""Builtin engine generation tokens/s: K adapters mixed ÷ base only, and ours ÷ PEFT.

    python scripts/bench/decode.py [--model tiny|llama60m|smollm2|DIR] [--requests 16]
                                   [--new-tokens 48] [--adapters 8|1,8,32,64] [--prompt-len 16]

Runs the builtin engine's decode loop (`DecodeScheduler` over a model with the slot
page table, the code path behind `/generate`) in-process, without HTTP: 16 requests of
48 new tokens (greedy, eos ignored) spread round-robin over 8 adapters of rank 16 on all
linears, the same requests on the base model only (slot -1), and PEFT
`generate(adapter_names=...)` on the same mixed batch with the same adapter weights.
Alternating; tokens/s counts generated tokens over the wall time from submission to
the last token (prefill included). Targets: mixed ÷ base >= 0.80, ours ÷ PEFT >= 1.0.
With `--torch-decode`, a second engine whose decode steps take the torch paths (stacked,
or jagged past its threshold; `MultiLoRALinear.rowwise_decode = False`) runs the mixed
batch too: what the row-wise C kernel gains. With `--stacked-decode`, one whose decode
steps always take the stacked path (no kernel, `jagged_min_saved_macs = inf`): what the
choice of path gains.
"""

from __future__ import annotations

import functools
import sys
import threading

import benchlib
import torch
from benchlib import Figure

from miles import lora
from miles.rollout.engines.sampling import RowSampling
from miles.rollout.engines.scheduler import DecodeScheduler, Job, SchedulerConfig
from miles.utils.types import SamplingParams


def engine_model(path, n_slots: int, rank: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lora.inject_multi_lora(model, n_slots=n_slots, max_rank=rank, target_modules="all-linear")
    benchlib.random_lora_weights(model, n_slots, rank, alpha=2.0 * rank)
    return model


def peft_from_slots(path, model, n_slots: int, rank: int):
    """A PeftModel holding the same adapters as the engine's slots."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    peft = get_peft_model(base, config, adapter_name="s0")
    for slot in range(n_slots):
        name = f"s{slot}"
        if slot:
            peft.add_adapter(name, config)
        set_peft_model_state_dict(peft, lora.get_slot_weights(model, slot), adapter_name=name)
    return peft.eval()


class Engine:
    """The decode loop on its own thread, fed one burst of jobs at a time."""

    def __init__(self, model, max_running: int):
        self.model = model
        self.scheduler = DecodeScheduler(
            model, SchedulerConfig(max_running_requests=max_running, max_context=10**6, eos_token_ids=frozenset()),
            decode=lambda ids: "", slot_context=lambda slots: lora.use_slots(model, slots),
        )
        self.scheduler.start()

    def burst(self, prompts: list[list[int]], slots: list[int], new_tokens: int) -> list[list[int]]:
        done = threading.Semaphore(0)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        jobs = [
            Job(rid=f"b{i}", prompt_ids=p, params=params, slot=s, lora_name=None,
                sampling=RowSampling.from_params(params, None), on_done=lambda job: done.release())
            for i, (p, s) in enumerate(zip(prompts, slots))
        ]
        self.scheduler.submit(*jobs)
        for _ in jobs:
            done.acquire()
        return [j.output_ids for j in jobs]


def mixed_case(k: int, n_slots: int) -> str:
    """The largest K's case is "mixed", the one the other engines and PEFT are compared with."""
    return "mixed" if k == n_slots else f"mixed{k}"


def main() -> None:
    parser = benchlib.base_parser(__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--adapters", default="8",
                        help="adapters in the mixed batch; a comma list gives one figure per number")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-peft", action="store_true", help="skip the PEFT comparison")
    parser.add_argument("--stacked-decode", action="store_true",
                        help="also time a second engine whose decode steps always take the stacked path "
                             "(no kernel, never jagged): mixed (auto) ÷ mixed (stacked)")
    parser.add_argument("--torch-decode", action="store_true",
                        help="also time a second engine whose decode steps take the torch paths (no row-wise "
                             "kernel): mixed (auto) ÷ mixed (torch paths)")
    args = parser.parse_args()
    benchlib.setup(args)
    if args.quick:
        args.requests, args.new_tokens, args.prompt_len = 4, 4, 4
        args.adapters = ",".join(str(min(int(k), 2)) for k in args.adapters.split(","))
    ks = list(dict.fromkeys(int(k) for k in args.adapters.split(",")))
    n_slots = args.adapters = max(ks)
    path = benchlib.model_dir(args.model)
    vocab = benchlib.vocab_size(path)
    slots_of = {}
    for k in ks:
        samples, _ = benchlib.make_samples(args.requests, [(f"s{i}", i) for i in range(k)], args.prompt_len, 0, vocab)
        slots_of[k] = [s.slot for s in samples]
    prompts = [s.prompt_ids for s in samples]  # the same prompts for every K (same seed)
    slots = slots_of[n_slots]
    model = engine_model(path, n_slots, args.rank)
    engine = Engine(model, max_running=args.requests)
    tokens = args.requests * args.new_tokens
    cases = {"base": lambda: engine.burst(prompts, [-1] * len(prompts), args.new_tokens)}
    for k in ks:
        cases[mixed_case(k, n_slots)] = functools.partial(engine.burst, prompts, slots_of[k], args.new_tokens)
    other_engines = []
    for flag, name, jagged in ((args.torch_decode, "torch", lora.layer.JAGGED_MIN_SAVED_MACS),
                               (args.stacked_decode, "stacked", float("inf"))):
        if flag:
            other_model = engine_model(path, args.adapters, args.rank)
            for layer in lora.lora_modules(other_model).values():
                layer.rowwise_decode, layer.jagged_min_saved_macs = False, jagged
            other_engines.append(Engine(other_model, max_running=args.requests))
            cases[name] = functools.partial(other_engines[-1].burst, prompts, slots, args.new_tokens)
    if not args.no_peft:
        peft = peft_from_slots(path, model, args.adapters, args.rank)
        ids_BP = torch.tensor(prompts)
        names = [f"s{s}" for s in slots]

        def peft_generate() -> None:
            with torch.no_grad():
                peft.generate(input_ids=ids_BP, attention_mask=torch.ones_like(ids_BP), adapter_names=names,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=0)

        cases["peft"] = peft_generate
    try:
        times = benchlib.alternate(cases, args.reps)
    finally:
        for running in (engine, *other_engines):
            running.scheduler.stop()
    rate = {name: [tokens / t for t in ts] for name, ts in times.items()}
    params = {"requests": args.requests, "new_tokens": args.new_tokens, "adapters": args.adapters,
              "prompt_len": args.prompt_len, "rank": args.rank}
    figures = [Figure(
        figure=f"engine tokens/s, {k} adapters mixed ÷ base only", model=args.model,
        ours_label=f"{k} adapters mixed", baseline_label="base only", ours=rate[mixed_case(k, n_slots)],
        baseline=rate["base"], unit="tokens/s", ratio_of="ours/baseline", target=">= 0.75" if k >= 32 else ">= 0.80",
        params={**params, "adapters": k, "slots": n_slots},
    ) for k in ks]
    for name, what, baseline_label in (
        ("torch", "row-wise C kernel ÷ torch paths", "torch paths (stacked or jagged)"),
        ("stacked", "decode path chosen per step ÷ always stacked", "stacked decode steps"),
    ):
        if name in rate:
            figures.append(Figure(
                figure=f"engine tokens/s, {args.adapters} adapters mixed, {what}", model=args.model,
                ours_label="auto (row-wise kernel)", baseline_label=baseline_label, ours=rate["mixed"],
                baseline=rate[name], unit="tokens/s", ratio_of="ours/baseline", target="report", params=params,
            ))
    if "peft" in rate:
        figures.append(Figure(
            figure="engine tokens/s, ours ÷ PEFT generate(adapter_names=...) on the same mixed batch", model=args.model,
            ours_label="ours (builtin engine decode loop)", baseline_label="PEFT generate", ours=rate["mixed"],
            baseline=rate["peft"], unit="tokens/s", ratio_of="ours/baseline", target=">= 1.0", params=params,
        ))
    benchlib.report(figures, args.json, sys.argv)


if __name__ == "__main__":
    main()
