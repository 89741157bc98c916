"""fedrun.cli.resume: every ``_target_`` of a saved config at any depth, and a device's backend, are checked."""

import fedrun.cli.resume as resume


def test_every_target_at_any_depth_and_a_device_s_backend_are_checked():
    device = {"_target_": "fedrun.backends.Device", "backend": "loop"}
    config = {
        "aggregator": {
            "_target_": "fedrun.aggregators.Hybrid",
            "phases": [
                {"aggregator": {"_target_": "torch.load", "f": "x"}},
                {"aggregator": {"_target_": "builtins.eval"}},
            ],
        },
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": {"_target_": "numpy.load"}},
        "model": {"_target_": "fedrun.models.CNN", "_args_": [{"_target_": "pandas.read_pickle"}]},
        "device": {**device, "backend": "mypackage.Trainer"},
        "dataset": {**device, "backend": "fedrun.vmap.VmapTrainer"},  # a fedrun backend, in any group
        "server": {"_target_": ["not", "a", "string"]},
        "heterogeneity": {"_target_": "fedrun.heterogeneity.EqualWork"},
    }
    assert resume.foreign_code(config) == [
        ("aggregator.phases.0.aggregator._target_", "torch.load"),
        ("aggregator.phases.1.aggregator._target_", "builtins.eval"),
        ("optimizer.lr._target_", "numpy.load"),
        ("model._args_.0._target_", "pandas.read_pickle"),
        ("device.backend", "mypackage.Trainer"),
        ("server._target_", ["not", "a", "string"]),
    ]
