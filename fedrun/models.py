"""Models: each option of the ``model`` group builds an ``nn.Module`` for a dataset's input shape and classes."""

import math
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.functional import batch_norm

from fedrun.errors import ConfigError, check

HEADS = {
    "logits": "the class scores, as every paper describes",
    "batch_softmax": "a softmax over the batch dimension, the authors' February 2023 ConvNet (paper 001's code)",
}


class BatchSoftmax(nn.Module):
    """Softmax over the batch dimension (dim 0), fed to the cross-entropy as if it were logits.

    The output layer of the ConvNet in github alexandreduplessis/Tamaya_Federated_Learning from its first commit
    (10622fb, src/convnet.py:20 ``return F.softmax(self.lin(x), dim=0)``) until abfff8a (2023-03-13) replaced it by
    ``return self.lin(x)``. Every surviving commit postdates paper 001, but 10622fb is the oldest, carries the
    paper's title, its plot.py names the rows of the paper's table B.3 and its defaults match paper 001 (line 273),
    so this head most likely ran its tables. Each class's scores are normalised across the samples of a
    batch, so an output depends on the other samples in its batch, the cross-entropy sees inputs in [0, 1] (its
    values stay near ln 10 and its gradients are small, which is why lr 1e-3 on a summed loss over raw 0-255
    pixels trains there) and a prediction depends on the evaluation batch (``eval_batch``).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=0)


NORMS = {
    "none": "no normalisation (the papers, PFLlib)",
    "batch": "batch norm after each convolution (its statistics those of the data it is judged with: BatchNorm)",
}


class BatchNorm(nn.BatchNorm2d):
    """Batch normalisation whose evaluation statistics are computed from data, not carried as running averages.

    In training it normalises by the mini-batch's statistics, as ``nn.BatchNorm2d`` does (Ioffe and Szegedy 2015,
    Algorithm 1). In evaluation it normalises by ``statistics``, the per-channel mean and (biased) variance of a
    set of inputs under the current parameters, which ``fedrun.clients.calibrate`` sets, layer by layer (the second
    layer's inputs normalised by the first layer's statistics): the statistics of a client's own training data on
    the client's side, of every client's on the server's. It keeps no buffers, so a model's state is its flat
    parameters alone: every backend, aggregator, stage and checkpoint handles it unchanged, and a resumed run is
    exact. Loading new parameters (``load_flat``) clears the statistics; a forward in evaluation without them
    raises, so no path can judge a model by another model's statistics.

    FedBN's code and PyTorch's module keep exponential running averages (momentum 0.1) updated during training
    instead: those lag the parameters by the last few mini-batches, and an aggregator would have to average them
    beside the parameters. The statistics here are exact for the parameters judged; the price is one pass over the
    calibration inputs per batch-norm layer at each evaluation.

    Args:
        channels: Feature channels (dimension 1 of the input).
    """

    def __init__(self, channels: int):
        super().__init__(channels, track_running_stats=False)
        self.statistics: tuple[torch.Tensor, torch.Tensor] | None = None

    # The statistics travel in a state dict (the saved ``model.pt``) under nn.BatchNorm2d's names for its running
    # statistics, so a saved model evaluates as it was judged, in fedrun or in a plain torch model with
    # ``nn.BatchNorm2d`` layers; a state dict without them (a model never calibrated) loads with none.
    STATISTICS = ("running_mean", "running_var")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.statistics is not None:
            for name, value in zip(self.STATISTICS, self.statistics):
                destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        found = [state_dict.pop(prefix + name, None) for name in self.STATISTICS]  # (a copy: load_state_dict's)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.statistics = None if any(v is None for v in found) else tuple(v.to(self.weight) for v in found)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return super().forward(x)  # the mini-batch's statistics (no running averages to update)
        if self.statistics is None:
            raise RuntimeError("a batch-norm model evaluated without statistics: calibrate it on data first")
        mean, var = self.statistics
        return batch_norm(x, mean, var, self.weight, self.bias, False, 0.0, self.eps)


def batch_norms(model: nn.Module) -> list[BatchNorm]:
    """The model's ``BatchNorm`` layers, in the order they were registered (the order they apply in, for the
    sequential models here)."""
    return [m for m in model.modules() if isinstance(m, BatchNorm)]


def batch_norm_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of the model's ``BatchNorm`` layers (FedBN's local parameters)."""
    norms = {id(m) for m in batch_norms(model)}
    return tuple(
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if id(module) in norms
        for name, _ in module.named_parameters(recurse=False)
    )


def _norm(norm: str, channels: int) -> list[nn.Module]:
    check(norm in NORMS, "norm", norm, " or ".join(f"{k} ({v})" for k, v in NORMS.items()))
    return [BatchNorm(channels)] if norm == "batch" else []


class CNN(nn.Sequential):
    """The papers' CNN: conv3x3(32)+ReLU+maxpool2, conv3x3(64)+ReLU+maxpool2, flatten, linear to classes
    (each ReLU applied after its pooling, which computes the same function and gradient).

    Unpadded convolutions, as in the papers, give 64 x 5 x 5 = 1600 features on 28x28 inputs.

    Args:
        input_shape: (channels, height, width), from the dataset.
        num_classes: From the dataset.
        padding: Convolution padding; null means 0 (the papers) unless the input is too small for it,
            then 1 (8x8 digits).
        head: ``logits`` (the papers) or ``batch_softmax`` (``BatchSoftmax``: the authors' code for paper 001).
        eval_batch: With ``batch_softmax``, the batch size predictions and losses are computed in outside
            training (their test loader's 1000, train.py:161 at 10622fb); outputs depend on it. Unused with logits.
        norm: ``none`` (the papers) or ``batch``: a ``BatchNorm`` after each convolution, before its pooling
            (conv, norm, pool, ReLU computes conv, norm, ReLU, pool: FedBN's order).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        padding: int | None = None,
        head: str = "logits",
        eval_batch: int = 1000,
        norm: str = "none",
    ):
        if len(input_shape) != 3:
            raise ConfigError(
                "model", "cnn", f"mlp or logistic for inputs of shape {tuple(input_shape)} (cnn needs images)"
            )
        channels, height, width = input_shape
        side = min(height, width)
        if padding is None:
            padding = 0 if _cnn_side(side, 0) >= 1 else 1
        check(isinstance(padding, int) and padding >= 0, "padding", padding, "null or an integer >= 0")
        out = _cnn_side(side, padding)
        check(out >= 1, "padding", padding, f"a padding that leaves features for {height}x{width} inputs (try 1)")
        check(head in HEADS, "head", head, " or ".join(f"{k} ({v})" for k, v in HEADS.items()))
        check(isinstance(eval_batch, int) and eval_batch >= 1, "eval_batch", eval_batch, "an integer >= 1")
        features = 64 * _cnn_side(height, padding) * _cnn_side(width, padding)
        # ReLU after max-pooling: relu(maxpool(a)) = maxpool(relu(a)) exactly (ReLU is monotone, and both
        # orders send the gradient to the same element, or none), at a quarter of the ReLU work.
        super().__init__(
            nn.Conv2d(channels, 32, 3, padding=padding),
            *_norm(norm, 32),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=padding),
            *_norm(norm, 64),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(features, num_classes),
            *([BatchSoftmax()] if head == "batch_softmax" else []),
        )
        self.padding = padding
        if head == "batch_softmax":  # read by fedrun.clients.eval_chunk
            self.eval_batch = eval_batch


def _cnn_side(side: int, padding: int) -> int:
    for _ in range(2):
        side = (side + 2 * padding - 2) // 2  # conv3x3 then maxpool2
    return side


class MLP(nn.Sequential):
    """A multi-layer perceptron with ReLU hidden layers (two of 600 units by default).

    Args:
        input_shape: From the dataset; inputs are flattened.
        num_classes: From the dataset.
        hidden: Sizes of the hidden layers.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (600, 600)):
        check(all(int(h) >= 1 for h in hidden), "hidden", list(hidden), "a list of layer sizes >= 1")
        sizes = [math.prod(input_shape), *map(int, hidden)]
        layers: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in zip(sizes, sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        super().__init__(*layers, nn.Linear(sizes[-1], num_classes))


class Logistic(nn.Sequential):
    """Multinomial logistic regression: the strongly convex case of the theory.

    Args:
        input_shape: From the dataset; inputs are flattened.
        num_classes: From the dataset.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat parameter vector into the model (and clear its batch-norm statistics, which were another
    model's).

    Unlike ``torch.nn.utils.vector_to_parameters``, which makes the parameters views of ``flat``, this
    copies: in-place optimizer steps must never write into the global model.
    """
    for norm in batch_norms(model):
        norm.statistics = None
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def flat_views(flat: torch.Tensor, named) -> dict[str, torch.Tensor]:
    """{name: the slice of ``flat`` shaped as that parameter} for the (name, parameter) pairs ``named``, in the flat
    layout's order (``flat_parameters``): views, not copies, so a gradient in them reaches ``flat`` (under
    ``torch.func.vmap`` a parameter's shape and size are one client's)."""
    views, offset = {}, 0
    for name, p in named:
        views[name] = flat[offset : offset + p.numel()].reshape(p.shape)
        offset += p.numel()
    return views


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A detached copy of the model's parameters as one flat vector."""
    # reshape, not view: parameters in channels_last layout are not contiguous. Logical (NCHW) order always.
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_delta(model: nn.Module, start: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The model's parameters minus ``start``, as one flat vector in ``flat_parameters``' order, written into ``out``
    (a row of a cohort's updates; a new vector when None): parameter by parameter, one pass over the memory where
    ``flat_parameters(model) - start`` makes two and a vector of its own. The same elementwise subtractions, so the
    same bits."""
    out = torch.empty_like(start) if out is None else out
    starts, rows = flat_views(start, model.named_parameters()), flat_views(out, model.named_parameters())
    for name, p in model.named_parameters():
        torch.sub(p.detach(), starts[name], out=rows[name])
    return out


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite: by the sum first (an inf or a NaN makes it inf or NaN; finite entries alone can
    only make it inf by overflow, and then each entry is checked). ``torch.isfinite(w).all()`` makes two passes and
    a mask as long as ``w``: 36 ms a round for a FEMNIST CNN's 6.6M parameters here, the sum 8 ms."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class LeafCNN(nn.Sequential):
    """LEAF's FEMNIST CNN (``models/femnist/cnn.py``): conv 5x5 32 ('same'), ReLU, max-pool 2; conv 5x5 64 ('same'),
    ReLU, max-pool 2; dense 2048 with ReLU; dense to the classes. 6,603,710 parameters for 28x28 inputs and 62
    classes (pinned in a test).

    Args:
        input_shape: (channels, height, width), from the dataset.
        num_classes: From the dataset.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        if len(input_shape) != 3:
            raise ConfigError(
                "model", "leaf_cnn", f"char_lstm, mlp or logistic for inputs of shape {tuple(input_shape)}"
            )
        channels, height, width = input_shape
        super().__init__(
            nn.Conv2d(channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * (height // 4) * (width // 4), 2048),
            nn.ReLU(),
            nn.Linear(2048, num_classes),
        )


class FedAvgCNN(nn.Sequential):
    """PFLlib's CNN for MNIST and Fashion-MNIST (github TsingZ0/PFLlib, system/flcore/trainmodel/models.py,
    ``FedAvgCNN(in_features=1, num_classes=10, dim=1024)``): conv 5x5 32 (unpadded), ReLU, max-pool 2; conv 5x5 64,
    ReLU, max-pool 2; dense 512 with ReLU; dense to the classes. 582,026 parameters on 28x28 inputs and 10 classes
    (pinned in a test). The modules keep PFLlib's names (``conv1``, ``conv2``, ``fc1``, ``fc``): its FedPer and FedRep
    head is ``fc``, which is also this model's last layer (``personalization.personal`` null).

    Args:
        input_shape: (channels, height, width), from the dataset.
        num_classes: From the dataset.
        norm: ``none`` (PFLlib's) or ``batch``: a ``BatchNorm`` after each convolution (``bn1``, ``bn2``, the
            names FedBN's code keeps local; 192 more parameters). Not after ``fc1``: a mini-batch of one sample (a
            client's last, with PFLlib's batch 10) has no batch statistics in a dense layer.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, norm: str = "none"):
        if len(input_shape) != 3:
            raise ConfigError("model", "fedavg_cnn", f"mlp or logistic for inputs of shape {tuple(input_shape)}")
        channels, height, width = input_shape
        out = [((n - 4) // 2 - 4) // 2 for n in (height, width)]  # each side after conv5x5, pool 2, conv5x5, pool 2
        features = 64 * math.prod(out)
        if min(out) < 1:
            raise ConfigError(
                "model", "fedavg_cnn", f"cnn for {height}x{width} inputs (fedavg_cnn needs at least 16x16)"
            )
        super().__init__(
            OrderedDict(
                conv1=nn.Conv2d(channels, 32, 5),
                **dict(zip(["bn1"], _norm(norm, 32))),
                relu1=nn.ReLU(),
                pool1=nn.MaxPool2d(2),
                conv2=nn.Conv2d(32, 64, 5),
                **dict(zip(["bn2"], _norm(norm, 64))),
                relu2=nn.ReLU(),
                pool2=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc1=nn.Linear(features, 512),
                relu3=nn.ReLU(),
                fc=nn.Linear(512, num_classes),
            )
        )


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model (``models/shakespeare/stacked_lstm.py``): an embedding of 8 per symbol, two LSTM
    layers of 256, and a dense layer from the last step's output to the vocabulary. 819,920 parameters for LEAF's
    80 symbols with PyTorch's two biases per gate (pinned in a test; TensorFlow's one bias gives 817,872).

    Args:
        input_shape: (sequence length,), from the dataset; inputs are symbol indices (int64).
        num_classes: The vocabulary, from the dataset (the next symbol is the label).
        embedding: Embedding size.
        hidden: LSTM units per layer.
        layers: LSTM layers.
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, embedding: int = 8, hidden: int = 256, layers: int = 2
    ):
        super().__init__()
        if len(input_shape) != 1:
            raise ConfigError(
                "model", "char_lstm", f"leaf_cnn, cnn, mlp or logistic for inputs of shape {tuple(input_shape)}"
            )
        for key, value in (("embedding", embedding), ("hidden", hidden), ("layers", layers)):
            check(isinstance(value, int) and value >= 1, key, value, "an integer >= 1")
        self.embed = nn.Embedding(num_classes, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])
