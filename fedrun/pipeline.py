"""The update pipeline: what happens to the clients' updates between local training and aggregation.

The cohort's updates Delta_i (one row per client, stacked) pass through an ordered list of stages, the ``pipeline``
config group (``pipeline=none``: no stage, the updates as trained). A stage is a small object with
``__call__(deltas, clients, round) -> (deltas, diagnostics)``: it returns new rows (never edits its input) and
numbers to log for the round, named ``<stage>/<what>``. A stage may keep per-client state (an error-feedback
residual, an adaptive clip norm); it says what with ``state_dict()``, and the checkpoint keeps it.

Clipping, compression and privacy noise are stages (pfl-research's postprocessors are the model). The
synchronous engine passes each round's cohort through the pipeline; the asynchronous one passes each arriving
update alone, as its client would before sending it.
"""

from __future__ import annotations

import math

import numpy as np

from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.state import Context, Stateful


def number(value) -> bool:
    """Whether ``value`` is a real number: Python's bool is an int, and ``true`` is not a clip norm or a rate."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Stage(Stateful):
    """One step of the pipeline. ``name`` prefixes its diagnostics."""

    name = "stage"
    STATE = ()  # a stateless stage; one that adapts or remembers names its attributes
    clips = False  # capability: it bounds each update's norm (a private mechanism clips by itself: fedrun.compat)

    def __call__(self, deltas: torch.Tensor, clients: np.ndarray, round_: int) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def crosses_clients(self) -> bool:
        """Whether what the stage does to one client's update depends on other clients' updates (in this round or,
        through its state, in later ones). Privacy refuses such a stage: it would carry clients into rounds they
        were not sampled for."""
        return False

    def sent_bits(self, d: int, bits: float) -> float:
        """The bits of one client's message of ``d`` coordinates after this stage, given the ``bits`` it had before:
        unchanged by default (clipping rescales in place); a compressor gives its own message's size, a stage that
        makes the update dense again the dense size. The pipeline folds these over its stages (``message_bits``)."""
        return bits

    def bind(self, context: Context) -> None:
        """Called once before the first round with the run's ``Context`` (a randomised stage's streams derive from
        its seed)."""

    def end_round(self) -> None:
        """Called once a round's updates have all passed (synchronous: after the cohort; asynchronous: at each
        aggregation, after the buffer's updates passed one by one): where a stage that adapts to a round adapts."""


def clip_rows(deltas: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row scaled to l2 norm at most ``bound``: Delta_i * min(1, C / ||Delta_i||), the factor exactly 1.0 for a
    row within the bound (so it is unchanged bit for bit). Returns the clipped rows, the norms before clipping and
    which rows were over the bound (the ``clip`` stage and the privacy mechanism both clip this way)."""
    norms = torch.linalg.vector_norm(deltas, dim=1)
    over = norms > bound
    return deltas * torch.where(over, bound / norms, torch.ones_like(norms))[:, None], norms, over


def check_clip_rule(target_quantile, clip_lr) -> None:
    """Adaptive clipping's two settings (``geometric_clip_step``), checked alike by the clip stage and the privacy
    mechanism: gamma a number in [0, 1], eta a number > 0."""
    check(
        number(target_quantile) and 0 <= target_quantile <= 1,
        "target_quantile",
        target_quantile,
        "a number in [0, 1]",
    )
    check(number(clip_lr) and clip_lr > 0, "clip_lr", clip_lr, "a number > 0")


def geometric_clip_step(bound: float, unclipped: float, target_quantile: float, clip_lr: float) -> float:
    """Adaptive clipping's update of the bound (Andrew et al. 2021, Algorithm 1): C exp(-eta (b - gamma)), with b
    the (estimated) fraction of updates whose norm was at most C: C grows while fewer than gamma fit under it."""
    return bound * math.exp(-clip_lr * (unclipped - target_quantile))


class Clip(Stage):
    """Scale each client's update to l2 norm at most C: Delta_i * min(1, C / ||Delta_i||), the per-update clipping
    of DP-FedAvg (McMahan et al. 2018, Algorithm 1, "ClipFn"), as Flower and pfl-research clip. An update of norm
    exactly C is left as it is.

    With ``adaptive``, C follows a quantile of the update norms, as Andrew et al. 2021 ("Differentially private
    learning with adaptive clipping", NeurIPS, Algorithm 1) without its privacy noise: after clipping a round
    with C, b = the fraction of the round's updates whose norm was at most C (the *unclipped* fraction), and
    C <- C * exp(-clip_lr * (b - target_quantile)): geometric, so C grows while fewer than the target fraction fit
    under it and shrinks while more do. The next round uses the new C. In the asynchronous engine a round is an
    aggregation: every update of a buffer is clipped with the same C, and b is counted over the buffer. C and the
    counts of the round so far are this stage's state (checkpointed).

    Logs ``clip/max_norm`` (the C used this round), ``clip/fraction_clipped`` (updates whose norm exceeded it) and
    ``clip/norm_mean`` (mean norm before clipping).

    Args:
        max_norm: C > 0 (with ``adaptive``: its initial value).
        adaptive: Follow ``target_quantile`` of the norms.
        target_quantile: gamma in [0, 1], the fraction of updates meant to fit under C (Andrew et al.: 0.5).
        clip_lr: eta_C > 0, the geometric step (Andrew et al.: 0.2).
    """

    name = "clip"
    clips = True
    # C is a setting that adaptive clipping moves each round, so it is state too; the counts are the round so far.
    STATE = ("max_norm", "seen", "fit")

    def __init__(
        self, max_norm: float = 1.0, adaptive: bool = False, target_quantile: float = 0.5, clip_lr: float = 0.2
    ):
        check(number(max_norm) and max_norm > 0, "max_norm", max_norm, "a number > 0")
        check(isinstance(adaptive, bool), "adaptive", adaptive, "true or false")
        check_clip_rule(target_quantile, clip_lr)
        self.max_norm, self.adaptive, self.target_quantile, self.clip_lr = (
            float(max_norm),
            adaptive,
            float(target_quantile),
            float(clip_lr),
        )
        self.seen, self.fit = 0, 0  # updates of this round so far, and those whose norm was at most C

    def __call__(self, deltas, clients, round_):
        clipped, norms, over = clip_rows(deltas, self.max_norm)
        diagnostics = {
            "clip/max_norm": self.max_norm,
            "clip/fraction_clipped": float(over.double().mean()),
            "clip/norm_mean": float(norms.double().mean()),
        }
        self.seen, self.fit = self.seen + len(norms), self.fit + int((~over).sum())
        return clipped, diagnostics

    def crosses_clients(self) -> bool:
        return self.adaptive  # C follows the round's norms

    def end_round(self):
        if self.adaptive and self.seen:
            unclipped = self.fit / self.seen  # b
            self.max_norm = geometric_clip_step(self.max_norm, unclipped, self.target_quantile, self.clip_lr)
        self.seen, self.fit = 0, 0


class Pipeline(Stateful):
    """The stages in order; with none, updates pass unchanged (and nothing is logged).

    Args:
        stages: Stage objects, applied first to last.
    """

    STATE = ()  # its stages' states, nested (``state_dict``)

    def __init__(self, stages: list | tuple = ()):
        for i, stage in enumerate(stages):
            check(
                isinstance(stage, Stage),
                f"stages[{i}]",
                type(stage).__name__,
                "a stage (a class of fedrun.pipeline.Stage, e.g. fedrun.pipeline.Clip)",
            )
        self.stages = list(stages)

    def __bool__(self) -> bool:
        return bool(self.stages)

    def __call__(self, deltas: torch.Tensor, clients: np.ndarray, round_: int) -> tuple[torch.Tensor, dict[str, float]]:
        diagnostics: dict[str, float] = {}
        for stage in self.stages:
            deltas, more = stage(deltas, clients, round_)
            diagnostics.update(more)
        return deltas, diagnostics

    def bind(self, context: Context) -> None:
        for stage in self.stages:
            stage.bind(context)

    def end_round(self) -> None:
        for stage in self.stages:
            stage.end_round()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stages": [stage.state_dict() for stage in self.stages]}

    def load_state_dict(self, state: dict) -> None:
        for stage, saved in zip(self.stages, state["stages"], strict=True):
            stage.load_state_dict(saved)
        super().load_state_dict(state)


def message_bits(stages, d: int, bits: float) -> float:
    """The bits of one client's upload of ``d`` coordinates after ``stages``, starting from the dense update's
    ``bits``: each stage says how it changes the message (``Stage.sent_bits``)."""
    for stage in stages:
        bits = stage.sent_bits(d, bits)
    return bits


def upload_message_mb(pipeline: Pipeline, d: int, element_size: int) -> float:
    """Megabytes of one client's upload of ``d`` coordinates of ``element_size`` bytes: the dense update, through
    each stage of the pipeline (a compressor's message replaces it). A client with a personal part (FedPer's head)
    is counted as sending its ``d`` shared coordinates: the compressors see the whole update with the personal part
    zeroed, so a top-k's k, a fraction of the whole, may count a few more coordinates than this message has."""
    return message_bits(pipeline.stages, d, d * element_size * 8) / 8 / 1e6 if d else 0.0  # Local sends nothing
