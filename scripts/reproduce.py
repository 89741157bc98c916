"""Reproduce a seed paper's headline result: its sweeps through ``fedrun -m``, then ``fedrun-report``.

One command per paper (``python scripts/reproduce.py 000``); docs/results/ says what each one measures
and what it found. Each part of a paper is one ``fedrun -m`` sweep in its own dir under
``--out/<paper>/<part>``; run the same command again after an interruption and every part resumes
(``resume=<dir>``: finished jobs are skipped, stopped ones continue from their checkpoints). All runs of a
paper go to one MLflow experiment, ``reproduce_<paper>`` (tuning sweeps to ``reproduce_<paper>_tuning``, sensitivity
checks to ``reproduce_<paper>_check``, each with its own report),
in ``--out/mlflow.db``; the report goes to ``--out/<paper>/report``.

Paper 000's temperature is not chosen by hand: its ``temperature`` part sweeps T on the very non-IID
split and the T with the smallest median R90 (then the highest final accuracy) is used for the table.

Usage:
    python scripts/reproduce.py 000 [--seeds 5] [--out outputs/reproduce] [--dry-run]
    python scripts/reproduce.py all
    python scripts/reproduce.py 000 --parts fedavg_iid fedsoftmax_iid   # some parts only (and the T sweep they need)
    python scripts/reproduce.py 002 --tiny     # one seed, two rounds, first value of each list: checks the commands
    python scripts/reproduce.py 004 --set device.threads=1   # overrides added to every run
"""

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Part:
    """One ``fedrun -m`` sweep; ``{seeds}`` and ``{temperature}`` in the arguments are filled in when run."""

    name: str
    args: tuple[str, ...]
    paired: str | None = None  # its side report's --paired baseline, when not the paper's (``Paper.paired``)
    side: str = (
        ""  # "tuning" (a sweep that picks a setting), "check" (a sensitivity check) or "full" (the table's runs
        # without their stop): its own experiment and report
    )

    @property
    def tuning(self) -> bool:
        return self.side == "tuning"


@dataclass(frozen=True)
class View:
    """The table's report on some runs (``report_<name>``): its ``--filter``, and its own ``--group-by``, ``--paired``
    baseline and further arguments where they are not the table's (one study, two comparisons: compression against
    dense updates, selection against uniform)."""

    name: str
    where: str
    group_by: tuple[str, ...] = ()
    paired: str | None = None
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Paper:
    title: str
    parts: tuple[Part, ...]
    report_by: tuple[str, ...] = field(default_factory=tuple)  # --group-by of the table (default: what varies)
    report_extra: tuple[str, ...] = field(default_factory=tuple)  # further fedrun-report arguments (--metrics, --plot)
    paired: str = "aggregator=fedavg"  # fedrun-report --paired of the table and of sensitivity checks: the baseline
    views: tuple[View, ...] = field(default_factory=tuple)  # the table's report on some runs (report_<name>)
    select_by: str = (
        "R90"  # the R-index whose censored median picks the temperature (client_R90: the clients' accuracy)
    )


TNIID_NIID = (
    "partition=shards",
    "partition.shards_per_client=2,4",
    "partition.shard_source=dataset",
)  # very non-IID, non-IID
TNIID_POOL = (
    "partition=shards",
    "partition.shards_per_client=2",
    "partition.shard_source=pool",
)  # very non-IID, balanced pool
TNIID = ("partition=shards", "partition.shards_per_client=2", "partition.shard_source=dataset")
SOFTMAX = ("aggregator=fedsoftmax", "aggregator.temperature={temperature}")
SHARDS_OF_30 = ("partition.shards_per_client=20",)  # paper 001's code: shards of 30 (a preset sets no shards key)
STOP_AT_R60 = (
    "schedule.stop_at_accuracy=0.6",
    "schedule.stop_on=test",
    "schedule.rounds=30",
)  # paper 001's R60 (global model), censored at 30
HEAD_000 = ("schedule.lr_decay=1.0",)  # the authors' last commit (c065b72, train.py:128-131): a constant lr for MNIST
AUTHORS_SPLITS = ("partition=label_pairs,label_triples",)  # paper 000's code: TNIID, NIID (src/datasplitting.py:52-75)
FULL_50 = ("partition=label_pairs", "schedule.stop_at_accuracy=null")  # TNIID, all of the preset's 50 rounds
AUTHORS_IID = (
    "partition=iid",
    "partition.samples_per_client=null",
)  # its split_dataset_iid: the whole set, 1,200 a client
PAPERS = {
    # The parts run in this order, the table's core first: FedAvg against FedSoftMax on TNIID/NIID and IID, and on
    # TNIID from the other shard source (a balanced pool); then a learning-rate check; then FedMax(k) and annealing.
    "000": Paper(
        "Loss-weighted aggregation (FedMax, FedSoftMax): R80/R90 on MNIST, Table 3",
        (
            # T in 0.1-10: the paper's 5-30 (an inverse temperature on a loss summed over batches, line 372; docs/explanation/aggregators.md) is
            # T = 1.7-10 on fedrun's mean loss; 0.1 and 0.3 lean towards FedMax.
            Part(
                "temperature",
                (
                    "experiment=softmax_mnist",
                    "aggregator=fedsoftmax",
                    "aggregator.temperature=0.1,0.3,1,3,10",
                    "seed=100,101",
                ),
                side="tuning",
            ),
            Part("fedavg_shards", ("experiment=softmax_mnist", "aggregator=fedavg", *TNIID_NIID, "seed={seeds}")),
            Part("fedsoftmax_shards", ("experiment=softmax_mnist", *SOFTMAX, *TNIID_NIID, "seed={seeds}")),
            Part("fedavg_iid", ("experiment=softmax_mnist", "aggregator=fedavg", "partition=iid", "seed={seeds}")),
            Part("fedsoftmax_iid", ("experiment=softmax_mnist", *SOFTMAX, "partition=iid", "seed={seeds}")),
            Part("fedavg_pool", ("experiment=softmax_mnist", "aggregator=fedavg", *TNIID_POOL, "seed={seeds}")),
            Part("fedsoftmax_pool", ("experiment=softmax_mnist", *SOFTMAX, *TNIID_POOL, "seed={seeds}")),
            # The paper's lr (1e-4) belongs to its own setup: the TNIID comparison again at lr 0.1, 3 seeds.
            Part(
                "lr_fedavg",
                ("experiment=softmax_mnist", "aggregator=fedavg", *TNIID, "optimizer.lr=0.1", "seed=0,1,2"),
                side="check",
            ),
            Part(
                "lr_fedsoftmax",
                ("experiment=softmax_mnist", *SOFTMAX, *TNIID, "optimizer.lr=0.1", "seed=0,1,2"),
                side="check",
            ),
            Part("fedmaxk_tniid", ("experiment=softmax_mnist", "aggregator=fedmaxk", *TNIID, "seed={seeds}")),
            Part(
                "fedsoftmax_annealed_tniid",
                (
                    "experiment=softmax_mnist",
                    *SOFTMAX,
                    "aggregator.anneal=exponential",
                    "aggregator.temperature_final=10",
                    "aggregator.anneal_rounds=20",
                    *TNIID,
                    "seed={seeds}",
                ),
            ),
        ),
        views=(
            View("tniid", "params.`partition.shards_per_client` = '2' and params.`partition.shard_source` = 'dataset'"),
        ),
    ),
    # Paper 000 on its authors' protocol (experiment=softmax_mnist_authors: raw pixels, lr 1e-4 * 0.99^r, their splits, their
    # loss scale, the clients' held-out accuracy). FedAvg first, so that the protocol is calibrated on FedAvg alone, with each
    # setting where paper and code disagree: E = 1 (the code at the paper's commit) and E = 2 (Table 2), on their label pairs
    # (TNIID) and triples (NIID) and on their IID split (1,200 a client); the last commit's constant lr (E = 1); McMahan's
    # shards, which the paper describes. Then T on separate seeds over the paper's range, and FedSoftMax.
    "000a": Paper(
        "Paper 000 on its authors' protocol: FedAvg calibrated against Table 3, then FedSoftMax",
        (
            Part(
                "fedavg_splits",
                (
                    "experiment=softmax_mnist_authors",
                    "aggregator=fedavg",
                    *AUTHORS_SPLITS,
                    "schedule.local_epochs=1,2",
                    "seed={seeds}",
                ),
            ),
            Part(
                "fedavg_iid",
                (
                    "experiment=softmax_mnist_authors",
                    "aggregator=fedavg",
                    *AUTHORS_IID,
                    "schedule.local_epochs=1,2",
                    "seed={seeds}",
                ),
            ),
            Part(
                "fedavg_head_splits",
                ("experiment=softmax_mnist_authors", "aggregator=fedavg", *AUTHORS_SPLITS, *HEAD_000, "seed={seeds}"),
            ),
            Part(
                "fedavg_shards", ("experiment=softmax_mnist_authors", "aggregator=fedavg", *TNIID_NIID, "seed={seeds}")
            ),
            # T = 1 / T_paper for T_paper = 5, 10, 20, 30: the paper's range (line 372) and the code's exppanel sweep.
            Part(
                "temperature",
                (
                    "experiment=softmax_mnist_authors",
                    "aggregator=fedsoftmax",
                    "aggregator.temperature=0.2,0.1,0.05,0.0333",
                    "seed=100,101",
                ),
                side="tuning",
            ),
            Part("fedsoftmax_splits", ("experiment=softmax_mnist_authors", *SOFTMAX, *AUTHORS_SPLITS, "seed={seeds}")),
            Part("fedsoftmax_iid", ("experiment=softmax_mnist_authors", *SOFTMAX, *AUTHORS_IID, "seed={seeds}")),
            # TNIID again without the stop at the clients' 90%: all 50 rounds of Table 2, so that the global model's test
            # accuracy of the two is compared at the same rounds (the table's runs stop at different ones).
            Part(
                "fedavg_tniid_50",
                ("experiment=softmax_mnist_authors", "aggregator=fedavg", *FULL_50, "seed={seeds}"),
                side="full",
            ),
            Part(
                "fedsoftmax_tniid_50",
                ("experiment=softmax_mnist_authors", *SOFTMAX, *FULL_50, "seed={seeds}"),
                side="full",
            ),
        ),
        report_extra=("--plot", "client_accuracy"),
        select_by="client_R90",
        views=(View("tniid", "tags.partition = 'label_pairs' and params.`schedule.local_epochs` = '1'"),),
    ),
    # Paper 001 on its authors' protocol (experiment=hybrid_fmnist_authors: the February 2023 code, raw pixels, the ConvNet's
    # softmax over the batch, a loss summed over the batch at lr 1e-3 = fedrun's mean loss at 0.064, shards of 30 dealt at random, the global
    # model's test accuracy). FedAvg is calibrated against the paper's R60 first. Runs stop once test accuracy reaches 60%
    # (R60 is the table's measure, lines 277, 292-306) or after 30 rounds; the hybrid equals FedSoftBetter until its switch at
    # round 20 and runs 30 rounds.
    "001a": Paper(
        "Paper 001 on its authors' protocol: FedAvg calibrated against its R60, then FedSoftWorse, FedSoftBetter and the hybrid",
        (
            Part("fedavg", ("experiment=hybrid_fmnist_authors", "aggregator=fedavg", *STOP_AT_R60, "seed={seeds}")),
            # McMahan's equal dealing (20 shards of 30 to every client) in place of their random one: does it move FedAvg's R60?
            Part(
                "fedavg_equal_shards",
                (
                    "experiment=hybrid_fmnist_authors",
                    "aggregator=fedavg",
                    "partition=shards",
                    *SHARDS_OF_30,
                    *STOP_AT_R60,
                    "seed={seeds}",
                ),
            ),
            Part(
                "fedsoftworse",
                ("experiment=hybrid_fmnist_authors", "aggregator=fedsoftmax", *STOP_AT_R60, "seed={seeds}"),
            ),
            Part(
                "fedsoftbetter",
                ("experiment=hybrid_fmnist_authors", "aggregator=fedsoftbetter", *STOP_AT_R60, "seed={seeds}"),
            ),
            Part(
                "hybrid",
                ("experiment=hybrid_fmnist_authors", "aggregator=hybrid", "schedule.rounds=30", "seed={seeds}"),
            ),
        ),
    ),
    "001": Paper(
        "FedSoftBetter and the hybrid FedSoftBetterAvg: Fashion-MNIST non-IID R60 and stability",
        (
            # T = 0.2 and the switch at round 20: the caption of the paper's Figure 1 (paper 001, line 297). 30 rounds, not
            # the paper's 100-150 (line 273): R60 falls in the first ten, and ten rounds follow the hybrid's switch.
            Part("fedavg", ("experiment=hybrid_fmnist", "aggregator=fedavg", "schedule.rounds=30", "seed={seeds}")),
            # p_i exp(-F_i / 0.2) on the mean loss: FedSoftWorse's formula (line 239) with the sign flipped, the "analogous
            # modification" of line 249 read literally. It collapses onto the best clients.
            Part(
                "fedsoftbetter",
                (
                    "experiment=hybrid_fmnist",
                    "aggregator=fedsoftbetter",
                    "aggregator.temperature=0.2",
                    "schedule.rounds=30",
                    "seed={seeds}",
                ),
            ),
            # T = 0.2 on the authors' loss scale (their code's l_i, about the mean loss / 50, on the last local epoch; docs/explanation/aggregators.md):
            # exp(-l_i / 0.2), about exp(-mean loss / 10).
            Part(
                "fedsoftbetter_authors",
                (
                    "experiment=hybrid_fmnist",
                    "aggregator=fedsoftbetter",
                    "aggregator.temperature=0.2",
                    "aggregator.loss_scale=authors",
                    "aggregator.loss_on=local",
                    "schedule.rounds=30",
                    "seed={seeds}",
                ),
            ),
            Part(
                "hybrid_authors",
                (
                    "experiment=hybrid_fmnist",
                    "aggregator=hybrid",
                    "aggregator.phases.0.aggregator.temperature=0.2",
                    "aggregator.phases.0.aggregator.loss_scale=authors",
                    "aggregator.phases.0.aggregator.loss_on=local",
                    "schedule.rounds=30",
                    "seed={seeds}",
                ),
            ),
            # Sensitivity check: T = 1-10 on the global model's mean loss, between the printed reading (it collapses at 0.2)
            # and the authors' scale (about T = 10 on the last local epoch's loss), 3 seeds, against FedAvg on the same seeds.
            Part(
                "temperature_fedavg",
                ("experiment=hybrid_fmnist", "aggregator=fedavg", "schedule.rounds=30", "seed=0,1,2"),
                side="check",
            ),
            Part(
                "temperature_fedsoftbetter",
                (
                    "experiment=hybrid_fmnist",
                    "aggregator=fedsoftbetter",
                    "aggregator.temperature=1,3,10",
                    "schedule.rounds=30",
                    "seed=0,1,2",
                ),
                side="check",
            ),
        ),
    ),
    "002": Paper(
        "STORM-style variance reduction against FedAvg, FedProx and FedNova on Dirichlet(0.5) MNIST",
        (
            Part("baselines", ("experiment=vr_mnist", "method=fedavg,fedprox,fednova", "seed={seeds}")),
            Part(
                "storm_vr",
                ("experiment=vr_mnist", "method=storm_vr", "optimizer.k0=0.15", "aggregator.beta=0.9", "seed={seeds}"),
            ),
            Part(
                "storm_vr_constants",
                (
                    "experiment=vr_mnist",
                    "method=storm_vr",
                    "optimizer.k0=0.05,0.1,0.15,0.2",
                    "aggregator.beta=0.5,0.9",
                    "seed=0",
                ),
                side="tuning",
            ),
            # Sensitivity check: a longer budget (100 rounds, 3 seeds), to see whether the paper's gap opens late.
            Part(
                "long_fedavg",
                ("experiment=vr_mnist", "method=fedavg", "schedule.rounds=100", "seed=0,1,2"),
                side="check",
            ),
            Part(
                "long_storm_vr",
                (
                    "experiment=vr_mnist",
                    "method=storm_vr",
                    "optimizer.k0=0.15",
                    "aggregator.beta=0.9",
                    "schedule.rounds=100",
                    "seed=0,1,2",
                ),
                side="check",
            ),
        ),
        report_by=("method",),
        paired="method=fedavg",
    ),
    "004": Paper(
        "FedStaleWeight against FedBuff with slow clients owning labels 0-3 (Fashion-MNIST)",
        (
            # 2,000 aggregations evaluated every 50, half the paper's 4,000 (it fits the CPU budget; schedule.rounds=4000 for all).
            Part(
                "table",
                (
                    "experiment=stale_fmnist",
                    "aggregator=fedbuff,fedstaleweight",
                    "schedule.rounds=2000",
                    "schedule.eval_every=50",
                    "schedule.tail=250",  # judged on its last 5 evaluations (1800-2000), as the preset's 125 of 500
                    "seed={seeds}",
                ),
            ),
        ),
        report_extra=(
            "--metrics",
            "tail_accuracy/slow",
            "tail_accuracy/slow_swing",
            "tail_accuracy/fast",
            "weight_share/slow",
            "--plot",
            "accuracy/slow",
        ),
        paired="aggregator=fedbuff",
    ),
    # Not a seed paper: the heterogeneity baselines every such paper compares against (docs/results/heterogeneity.md),
    # each client program and FedProx and FedSoftMax beside FedAvg at 10 and 50 local steps on 2-label shards.
    "heterogeneity": Paper(
        "Client drift: FedAvg, FedProx, SCAFFOLD, FedDyn, MOON and FedSoftMax on 2-label shards of MNIST",
        tuple(
            Part(name, ("experiment=heterogeneity_mnist", *args, "schedule.local_steps=10,50", "seed={seeds}"))
            for name, args in (
                ("fedavg", ()),
                ("fedprox", ("optimizer=prox", "optimizer.lr=0.05", "optimizer.mu=0.01")),
                ("scaffold", ("client=scaffold",)),
                ("feddyn", ("client=feddyn", "client.alpha=0.01")),
                ("moon", ("client=moon", "client.mu=1.0")),
                ("fedsoftmax", ("aggregator=fedsoftmax",)),
            )
        ),
        report_by=("client", "aggregator", "optimizer", "schedule.local_steps"),
        paired="client=sgd",  # each program against FedAvg (same aggregator, solver, steps and seed)
    ),
    # Not a seed paper: FedSoftMax among its kin (docs/results/fairness.md), the fair-FL objectives that weigh clients by
    # their loss, on q-FFL's synthetic setting and on 2-label shards of Fashion-MNIST. One axis of tilts: FedAvg
    # (t = 0), TERM t = 0.1, FedSoftMax T = 1 and 0.1 (TERM's t = 1 and 10: the same rule, tests/unit/test_fair.py),
    # TERM t = 100, FedMax (t -> infinity); beside it q-FFL (q = 0 is uniform FedAvg, q-FFL's own baseline) and AFL.
    "fairness": Paper(
        "Fairness: FedAvg, q-FFL, AFL, TERM, FedSoftMax and FedMax on q-FFL's synthetic setting and Fashion-MNIST shards",
        tuple(
            Part(name, ("experiment=qffl_synthetic,fairness_fmnist", *args, "seed={seeds}"))
            for name, args in (
                ("fedavg", ("aggregator=fedavg",)),
                ("qffl", ("aggregator=qffl", "aggregator.q=0,1,5")),
                ("afl", ("aggregator=afl",)),
                ("term", ("aggregator=term", "aggregator.t=0.1,100")),
                ("fedsoftmax", ("aggregator=fedsoftmax", "aggregator.temperature=1,0.1")),
                ("fedmax", ("aggregator=fedmax",)),
            )
        )
        + (
            # Sensitivity check: q-FFL's step shrinks with the updates' norms (its h_k), so in 200 rounds it trails
            # uniform FedAvg on synthetic; ten times the budget, to see whether its fairness gain shows later.
            Part(
                "qffl_long",
                (
                    "experiment=qffl_synthetic",
                    "aggregator=qffl",
                    "aggregator.q=0,1",
                    "schedule.rounds=2000",
                    "schedule.tail=200",
                    "seed={seeds}",
                ),
                paired="aggregator.q=0",
                side="check",
            ),
        ),
        report_by=("dataset", "aggregator", "aggregator.q", "aggregator.t", "aggregator.temperature"),
        report_extra=("--fairness",),
        paired="aggregator=fedavg",
    ),
    # docs/results/selection-compression.md: who trains (uniform against Power-of-Choice, under FedAvg and FedSoftMax)
    # and what they send (QSGD, top-k with and without error feedback) on experiment=mnist_100. Dense uniform FedAvg
    # is the baseline of both comparisons and runs once; each view pairs its runs with it by seed.
    "selection": Paper(
        "Client selection and update compression on MNIST across 100 clients (pathological shards)",
        tuple(
            Part(name, ("experiment=mnist_100", *args, "seed={seeds}"))
            for name, args in (
                ("fedavg", ()),
                ("qsgd", ("compression=qsgd",)),
                ("topk", ("compression=topk", "compression.k=0.1,0.01", "compression.error_feedback=true,false")),
                ("fedsoftmax", ("aggregator=fedsoftmax",)),
                ("power_of_choice", ("sampler=power_of_choice", "aggregator=fedavg,fedsoftmax")),
            )
        ),
        report_by=("sampler", "aggregator", "compression", "compression.k", "compression.error_feedback"),
        paired="compression=none",  # no part names it: the whole table is not paired, its views are
        views=(
            View(
                "compression",
                "tags.aggregator = 'fedavg' and tags.sampler = 'uniform'",
                group_by=("compression", "compression.k", "compression.error_feedback"),
                paired="compression=none",
                extra=("--per-mb",),
            ),
            View(
                "selection",
                "tags.compression = 'none'",
                group_by=("sampler", "aggregator"),
                paired="sampler=uniform",
            ),
        ),
    ),
    # docs/results/privacy-utility.md: DP-FedAvg on experiment=dp_mnist (1,000 clients, Poisson q = 0.05, 200 rounds)
    # at epsilon 1-8, fixed against adaptive clipping, and the non-private run under the same sampling; 3 seeds on the
    # page (--seeds 3: 27 runs of 5-9 minutes on one core). Adaptive is paired with fixed by epsilon and seed.
    "privacy": Paper(
        "Privacy and utility: DP-FedAvg on MNIST across 1,000 clients, fixed and adaptive clipping",
        (
            Part("nonprivate", ("experiment=dp_mnist", "privacy=none", "seed={seeds}")),
            Part(
                "private",
                (
                    "experiment=dp_mnist",
                    "privacy.target_epsilon=1,2,4,8",
                    "privacy.adaptive=False,True",
                    "seed={seeds}",
                ),
            ),
        ),
        report_by=("privacy", "privacy.target_epsilon", "privacy.adaptive"),
        report_extra=("--versus", "privacy.target_epsilon", "--plot", "clip_norm"),
        paired="privacy.adaptive=False",
    ),
    # docs/results/personalization.md: PFLlib's Fashion-MNIST leaderboard setting (experiment=pfllib_fmnist) for 8
    # rounds, judged on the last 3 (the personalised curves are flat from round 4 there; a tail of 10 would be the
    # whole run); 3 seeds on the page (--seeds 3: 33 runs, 17-50 s a round).
    "personalization": Paper(
        "Personalised FL on PFLlib's pathological Fashion-MNIST: local, fine-tuning, FedPer, FedRep, Ditto, APFL, FedBN",
        tuple(
            Part(name, ("experiment=pfllib_fmnist", *args, "schedule.rounds=8", "schedule.tail=3", "seed={seeds}"))
            for name, args in (
                ("methods", ("personalization=none,local,finetune,fedper,fedrep,ditto",)),
                ("fedper_fedsoftmax", ("personalization=fedper", "aggregator=fedsoftmax")),
                ("apfl", ("personalization=apfl",)),
                ("batch_norm", ("personalization=fedbn,none", "model.norm=batch")),
                ("fedper_fedmax", ("personalization=fedper", "aggregator=fedmax")),
            )
        ),
        report_by=("personalization", "aggregator", "model.norm"),
        report_extra=("--personal",),
        paired="personalization=none",
    ),
    # issue 54's results page (docs/results/devices.md, to come): synchronous FedAvg waiting for its slowest device,
    # FedAvg over-selecting 13 for the first 10 reports (Bonawitz et al.), and FedBuff and FedStaleWeight keeping 10
    # clients training, on FedScale's log-normal devices: the virtual seconds to 60% and 70% (R60_time, R70_time).
    "devices": Paper(
        "FedAvg, FedAvg over-selecting, FedBuff and FedStaleWeight on devices (Fashion-MNIST shards, 100 clients)",
        (
            Part("fedavg", ("experiment=devices_fmnist", "seed={seeds}")),
            Part(
                "overselect", ("experiment=devices_fmnist", "schedule.cohort=13", "devices.reports=10", "seed={seeds}")
            ),
            Part(
                "buffered",
                (
                    "experiment=devices_fmnist",
                    "aggregator=fedbuff,fedstaleweight",
                    # ++: Hydra checks a sweep's other overrides against its defaults (aggregator=fedavg, engine=sync),
                    # which have neither key; the swept options both have them
                    "++engine.concurrency=10",
                    "++aggregator.buffer_size=10",
                    "seed={seeds}",
                ),
            ),
        ),
        report_by=("aggregator", "schedule.cohort", "devices.reports"),
        report_extra=("--per-time",),
        paired="aggregator=fedavg",
    ),
}
TINY = ("schedule.rounds=2", "schedule.stop_at_accuracy=null")


def first_values(args: tuple[str, ...]) -> list[str]:
    """Each ``key=a,b,c`` as ``key=a`` (a list value in brackets is left whole)."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        out.append(f"{key}={value.split(',')[0]}" if sep and not value.startswith("[") else arg)
    return out


def command(
    paper: str, part: Part, out: Path, seeds: int, temperature: str, tiny: bool, extra: tuple[str, ...] = ()
) -> list[str]:
    values = {"seeds": ",".join(str(s) for s in range(seeds)), "temperature": temperature}
    args = [a.format(**values) for a in part.args] + list(extra)
    if tiny:  # TINY's keys replace the part's own (schedule.rounds=30 becomes 2)
        replaced = {t.partition("=")[0] for t in TINY}
        args = [a for a in first_values(tuple(args)) if a.partition("=")[0] not in replaced] + list(TINY)
    sweep_dir = out / paper / part.name
    experiment = f"reproduce_{paper}" + (f"_{part.side}" if part.side else "")
    cmd = [
        str(BIN / "fedrun"),
        "-m",
        *args,
        f"tracking.uri=sqlite:///{(out / 'mlflow.db').resolve()}",
        f"tracking.experiment={experiment}",
    ]
    if started(out, paper, part):  # resume it (finished jobs are skipped)
        return cmd + [f"resume={sweep_dir.resolve()}"]
    return cmd + [f"hydra.sweep.dir={sweep_dir.resolve()}"]


def report(
    paper: str, out: Path, side: str = "", group_by: tuple[str, ...] = (), extra: tuple[str, ...] = (), view: str = ""
) -> list[str]:
    experiment = f"reproduce_{paper}" + (f"_{side}" if side else "")
    cmd = [
        str(BIN / "fedrun-report"),
        "--experiment",
        experiment,
        "--tracking-uri",
        f"sqlite:///{(out / 'mlflow.db').resolve()}",
        "--out",
        str(out / paper / ((f"{side}_report" if side else "report") + (f"_{view}" if view else ""))),
    ]
    return cmd + (["--group-by", *group_by] if group_by else []) + list(extra)


def best_temperature(report_csv: Path, select_by: str = "R90") -> str | None:
    """The temperature with the smallest median ``select_by`` R-index (runs that never reached the target count as
    infinitely late), then the highest mean tail accuracy (each run's mean over its last rounds: a temperature whose
    model swings from round to round is not ranked by its last one; the final round's for runs logged before the
    tail); None when the report has one temperature only (no column)."""
    table = pd.read_csv(report_csv)
    if "aggregator.temperature" not in table:
        return None
    accuracy = (
        table["tail_test_accuracy_mean"] if "tail_test_accuracy_mean" in table else table["final_test_accuracy_mean"]
    )
    ranked = table.assign(_final=-accuracy).sort_values([f"{select_by}_median", "_final"])
    return str(ranked["aggregator.temperature"].iloc[0])


def run(cmd: list[str], dry_run: bool) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return
    code = subprocess.run(cmd).returncode
    if code == 1 and "-m" in cmd:  # a job failed (diverged): that is a result; the sweep's other jobs ran
        print(
            "# some jobs of this sweep failed (see the lines above); they are FAILED runs in MLflow, left out of the table",
            flush=True,
        )
    elif code:
        raise SystemExit(f"reproduce: {cmd[0]} exited with {code}")


def selected(spec: Paper, names: list[str] | None) -> list[Part]:
    """The parts named (all when None), in the paper's order; the temperature sweep too where one of them uses
    its choice (a finished sweep resumes at once: its jobs are skipped)."""
    if names is None:
        return list(spec.parts)
    known = [p.name for p in spec.parts]
    for name in names:
        if name not in known:
            raise SystemExit(f"reproduce: --parts {name!r} is not a part of this paper (its parts: {', '.join(known)})")
    needs_t = any("{temperature}" in a for p in spec.parts if p.name in names for a in p.args)
    return [p for p in spec.parts if p.name in names or (needs_t and p.name == "temperature")]


def reproduce(
    paper: str,
    out: Path,
    seeds: int,
    tiny: bool,
    dry_run: bool,
    parts: list[str] | None = None,
    extra: tuple[str, ...] = (),
) -> None:
    spec = PAPERS[paper]
    print(f"# {paper}: {spec.title}", flush=True)
    temperature = "1.0"
    chosen = selected(spec, parts)
    for part in chosen:
        run(command(paper, part, out, seeds, temperature, tiny, extra), dry_run)
        if part.tuning:
            run(report(paper, out, part.side), dry_run)
            if part.name == "temperature" and not dry_run:
                tried = next(a for a in part.args if a.startswith("aggregator.temperature=")).split("=")[1].split(",")
                temperature = best_temperature(out / paper / "tuning_report" / "report.csv", spec.select_by) or tried[0]
                print(
                    f"# temperature chosen by the sweep (smallest median {spec.select_by}): {temperature}", flush=True
                )
                (out / paper / "temperature.txt").write_text(temperature + "\n")
    # A sensitivity check's report, once its parts have run; paired with the baseline when all of them ran.
    for side in dict.fromkeys(p.side for p in chosen if p.side and not p.tuning):
        whole = all(p in chosen for p in spec.parts if p.side == side)
        against = next((p.paired for p in spec.parts if p.side == side and p.paired), spec.paired)
        run(report(paper, out, side, extra=spec.report_extra + (("--paired", against) if whole else ())), dry_run)
    # The table is paired with the baseline once the baseline's part has run (now or before).
    baseline = any(p in chosen or started(out, paper, p) for p in spec.parts if has_baseline(p, spec.paired))
    paired = ("--paired", spec.paired) if baseline else ()
    table = spec.report_extra + paired
    if any(p in chosen or started(out, paper, p) for p in spec.parts if not p.side):  # else no table run exists yet
        run(report(paper, out, group_by=spec.report_by, extra=table), dry_run)
    # The views (e.g. 000's very non-IID split alone: a plot with four lines, not ten) once every table part has run.
    table_ran = all(p in chosen or started(out, paper, p) for p in spec.parts if not p.side)
    for view in spec.views if table_ran else ():
        run(view_report(paper, out, view, paired), dry_run)


def view_report(paper: str, out: Path, view: View, paired: tuple[str, ...] = ()) -> list[str]:
    """The report of the runs ``view`` selects, paired as the view says or as the table (``paired``)."""
    spec = PAPERS[paper]
    against = ("--paired", view.paired) if view.paired else paired
    extra = spec.report_extra + view.extra + against + ("--filter", view.where)
    return report(paper, out, group_by=view.group_by or spec.report_by, extra=extra, view=view.name)


def started(out: Path, paper: str, part: Part) -> bool:
    """Whether the part's sweep was started by an earlier call (Hydra wrote its multirun.yaml)."""
    return (out / paper / part.name / "multirun.yaml").is_file()


def has_baseline(part: Part, paired: str) -> bool:
    """Whether a table part (not a tuning sweep or check) runs the baseline ``KEY=VALUE`` (as one value of a list too)."""
    key, _, value = paired.partition("=")
    return not part.side and any(
        k == key and value in v.split(",") for k, _, v in (a.partition("=") for a in part.args)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", choices=[*PAPERS, "all"])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per configuration (default: 5)")
    parser.add_argument("--out", type=Path, default=Path("outputs/reproduce"))
    parser.add_argument(
        "--tiny", action="store_true", help="one seed, two rounds, the first value of each list: checks the commands"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        metavar="PART",
        help="only these parts of the paper (default: all; the report covers every run so far)",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overrides added to every run (e.g. device.threads=1 to run beside other work); they are in each run's config",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for paper in PAPERS if args.paper == "all" else [args.paper]:
        reproduce(paper, args.out, 1 if args.tiny else args.seeds, args.tiny, args.dry_run, args.parts, tuple(args.set))


if __name__ == "__main__":
    main()
