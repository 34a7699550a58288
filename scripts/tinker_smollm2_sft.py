"""Supervised fine-tuning of SmolLM2-135M-Instruct through the Tinker SDK: held-out loss falls.

    .venv/bin/python scripts/tinker_smollm2_sft.py [--task next] [--steps 20] [--batch 32] [--lr 1e-3]
    .venv/bin/python scripts/tinker_smollm2_sft.py --base-url http://127.0.0.1:8068   # a running trainer

Starts the trainer (`python -m miles.main.train_multi_lora_async`: one slot, one builtin
engine, CPU) unless `--base-url` is given, and drives it as any Tinker client would, with
the official `tinker` SDK: `create_lora_training_client`, then per step one
`forward_backward` with `cross_entropy` on `--batch` rows of the task's train split and one
`optim_step`. Rows are chat conversations in the model's own template (see
`tinker_smollm2_common.py`); the loss weights only the reply (the number and `<|im_end|>`),
never the prompt.

Measured on the task's held-out (test) split, which no step trains on: the mean loss per
reply token (`forward`, no gradient) before, every `--eval-every` steps and after; and the
greedy exact-match accuracy of the untrained model's snapshot and of the trained one's
(`save_weights_and_get_sampling_client`, sampled by the trainer's engine). Prints one line
per step (train loss per reply token, seconds, tokens/s) and a final `SUMMARY` line; exits 1
when the held-out loss did not fall.
"""

from __future__ import annotations

import sys
import time

import tinker
from tinker import types
from tinker_smollm2_common import (
    ROOT,
    TIMEOUT,
    Row,
    base_parser,
    create_model,
    greedy_accuracy,
    minutes,
    prepare,
    running_trainer,
    service_client,
    split_rows,
    timed,
)


def sft_datum(row: Row) -> types.Datum:
    """Next-token targets over prompt and reply; only the reply's tokens carry weight."""
    tokens = row.prompt + row.answer
    weights = [0.0] * (len(row.prompt) - 1) + [1.0] * len(row.answer)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def reply_tokens(data: list[types.Datum]) -> float:
    return sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)


def held_out_loss(trainer: tinker.TrainingClient, data: list[types.Datum]) -> float:
    """Mean negative logprob per reply token, from a `forward` (no gradient)."""
    out = trainer.forward(data, "cross_entropy").result(timeout=TIMEOUT)
    total = sum(-(o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
                for o, d in zip(out.loss_fn_outputs, data, strict=True))
    return float(total) / reply_tokens(data)


def sft_step(trainer: tinker.TrainingClient, data: list[types.Datum], lr: float) -> float:
    """One forward_backward and one optim_step; the batch's loss per reply token."""
    # Both calls are queued before either result is read: the trainer runs them in order.
    fwd_bwd = trainer.forward_backward(data, "cross_entropy")
    optim = trainer.optim_step(types.AdamParams(learning_rate=lr))
    loss_sum = fwd_bwd.result(timeout=TIMEOUT).metrics["loss:sum"]
    optim.result(timeout=TIMEOUT)
    return loss_sum / reply_tokens(data)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--steps", type=int, default=20, help="optim_steps.")
    parser.add_argument("--batch", type=int, default=32, help="Rows per forward_backward.")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of every optim_step.")
    parser.add_argument("--eval-every", type=int, default=10, help="Held-out loss every this many steps too.")
    args = parser.parse_args(argv)
    started = time.monotonic()
    tokenizer = prepare(args)
    train, test = split_rows(args, tokenizer, args.steps * args.batch)
    test_data = [sft_datum(row) for row in test]

    with running_trainer(args, ROOT / "runs" / "tinker-smollm2-sft") as url, \
            service_client(url, args.api_key) as service:
        trainer = create_model(service, url, args)
        print(f"model {trainer.model_id} ready {time.monotonic() - started:.0f} s after start", flush=True)
        times: dict[str, float] = {}
        with timed(times, "eval"):
            loss_before = held_out_loss(trainer, test_data)
            acc_before = greedy_accuracy(trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT),
                                         tokenizer, test)
        print(f"held-out ({len(test)} {args.task} rows): loss/token {loss_before:.4f}, greedy accuracy "
              f"{acc_before:.1%} ({times['eval']:.0f} s)", flush=True)
        for step in range(1, args.steps + 1):
            data = [sft_datum(row) for row in train[(step - 1) * args.batch: step * args.batch]]
            step_times: dict[str, float] = {}
            with timed(step_times, "train"):
                loss = sft_step(trainer, data, args.lr)
            times["train"] = times.get("train", 0.0) + step_times["train"]
            tokens = sum(d.model_input.length for d in data)
            line = (f"step {step:3d}/{args.steps}  train loss/token {loss:.4f}  {step_times['train']:5.1f} s  "
                    f"{tokens / step_times['train']:4.0f} tok/s")
            if step % args.eval_every == 0 and step < args.steps:
                with timed(times, "eval"):
                    line += f"  held-out loss/token {held_out_loss(trainer, test_data):.4f}"
            print(f"{line}  [{time.monotonic() - started:.0f} s]", flush=True)
        with timed(times, "eval"):
            loss_after = held_out_loss(trainer, test_data)
            acc_after = greedy_accuracy(trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT),
                                        tokenizer, test)
    print(f"SUMMARY sft task={args.task} steps={args.steps} batch={args.batch} lr={args.lr:g} rank={args.rank} "
          f"seed={args.seed}: held-out loss/token {loss_before:.4f} -> {loss_after:.4f}, greedy accuracy "
          f"{acc_before:.1%} -> {acc_after:.1%} ({len(test)} rows); wall {minutes(time.monotonic() - started)} "
          f"(train steps {minutes(times['train'])}, held-out scoring {minutes(times['eval'])})", flush=True)
    return 0 if loss_after < loss_before else 1


if __name__ == "__main__":
    sys.exit(main())
