"""A train rank's forward passes over micro-batches: a train call's forward and backward
(server-driven samples with their adapter's loss, client datums with Tinker's, in the same
micro-batches), a client `forward` without grad, and the scorings without grad (logprobs,
the KL to the base model).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.backends.common.batching import (
    ActivationBudget,
    Advantage,
    MicroBatch,
    make_micro_batches,
    response_logprobs,
)
from miles.backends.common.client_loss import ClientRow, client_loss_terms, client_rows, datum_outputs
from miles.backends.common.loss import LossParams, approx_kl_per_sample, policy_loss_terms
from miles.backends.rank.adapters import SlotAdapters
from miles.backends.rank.take_back import TakeBack
from miles.utils.types import Sample
from miles.utils.types.client import ClientWork, DatumOutput

logger = logging.getLogger(__name__)


@dataclass
class LossSums:
    """Sums over one rank's samples of one adapter; `TrainGroup` adds ranks and divides."""

    loss_sum: float = 0.0
    samples: int = 0
    clipped_tokens: float = 0.0
    tokens: float = 0.0
    kl_sum: float = 0.0
    tis_sum: float = 0.0

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(
            self.loss_sum + other.loss_sum, self.samples + other.samples, self.clipped_tokens + other.clipped_tokens,
            self.tokens + other.tokens, self.kl_sum + other.kl_sum, self.tis_sum + other.tis_sum,
        )


@dataclass(frozen=True)
class RankTrainResult:
    """What one rank's train call gave."""

    stats: dict[str, LossSums]
    """Loss sums of the server-driven adapters (empty on a rank that does not report)."""
    client: list[list[DatumOutput]] | None = None
    """One list per `ClientWork` given (this rank's datums of it, in order); None on a rank
    that does not report (Megatron: TP ranks past 0)."""


def _add_stats(stats: dict[str, LossSums], adapters: Sequence[str], out: Any) -> None:
    """Add each sample's policy-loss terms (`policy_loss_terms`' output, row i of adapter
    `adapters[i]`) to its adapter's sums."""
    clipped_B = out.pg_clipfrac_B * out.tokens_B
    rows = zip(adapters, out.loss_B.tolist(), clipped_B.tolist(), out.tokens_B.tolist(),
               out.kl_loss_B.tolist(), out.tis_B.tolist())
    for adapter, loss, clipped, tokens, kl, tis in rows:
        s = stats.setdefault(adapter, LossSums())
        s.loss_sum += loss
        s.samples += 1
        s.clipped_tokens += clipped
        s.tokens += tokens
        s.kl_sum += kl
        s.tis_sum += tis


class BatchTrainer:
    """Train calls and scorings of the loaded adapters, cut into micro-batches."""

    def __init__(self, adapters: SlotAdapters, take_back: TakeBack,
                 activation_budget: ActivationBudget | None = None) -> None:
        self.adapters = adapters
        self.take_back = take_back
        self.config = adapters.config
        self.model = adapters.model
        self.device = torch.device(self.config.device)
        self.activation_budget = activation_budget
        """Where no micro-batch size is given, micro-batches sized by estimated activation
        memory (the torch backend on CPU); None: the whole batch."""

    def train_batch(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int],
        client: Sequence[ClientWork] = (),
    ) -> RankTrainResult:
        """Forward and backward this rank's samples and client datums (gradients accumulate
        per slot); the loss sums and datum outputs of the rank that reports for its replica,
        none from the others.

        `advantages[i]` is sample i's advantage: one value, or one per response token
        (the reinforce++ estimators).

        `samples_per_adapter` counts each adapter's samples in the whole (all-rank)
        batch; it advances the adapters' LR clocks identically on every rank.

        `client` datums with a backward train in the samples' micro-batches, with their
        work's Tinker loss; those of a `forward` (`backward=False`) run without grad and
        touch no slot. A call that fails takes back every gradient it added, client ones too.
        """
        for sample in samples:
            loaded = self.adapters.loaded(sample.adapter)
            if sample.slot != loaded.spec.slot:
                raise ValueError(f"sample of adapter '{sample.adapter}' names slot {sample.slot}, "
                                 f"but the adapter is in slot {loaded.spec.slot}")
        for name in samples_per_adapter:
            self.adapters.loaded(name)
        rows = self._client_rows(client)
        trained = [r for r in rows if r.backward]
        stats: dict[str, LossSums] = {}
        outputs: dict[tuple[int, int], DatumOutput] = {}
        loss_settings = self.adapters.loss_settings
        need_rollout = any(loss_settings(name).needs_rollout_logprobs for name in {s.adapter for s in samples})
        batches = self.micro_batches(samples, advantages, need_rollout_logprobs=need_rollout,
                                     max_tokens=self.budget_tokens(samples, trained), client=trained)
        scored = [r for r in rows if not r.backward]
        forwards = self.micro_batches([], [], max_tokens=self.budget_tokens([], scored), client=scored)
        self.take_back.remember({s.adapter for s in samples} | set(samples_per_adapter)
                                | {r.adapter for r in trained})
        try:
            for batch in batches:
                if batch.client is None:
                    self.train_micro_batch(batch.to(self.device), stats)
                else:
                    self.train_mixed_micro_batch(batch.to(self.device), stats, outputs)
            for batch in forwards:
                self.forward_client(batch.to(self.device), outputs)
            for name, n in samples_per_adapter.items():
                self.adapters.by_name[name].schedule.add_samples(n)
        except BaseException:
            self.take_back.discard()
            raise
        if not self.model.reports_loss:
            return RankTrainResult(stats={})
        by_work = [[outputs[(w, d)] for d in range(len(work.datums))] for w, work in enumerate(client)]
        return RankTrainResult(stats=stats, client=by_work)

    def _client_rows(self, client: Sequence[ClientWork]) -> list[ClientRow]:
        """The client datums as validated rows; every work's adapter loaded in its slot."""
        for work in client:
            loaded = self.adapters.loaded(work.adapter)
            if work.slot != loaded.spec.slot:
                raise ValueError(f"client work of adapter '{work.adapter}' names slot {work.slot}, "
                                 f"but the adapter is in slot {loaded.spec.slot}")
        return client_rows(client, self.model.vocab_size)

    def micro_batches(self, samples: Sequence[Sample], advantages: Sequence[Advantage], *,
                      need_rollout_logprobs: bool = False, max_tokens: int | None = None,
                      client: Sequence[ClientRow] = ()) -> list[MicroBatch]:
        return make_micro_batches(samples, advantages, self.config.micro_batch_size,
                                  max_tokens=self.config.max_tokens_per_micro_batch or max_tokens,
                                  need_rollout_logprobs=need_rollout_logprobs, client=client)

    def budget_tokens(self, samples: Sequence[Sample], client: Sequence[ClientRow] = ()) -> int | None:
        """Tokens per training micro-batch under the activation budget, where no micro-batch
        size was given; None: the whole batch."""
        budget = self.activation_budget
        if budget is None or self.config.micro_batch_size or self.config.max_tokens_per_micro_batch:
            return None
        tokens = budget.max_tokens(samples, [r.length for r in client])
        if tokens is not None and not budget.announced:
            budget.announced = True
            logger.info(
                "Training in micro-batches of up to %d tokens: about %.0f KiB a token stays for the backward, "
                "and --activation-budget-mb is %g (--micro-batch-size sets the split instead)",
                tokens, budget.bytes_per_token / 1024, budget.budget_bytes / 2**20)
        return tokens

    def train_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums]) -> None:
        """Forward and backward of one micro-batch, each sample's loss with its adapter's
        settings (`LossParams`), so a mixed batch gives every adapter the gradient it would
        get alone; adds to each adapter's `stats`."""
        settings = [self.adapters.loss_settings(name) for name in batch.adapters]
        params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
        ref = None
        if any(s.use_kl_loss for s in settings):
            with torch.no_grad():
                ref = self.model.forward_logprobs(batch, [-1] * len(batch.slots))
        entropy = None
        if any(s.entropy_coef != 0 for s in settings):
            logprobs, entropy = self.model.forward_logprobs(batch, batch.slots, entropy=True)
        else:
            logprobs = self.model.forward_logprobs(batch, batch.slots)
        rollout = batch.rollout_logprobs_BT if any(s.needs_rollout_logprobs for s in settings) else None
        out = policy_loss_terms(
            logprobs, logprobs.detach(), batch.advantages_BT, batch.loss_mask_BT, params,
            rollout_logprobs_BT=rollout, ref_logprobs_BT=ref, entropy_BT=entropy, tis_args=self.config,
        )
        out.loss_B.sum().backward()
        _add_stats(stats, batch.adapters, out)

    def train_mixed_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums],
                                outputs: dict[tuple[int, int], DatumOutput]) -> None:
        """`train_micro_batch` of a micro-batch with client rows: one forward scoring every
        row's targets, the samples' policy loss on rows ..n and each datum's Tinker loss after
        them, one backward; puts each datum's output in `outputs` by (work, datum)."""
        assert batch.client is not None
        n, part = batch.n_samples, batch.client
        targets_BL = batch.target_tokens_BL()
        settings = [self.adapters.loss_settings(name) for name in batch.adapters[:n]]
        ref = None
        if any(s.use_kl_loss for s in settings):
            with torch.no_grad():
                ref = self.model.forward_logprobs(batch, [-1] * len(batch.slots), targets_BL=targets_BL)[:n, :-1]
        entropy = None
        if any(s.entropy_coef != 0 for s in settings):
            logprobs_BL, entropy_BL = self.model.forward_logprobs(batch, batch.slots, entropy=True,
                                                                  targets_BL=targets_BL)
            entropy = entropy_BL[:n, :-1]
        else:
            logprobs_BL = self.model.forward_logprobs(batch, batch.slots, targets_BL=targets_BL)
        terms = client_loss_terms(logprobs_BL[part.start :], part.inputs)
        total = terms.loss_C.sum()
        if n:
            params = LossParams.gather(settings, list(range(n))).to(self.device)
            logprobs = logprobs_BL[:n, :-1]
            rollout = batch.rollout_logprobs_BT[:n] if any(s.needs_rollout_logprobs for s in settings) else None
            out = policy_loss_terms(
                logprobs, logprobs.detach(), batch.advantages_BT[:n], batch.loss_mask_BT[:n], params,
                rollout_logprobs_BT=rollout, ref_logprobs_BT=ref, entropy_BT=entropy, tis_args=self.config,
            )
            total = total + out.loss_B.sum()
            _add_stats(stats, batch.adapters[:n], out)
        total.backward()
        for row, output in zip(part.rows, datum_outputs(part.rows, logprobs_BL[part.start :], terms)):
            outputs[(row.work, row.datum)] = output

    @torch.no_grad()
    def forward_client(self, batch: MicroBatch, outputs: dict[tuple[int, int], DatumOutput]) -> None:
        """A micro-batch of client rows only, without grad (`forward`): their logprobs and losses."""
        assert batch.client is not None and batch.n_samples == 0
        logprobs_CL = self.model.forward_logprobs(batch, batch.slots, targets_BL=batch.target_tokens_BL())
        terms = client_loss_terms(logprobs_CL, batch.client.inputs)
        for row, output in zip(batch.client.rows, datum_outputs(batch.client.rows, logprobs_CL, terms)):
            outputs[(row.work, row.datum)] = output

    @torch.no_grad()
    def reward_kl(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's per-response-token KL of its adapter's policy to the base model
        (slot off), with its adapter's `--kl-loss-type`: the KL that `--kl-coef` subtracts
        from the reinforce++ token rewards. As in Miles the policy's logprobs are the
        engine's with `--use-rollout-logprobs`, else the trainer's before this step's update."""
        out: list[list[float]] = [[] for _ in samples]
        settings_by_adapter = {s.adapter: self.adapters.loss_settings(s.adapter) for s in samples}
        need_rollout = any(s.use_rollout_logprobs for s in settings_by_adapter.values())
        for batch in self.micro_batches(samples, [0.0] * len(samples), need_rollout_logprobs=need_rollout):
            batch = batch.to(self.device)
            settings = [settings_by_adapter[name] for name in batch.adapters]
            params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
            policy = self.model.forward_logprobs(batch, batch.slots).float()
            policy = torch.where(params.use_rollout_logprobs_B.view(-1, 1), batch.rollout_logprobs_BT, policy)
            base = self.model.forward_logprobs(batch, [-1] * len(batch.slots)).float()
            kl = approx_kl_per_sample(policy, base, params.kl_type_B)
            for index, values in zip(batch.indices, response_logprobs(kl, batch)):
                out[index] = values
        return out

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's response-token logprobs under its slot (in the given order)."""
        out: list[list[float]] = [[] for _ in samples]
        for batch in self.micro_batches(samples, [0.0] * len(samples)):
            batch = batch.to(self.device)
            logprobs_BT = self.model.forward_logprobs(batch, batch.slots)
            for index, values in zip(batch.indices, response_logprobs(logprobs_BT, batch)):
                out[index] = values
        return out
