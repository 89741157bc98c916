"""Which parts of a run cannot run together: one table of rules over what the parts say they can do.

Each part declares its capabilities as class attributes (or properties, where a setting decides); a rule reads
them, never a class name, so a new class that declares them is accepted or refused as the class it resembles.

Capabilities, by part:

- ``engine.asynchronous``: the engine aggregates buffered updates as they arrive, with no synchronous rounds
  (``engine.concurrency``: how many clients train at once there, or None for all).
- ``aggregator.asynchronous``: a buffered aggregator (``fedrun.aggregators.AsyncAggregator``), which runs only on an
  asynchronous engine; a synchronous one runs only on a synchronous engine.
- ``aggregator.follows_sampler``: it takes the sampler's unbiased weights as its alpha (FedAvg and its subclasses:
  ``RoundView.sampled_weights``).
- ``aggregator.weights_follow_clients``: its alpha, or the scale of its update, follows what the clients measured or
  did (their losses, local steps), not only their sample counts: the loss-weighted family, a hybrid, FedNova.
- ``aggregator.reads_second_update``: it reads a second update per client, trained from the previous global model
  (MVR), which no pipeline stage sees.
- ``aggregator.measures_losses``: its alpha reads a loss measured on the clients' data by the run's backend (TERM's
  tilted risk, ``tau``), not the one they report.
- ``aggregator.weighting``: p_i, ``samples`` or ``uniform`` (a setting; buffered aggregators have none).
- ``sampler.name``: the option's name (in messages only); ``sampler.gives_weights``: it gives each cohort client an
  unbiased weight that replaces the aggregator's (importance sampling); ``sampler.draws_uniformly``: every client is
  equally likely to be drawn, whatever its data or losses (the schedule's own draw).
- ``heterogeneity.equal_work``: every client does the schedule's work; ``heterogeneity.drops_clients``: some clients
  drop out of a round after the draw (stragglers in ``drop`` mode).
- ``pipeline``: true when it has stages; each stage's ``crosses_clients()``: what it does to one update depends on
  other clients' updates (now or through its state); ``stage.clips``: it bounds each update's norm.
- ``client_state.keeps``: it holds something per client between rounds (``fedrun.parts.ClientState``: a
  personal head, a personal model), which only the synchronous engine hands back; ``client_state.personal``: each
  client is served and judged by a model of its own (``fedrun.personal``: fine-tuning keeps nothing but is one).
- ``client.plain``: the client program is plain local SGD (``fedrun.programs.LocalSGD``); ``client.serves``: it has
  a server half updated from each round's cohort (SCAFFOLD, FedDyn); ``client.name``: its option
  name (in messages only); ``client.exchanged()``: the models a client downloads and updates it uploads a round
  (SCAFFOLD's variates make it (2, 2)).
- ``attack``: true when some clients are malicious (``fedrun.attacks.Attack``).
- ``privacy``: true when private; ``privacy.mechanism``: ``central`` or ``local``.
- ``partition.draws_clients_when_they_train``: a population whose clients exist only once drawn, so a round must
  name a count of them (``partition.num_clients``: the population).
- ``schedule``: its fields (``cohort``, ``sampling``, ``clients_per_round``, ``stop_at_accuracy``, ``stop_on``);
  ``dataset``: ``client_test_fraction`` and ``client_tests`` (each client's own held-out samples).

``check(parts)`` raises the first rule that applies, as the one-line ConfigError of ``fedrun.errors``. A rule applies
only to the parts it needs, so ``check`` can run on the parts built so far and again on all of them: the CLI checks
the privacy and the engine before it builds the aggregator (privacy's options set ``aggregator.weighting``, a key
that buffered aggregators lack), then everything.
"""

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fedrun.errors import ConfigError
from fedrun.rounds import STOP_ON

Parts = SimpleNamespace  # the run's parts by group name: parts.aggregator, parts.engine, ...


@dataclass(frozen=True)
class Rule:
    """One combination that cannot run, and its one-line refusal.

    Attributes:
        needs: The parts the rule reads (it is skipped while one of them is not built).
        applies: Whether these parts cannot run together.
        key: The config key the refusal names (or a function of the parts giving it).
        value: The value of that key, a function of the parts.
        allowed: What is allowed, in words (or a function of the parts giving it).
    """

    needs: tuple[str, ...]
    applies: Callable[[Parts], bool]
    key: str | Callable[[Parts], str]
    value: Callable[[Parts], Any]
    allowed: str | Callable[[Parts], str]

    def error(self, parts: Parts) -> ConfigError:
        def given(field):
            return field(parts) if callable(field) else field

        return ConfigError(given(self.key), self.value(parts), given(self.allowed))


def name(part) -> str:
    """A part's class name, for messages (never for conditions)."""
    return type(part).__name__


def private(p: Parts) -> str:
    return f"privacy={p.privacy.mechanism}"


def dropping_key(p: Parts) -> str:
    """The devices' key that drops clients after the draw: its deadline, else its cap on the reports kept, else its
    availability windows (a client offline when its report would arrive is lost)."""
    if p.devices.deadline is not None:
        return "devices.deadline"
    return "devices.reports" if p.devices.reports is not None else "devices.availability"


def dropped_value(p: Parts):
    """The value of ``dropping_key``: the deadline, the cap, or the windows' file."""
    key = dropping_key(p).split(".")[1]
    return p.devices.windows.path if key == "availability" else getattr(p.devices, key)


def drops_after_draw(p: Parts) -> bool:
    """Whether some drawn clients may not report: dropped by the server (deadline, reports) or lost (windows)."""
    return p.devices.drops_clients or p.devices.loses_clients


def crossing_stage(p: Parts) -> int | None:
    """The first stage of the pipeline that crosses clients, or None."""
    return next((i for i, stage in enumerate(p.pipeline.stages) if stage.crosses_clients()), None)


def clipping_stage(p: Parts) -> int | None:
    """The first stage of the pipeline that clips, or None."""
    return next((i for i, stage in enumerate(p.pipeline.stages) if stage.clips), None)


def measuring(p: Parts) -> tuple[str, Any]:
    """The key and value of the aggregator's ``tau``, or of the phase's (a hybrid's, at any depth) that measures the
    clients' losses (TERM's tilted risk); the aggregator's own key where it names no ``tau``."""

    def find(aggregator, key: str) -> tuple[str, Any] | None:
        phases = [agg for agg, _, _ in getattr(aggregator, "phases", ())]
        for i, agg in enumerate(phases):
            if agg.measures_losses:
                return find(agg, f"{key}.phases[{i}].aggregator")
        return (f"{key}.tau", aggregator.tau) if hasattr(aggregator, "tau") else None

    return find(p.aggregator, "aggregator") or ("aggregator", name(p.aggregator))


def synchronous(p: Parts) -> bool:
    return not p.engine.asynchronous


def population_count(p: Parts) -> str:
    """What ``schedule.cohort`` may be with a population, saying what the fraction would train."""
    n = p.partition.num_clients
    allowed = f"an integer from 1 to {n:,} with partition=population (clients a round as a count"
    if p.schedule.cohort is None:
        allowed += f"; clients_per_round={p.schedule.clients_per_round} trains {p.schedule.cohort_size(n):,} clients"
        allowed += " every round"
    return allowed + ")"


RULES = [
    # Privacy and the engine first: this rule runs before the aggregator is built (see the module docstring).
    Rule(
        ("privacy", "engine"),
        lambda p: bool(p.privacy) and getattr(p.engine, "asynchronous", True),  # an engine that does not say
        "engine",
        lambda p: "async",
        lambda p: (
            f"sync with {private(p)} (asynchronous privacy is not accounted; an asynchronous aggregator runs on "
            "engine=async)"
        ),
    ),
    # The synchronous engine.
    Rule(
        ("engine", "aggregator"),
        lambda p: synchronous(p) and p.aggregator.asynchronous,
        "engine",
        lambda p: "sync",
        lambda p: f"async for {name(p.aggregator)}, an asynchronous aggregator",
    ),
    Rule(
        ("engine", "sampler", "aggregator"),
        lambda p: synchronous(p) and p.sampler.gives_weights and not p.aggregator.follows_sampler,
        "aggregator",
        lambda p: name(p.aggregator),
        lambda p: (
            f"fedavg with sampler={p.sampler.name} (its weights q_k / (m p_k) make FedAvg's update unbiased; "
            "other aggregators choose their own alpha)"
        ),
    ),
    Rule(
        ("engine", "sampler", "heterogeneity"),
        lambda p: synchronous(p) and p.sampler.gives_weights and p.heterogeneity.drops_clients,
        "heterogeneity.mode",
        lambda p: getattr(p.heterogeneity, "mode", name(p.heterogeneity)),
        lambda p: (
            f"partial with sampler={p.sampler.name} (clients dropping out after the draw would bias its estimate)"
        ),
    ),
    Rule(
        ("engine", "sampler", "devices"),
        lambda p: synchronous(p) and p.sampler.gives_weights and drops_after_draw(p),
        lambda p: dropping_key(p),
        lambda p: dropped_value(p),
        lambda p: f"null with sampler={p.sampler.name} (clients dropped after the draw would bias its estimate)",
    ),
    Rule(
        ("sampler", "devices"),
        lambda p: p.devices.windows is not None and not p.sampler.draws_available,
        "devices.availability",
        lambda p: p.devices.windows.path,
        lambda p: f"null with sampler={p.sampler.name} (it draws from every client; uniform draws among those online)",
    ),
    Rule(
        ("engine", "aggregator", "pipeline"),
        lambda p: synchronous(p) and bool(p.pipeline) and p.aggregator.reads_second_update,
        "pipeline",
        lambda p: [name(stage) for stage in p.pipeline.stages],
        "none with aggregator=mvr (its second update per client, from the previous model, would bypass the stages)",
    ),
    # A client state that keeps something per client: its starts and views are the synchronous round's.
    Rule(
        ("engine", "client_state"),
        lambda p: p.engine.asynchronous and (p.client_state.keeps or p.client_state.personal),
        "engine",
        lambda p: "async",
        lambda p: (
            f"sync with a client state that keeps per-client state or serves each client its own model "
            f"({name(p.client_state)}: the asynchronous engine starts each client from the model it pulls, keeps "
            "nothing and judges the global model only)"
        ),
    ),
    # MVR's second update is trained from the previous global model by the trainer itself: a personal method's starts,
    # phases and withheld coordinates would not apply to it, so its correction would move what clients keep.
    Rule(
        ("aggregator", "client_state"),
        lambda p: p.aggregator.reads_second_update and (p.client_state.keeps or p.client_state.personal),
        "aggregator",
        lambda p: "mvr",
        lambda p: (
            f"an aggregator that reads one update per client with personalization={name(p.client_state).lower()} "
            "(MVR's second update is trained from the previous global model, not from each client's own)"
        ),
    ),
    # An attack on the asynchronous engine: an arrival is trained and sent alone, so an attacker there poisons its
    # data or its own update; an update built from the round's other updates (ALIE, IPM, min-max, scale by the
    # cohort) has no round to see, and no asynchronous aggregator reads a reported loss.
    Rule(
        ("engine", "attack"),
        lambda p: p.engine.asynchronous and p.attack.changes_updates and not p.attack.per_client,
        "engine",
        lambda p: "async",
        lambda p: (
            f"sync with attack={name(p.attack)} (its update is built from the round's other updates; an "
            "asynchronous arrival is sent alone: label_flip, random_labels, sign_flip, gaussian, scale with a "
            "scale, count_lie run there)"
        ),
    ),
    Rule(
        ("engine", "attack"),
        lambda p: p.engine.asynchronous and p.attack.lies_about_losses,
        "engine",
        lambda p: "async",
        lambda p: f"sync with attack={name(p.attack)} (no asynchronous aggregator reads a reported loss)",
    ),
    Rule(
        ("aggregator", "attack"),
        lambda p: p.aggregator.measures_losses and p.attack.lies_about_losses,
        lambda p: measuring(p)[0],
        lambda p: measuring(p)[1],
        lambda p: (
            f"null with attack={name(p.attack)} (the tilted risk is measured on the client's data: the lie would not "
            "reach it)"
        ),
    ),
    # The asynchronous engine.
    Rule(
        ("engine", "sampler"),
        lambda p: p.engine.asynchronous and not p.sampler.draws_uniformly,
        "sampler",
        lambda p: p.sampler.name,
        "uniform with engine=async (a client trains again when it comes back)",
    ),
    Rule(
        ("engine", "schedule"),
        lambda p: p.engine.asynchronous and p.schedule.cohort is not None,
        "schedule.cohort",
        lambda p: p.schedule.cohort,
        "null with engine=async (engine.concurrency sets who trains at once)",
    ),
    Rule(
        ("engine", "schedule"),
        lambda p: p.engine.asynchronous and p.schedule.sampling != "fixed",
        "schedule.sampling",
        lambda p: p.schedule.sampling,
        "fixed with engine=async (its clients come back as they finish)",
    ),
    Rule(
        ("engine", "aggregator"),
        lambda p: p.engine.asynchronous and not p.aggregator.asynchronous,
        "engine",
        lambda p: "async",
        lambda p: f"sync for {name(p.aggregator)}, a synchronous aggregator",
    ),
    Rule(
        ("engine", "devices"),
        lambda p: p.engine.asynchronous and p.devices.drops_clients,
        lambda p: dropping_key(p),
        lambda p: dropped_value(p),
        "null with engine=async (a deadline and the reports kept end a synchronous round; the buffer decides there)",
    ),
    Rule(
        ("engine", "heterogeneity"),
        lambda p: p.engine.asynchronous and not p.heterogeneity.equal_work,
        "heterogeneity",
        lambda p: name(p.heterogeneity),
        "none with engine=async (speeds model the heterogeneity)",
    ),
    # A population: who trains in a round is a count of its clients, never a fraction of all of them (the default
    # clients_per_round = 1 would gather a million clients' samples at once); the asynchronous engine's concurrency
    # says who trains at once there.
    Rule(
        ("partition", "engine"),
        lambda p: p.partition.draws_clients_when_they_train and p.engine.asynchronous and p.engine.concurrency is None,
        "engine.concurrency",
        lambda p: p.engine.concurrency,
        lambda p: (
            f"an integer from 1 to {p.partition.num_clients:,} with partition=population (the clients training "
            "at once, not all of them)"
        ),
    ),
    Rule(
        ("partition", "engine", "schedule"),
        lambda p: (
            p.partition.draws_clients_when_they_train
            and synchronous(p)
            and p.schedule.sampling == "poisson"
            and not p.schedule.clients_per_round < 1
        ),
        "schedule.clients_per_round",
        lambda p: p.schedule.clients_per_round,
        lambda p: (
            f"a rate below 1 with partition=population and poisson sampling (1 draws all "
            f"{p.partition.num_clients:,} clients every round)"
        ),
    ),
    Rule(
        ("partition", "engine", "schedule"),
        lambda p: (
            p.partition.draws_clients_when_they_train
            and synchronous(p)
            and p.schedule.sampling != "poisson"
            and not (p.schedule.cohort is not None and p.schedule.cohort <= p.partition.num_clients)
        ),
        "schedule.cohort",
        lambda p: p.schedule.cohort,
        population_count,
    ),
    # Privacy: what the accounting covers.
    Rule(
        ("privacy", "sampler"),
        lambda p: bool(p.privacy) and not p.sampler.draws_uniformly,
        "sampler",
        lambda p: p.sampler.name,
        lambda p: (
            f"uniform with {private(p)} (the accountant's amplification assumes each client is drawn alike, "
            "whatever the data)"
        ),
    ),
    Rule(
        ("privacy", "aggregator"),
        lambda p: (
            bool(p.privacy)
            and (p.aggregator.asynchronous or p.aggregator.weights_follow_clients or p.aggregator.reads_second_update)
        ),
        "aggregator",
        lambda p: name(p.aggregator),
        lambda p: (
            f"fedavg with {private(p)} (weights that follow the clients' losses, steps or data would change the "
            "sensitivity the noise is calibrated to)"
        ),
    ),
    Rule(
        ("privacy", "aggregator"),
        lambda p: bool(p.privacy) and p.aggregator.weighting != "uniform",  # privacy's options set uniform
        "aggregator.weighting",
        lambda p: p.aggregator.weighting,
        lambda p: (
            f"uniform with {private(p)}, which {private(p)} sets by itself (DP-FedAvg weighs every client "
            "alike; sample counts are private)"
        ),
    ),
    Rule(
        ("privacy", "heterogeneity"),
        lambda p: bool(p.privacy) and not p.heterogeneity.equal_work,
        "heterogeneity",
        lambda p: name(p.heterogeneity),
        lambda p: (
            f"none with {private(p)} (stragglers that drop out change the sampling that is accounted; the other "
            "options are not checked against the accounting yet)"
        ),
    ),
    Rule(
        ("privacy", "devices"),
        lambda p: bool(p.privacy) and drops_after_draw(p),
        lambda p: dropping_key(p),
        lambda p: dropped_value(p),
        lambda p: f"null with {private(p)} (clients dropped after the draw change the sampling that is accounted)",
    ),
    Rule(
        ("privacy", "pipeline"),
        lambda p: bool(p.privacy) and crossing_stage(p) is not None,
        lambda p: f"pipeline.stages.{crossing_stage(p)}",
        lambda p: name(p.pipeline.stages[crossing_stage(p)]),
        lambda p: (
            f"a stage that acts on each update alone with {private(p)} (one that adapts to the round's clients "
            "carries them into later rounds unaccounted; for adaptive clipping with its count noised and accounted, "
            "privacy.adaptive=true)"
        ),
    ),
    Rule(
        ("privacy", "pipeline"),
        lambda p: bool(p.privacy) and clipping_stage(p) is not None,
        lambda p: f"pipeline.stages.{clipping_stage(p)}",
        lambda p: name(p.pipeline.stages[clipping_stage(p)]),
        lambda p: (
            f"no clipping stage with {private(p)} (the mechanism clips each update to privacy.clip_norm itself, and "
            "its noise is calibrated to that norm: a second clip below it would waste the noise; set "
            "privacy.clip_norm, or privacy.adaptive=true)"
        ),
    ),
    Rule(
        ("privacy", "schedule"),
        lambda p: bool(p.privacy) and p.schedule.stop_at_accuracy is not None and p.schedule.stop_on != "test",
        "schedule.stop_on",
        lambda p: p.schedule.stop_on,
        lambda p: (
            f"test with {private(p)} and stop_at_accuracy (the clients' held-out accuracy is un-noised client "
            "data: stopping on it would release it)"
        ),
    ),
    # A client program other than plain local SGD (fedrun.programs): its states and server half are the synchronous
    # round's, a personal method trains its own way, MVR's second training would run the program twice.
    Rule(
        ("engine", "client"),
        lambda p: p.engine.asynchronous and p.client.serves,
        "client",
        lambda p: p.client.name,
        "sgd or moon with engine=async (its server half updates from each synchronous round's cohort, SCAFFOLD's c and "
        "FedDyn's h; their papers define no buffered version)",
    ),
    Rule(
        ("client_state", "client"),
        lambda p: p.client_state.keeps and not p.client.plain,
        "client",
        lambda p: p.client.name,
        lambda p: (
            f"sgd with personalization={name(p.client_state).lower()} (a personal method trains its clients its own "
            "way: FedRep's phases, Ditto's and APFL's personal models)"
        ),
    ),
    Rule(
        ("aggregator", "client"),
        lambda p: p.aggregator.reads_second_update and not p.client.plain,
        "client",
        lambda p: p.client.name,
        "sgd with aggregator=mvr (its second update per client, from the previous model, would run the program twice)",
    ),
    Rule(
        ("privacy", "client"),
        lambda p: bool(p.privacy) and p.client.exchanged() != (1, 1),
        "client",
        lambda p: p.client.name,
        lambda p: (
            f"sgd, feddyn or moon with {private(p)} (SCAFFOLD's clients upload their control variates beside their "
            "update, unclipped and un-noised: the accounted epsilon would not cover them)"
        ),
    ),
    # Stopping on the clients' own accuracy needs their held-out samples.
    Rule(
        ("schedule", "dataset"),
        lambda p: (
            p.schedule.stop_at_accuracy is not None
            and "client_accuracy" in STOP_ON[p.schedule.stop_on]
            and not p.dataset.client_test_fraction
            and not getattr(p.dataset, "client_tests", False)
        ),
        "schedule.stop_on",
        lambda p: p.schedule.stop_on,
        "test while dataset.client_test_fraction is 0 (client_accuracy needs each client's held-out samples)",
    ),
]


def check(parts: dict) -> None:
    """Raise the ConfigError of the first rule of ``RULES`` that applies to ``parts`` (group name -> part); a rule
    that needs a part not in ``parts`` is skipped."""
    namespace = Parts(**parts)
    for rule in RULES:
        if all(parts.get(needed) is not None for needed in rule.needs) and rule.applies(namespace):
            raise rule.error(namespace)
