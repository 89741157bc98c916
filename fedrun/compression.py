"""Compressed updates: the ``compression`` config group, each option a stage of the update pipeline
(``fedrun.pipeline``) that runs after the ``pipeline`` group's stages, and what each message really takes in bits.

A compressor replaces each client's update Delta_i (a row) by what the server would decode from the client's
message, and says how many bits that message takes (``message_bits``), which ``upload_mb`` reports instead of the
dense float32 size. Randomised compressors draw from their own stream (seed, round, client): the same on every
backend, and across a kill and resume.

- ``topk``: keep the ``k`` fraction of each update's coordinates largest in magnitude (at least one), zero the rest.
  With ``error_feedback`` (Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with memory"; Karimireddy et al.
  2019, "Error feedback fixes SignSGD"), each client keeps what its last message left out, e_i, and compresses
  Delta_i + e_i; the new e_i is what that message leaves out. The residuals are per client and checkpointed.
  Message: the kept values (32 bits each) and their indices (ceil(log2 d) bits each), or the dense 32 d bits when
  that is smaller.
- ``qsgd``: QSGD (Alistarh et al. 2017, "QSGD: communication-efficient SGD via gradient quantization and
  encoding", section 3.1) with s = ``levels``: Q(v)_j = ||v||_2 sign(v_j) xi_j, where xi_j is l / s or (l + 1) / s
  for the l with |v_j| / ||v||_2 in [l / s, (l + 1) / s], the upper one with probability |v_j| s / ||v||_2 - l. Unbiased:
  E[Q(v)] = v. Message: the norm (32 bits) and each coordinate's signed level, one of 2 s + 1 values:
  32 + d log2(2 s + 1) bits (a fixed-length code, as FedJAX counts its quantisers; QSGD's Elias coding of sparse
  levels would take fewer at small s).
- ``sign``: scaled sign compression (Karimireddy et al. 2019, the compressor of EF-SignSGD): ||v||_1 / d * s(v),
  with the same optional error feedback. s(v)_j is +1 for v_j >= 0 and -1 below: a zero coordinate is sent as +,
  so the message has two symbols and one bit per coordinate is its true size (torch.sign would send 0 as a third
  symbol, which one bit cannot carry). BytePS's scaled 1-bit compressor encodes the same way: the bit is v_j < 0,
  decoded as +-||v||_1 / d (bytedance/byteps, byteps/common/compressor/impl/onebit.cc). With s(v) in {-1, +1}^d,
  <s(v), v> = ||v||_1 and ||s(v)||^2 = d, so the compression error is ||v||^2 - ||v||_1^2 / d: Karimireddy et
  al.'s delta = ||v||_1^2 / (d ||v||^2) holds with equality. Error feedback carries what a zero sent as + adds
  into the client's next update. Message: the scale (32 bits) and one bit per coordinate: 32 + d bits.
"""

from __future__ import annotations

import math

from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.pipeline import Stage, number
from fedrun.pipeline import message_bits as pipeline_bits
from fedrun.seeding import torch_generator

FLOAT_BITS = 32  # what the dense message holds per coordinate (float32), and a norm or scale


def dense_bits(d: int) -> float:
    """An uncompressed update of d float32 coordinates."""
    return float(FLOAT_BITS * d)


class Compressor(Stage):
    """A compression stage: ``compress(row, client, round_)`` for one update, optional error feedback (per-client
    residuals, checkpointed) around it, and ``message_bits(d)``.

    Args:
        error_feedback: Keep what each message leaves out and add it to the client's next update.
    """

    name = "compression"
    STATE = ("residuals",)  # the seed is the run's, given again by ``bind``

    def __init__(self, error_feedback: bool = False):
        check(isinstance(error_feedback, bool), "error_feedback", error_feedback, "true or false")
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}  # client -> e_i (error feedback)
        self.seed = 0

    def bind(self, context) -> None:
        self.seed = context.seed

    def compress(self, row: torch.Tensor, client: int, round_: int) -> torch.Tensor:
        raise NotImplementedError

    def message_bits(self, d: int) -> float:
        raise NotImplementedError

    def sent_bits(self, d: int, bits: float) -> float:
        return self.message_bits(d)  # the compressed message replaces whatever came before

    def __call__(self, deltas, clients, round_):
        out = torch.empty_like(deltas)
        for k, (row, client) in enumerate(zip(deltas, clients)):
            client = int(client)
            if self.error_feedback and client in self.residuals:
                row = row + self.residuals[client].to(row)
            out[k] = self.compress(row, client, round_)
            if self.error_feedback:
                self.residuals[client] = (row - out[k]).detach().to("cpu").clone()
        diagnostics = {f"{self.name}/bits_per_coordinate": self.message_bits(deltas.shape[1]) / deltas.shape[1]}
        if len(deltas):
            error = torch.linalg.vector_norm(out - deltas, dim=1) / torch.linalg.vector_norm(deltas, dim=1).clamp_min(
                1e-30
            )
            diagnostics[f"{self.name}/relative_error"] = float(error.double().mean())
        return out, diagnostics


class TopK(Compressor):
    """Top-k sparsification with optional error feedback (see the module docstring).

    Args:
        k: The fraction of coordinates kept, in (0, 1] (at least one coordinate).
        error_feedback: Error feedback (default on).
    """

    name = "topk"

    def __init__(self, k: float = 0.1, error_feedback: bool = True):
        check(number(k) and 0 < k <= 1, "k", k, "a fraction in (0, 1]")  # number(): k=true is not k = 1
        super().__init__(error_feedback)
        self.k = float(k)

    def kept(self, d: int) -> int:
        return max(1, math.ceil(self.k * d))

    def compress(self, row, client, round_):
        kept = self.kept(row.numel())
        if kept >= row.numel():
            return row.clone()
        # Ties broken by index (a stable sort of the magnitudes): the same coordinates on every backend.
        order = torch.sort(row.abs(), descending=True, stable=True).indices[:kept]
        out = torch.zeros_like(row)
        out[order] = row[order]
        return out

    def message_bits(self, d):
        kept = self.kept(d)
        return min(dense_bits(d), kept * (FLOAT_BITS + math.ceil(math.log2(d)))) if d > 1 else dense_bits(d)


class QSGD(Compressor):
    """QSGD's unbiased stochastic quantisation with s levels (see the module docstring).

    Args:
        levels: s >= 1.
    """

    name = "qsgd"

    def __init__(self, levels: int = 4):
        check(
            isinstance(levels, int) and not isinstance(levels, bool) and levels >= 1,
            "levels",
            levels,
            "an integer >= 1",
        )
        super().__init__(False)
        self.levels = levels

    def compress(self, row, client, round_):
        norm = torch.linalg.vector_norm(row)
        if norm == 0 or not torch.isfinite(norm):
            return row.clone()
        scaled = row.abs() / norm * self.levels  # in [0, s]
        lower = torch.floor(scaled)
        draw = torch.rand(
            row.numel(), generator=torch_generator(self.seed, "qsgd", round_, client), dtype=torch.float64
        )
        level = lower + (draw.to(row.device) < (scaled - lower).double()).to(row.dtype)
        return norm * torch.sign(row) * level / self.levels

    def message_bits(self, d):
        return FLOAT_BITS + d * math.log2(2 * self.levels + 1)


class Sign(Compressor):
    """Scaled sign compression, ||v||_1 / d * s(v) with s(v)_j = +1 for v_j >= 0 and -1 below (a zero is sent as +:
    one bit a coordinate), with optional error feedback (see the module docstring).

    Args:
        error_feedback: Error feedback (default on: EF-SignSGD).
    """

    name = "sign"

    def __init__(self, error_feedback: bool = True):
        super().__init__(error_feedback)

    def compress(self, row, client, round_):
        # Two symbols: a zero goes as + (the message is one bit a coordinate; see the module docstring).
        return row.abs().mean() * torch.where(row >= 0, 1.0, -1.0).to(row)

    def message_bits(self, d):
        return FLOAT_BITS + d


def message_bits(stages, d: int) -> float:
    """The bits of one client's upload after ``stages``, from a dense float32 update: the last compressor's message,
    else the dense update (``fedrun.pipeline.message_bits`` folds each stage's ``sent_bits``)."""
    return pipeline_bits(stages, d, dense_bits(d))
