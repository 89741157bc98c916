"""Client programs (fedrun/programs.py) in a whole round of parts: what a program's server half reads under privacy
(the programs' arithmetic by hand: tests/unit/test_programs.py)."""

import torch

from fedrun.cli.build import run_engine, setup
from fedrun.parts import Parts


def test_feddyns_h_under_central_dp_is_summed_from_the_noised_releases_not_the_clients_updates(
    compose_config, monkeypatch
):
    """Under central DP the updates a round aggregates are clipped, not noised: FedDyn's h (every past round's sum
    in every later model) must come from each round's release, D times the noised mean, or the models it publishes
    hold the clients' updates without the noise epsilon was computed for."""
    cfg = compose_config(
        "dataset=digits",
        "client=feddyn",
        "privacy=central",
        "privacy.noise_multiplier=1.0",
        "privacy.clip_norm=0.1",
        "aggregator.weighting=uniform",
        "schedule.rounds=3",
        "partition.num_clients=8",
        "schedule.clients_per_round=0.5",
        "device=cpu",
        "device.threads=1",
    )
    rounds, step = [], Parts.step

    def recorded(self, params, update, sent, cohort):
        rounds.append((update.clone(), sent.clone(), self.privacy.denominator))
        return step(self, params, update, sent, cohort)

    monkeypatch.setattr(Parts, "step", recorded)
    built = setup(cfg)
    run_engine(built, cfg.seed)
    program, alpha, m = built["client"], built["client"].alpha, 8
    released, unnoised = torch.zeros_like(rounds[0][0]), torch.zeros_like(rounds[0][0])
    for update, sent, denominator in rounds:  # h <- h - alpha (1/m) sum, as FedDyn.adjust sums it (line 9)
        released = released - alpha * (update * denominator).unsqueeze(0).sum(0) / m
        unnoised = unnoised - alpha * sent.sum(0) / m
    assert len(rounds) == 3 and torch.equal(program.server, released)
    # the noise is what they differ by: z C / D a coordinate, far above the clipped updates' own sum
    assert (program.server - unnoised).norm() > 10 * unnoised.norm()


def test_hierarchical_term_weighs_each_cohort_client_by_its_tilted_risk_at_the_rounds_model(
    compose_config, monkeypatch
):
    """method=hierarchical_term through the composed run, on worker processes: round 1's alpha is p_k exp(t R~_k)
    renormalised, R~_k the client's tilted risk at tau over its training samples at the initial model, computed here
    on its own; the clients train on their tilted risk at the same tau."""
    import copy

    import numpy as np

    from fedrun.aggregators import TERM
    from fedrun.clients import TiltedRisk
    from fedrun.models import flat_parameters

    cfg = compose_config(
        "dataset=digits",
        "method=hierarchical_term",
        "aggregator.t=2",
        "aggregator.tau=0.5",
        "schedule.rounds=1",
        "partition.num_clients=6",
        "schedule.clients_per_round=0.5",
        "device=cpu",
        "device.threads=1",
        "device.backend=processes",
        "device.workers=2",
    )
    seen, weights = [], TERM.weights

    def recorded(self, report):
        alpha = weights(self, report)
        seen.append((report.clients.copy(), alpha))
        return alpha

    monkeypatch.setattr(TERM, "weights", recorded)
    built = setup(cfg)
    model, w0 = copy.deepcopy(built["model"]), flat_parameters(built["model"]).clone()
    run_engine(built, cfg.seed)
    [(cohort, alpha)] = seen
    data, parts = built["data"], [built["clients"][c] for c in cohort]
    risks = np.array([TiltedRisk(0.5)(model, w0, data.x_train[p], data.y_train[p]) for p in parts])
    expected = np.array([len(p) for p in parts]) * np.exp(2 * risks)
    np.testing.assert_allclose(alpha, expected / expected.sum(), rtol=1e-6)
    means = np.array([TiltedRisk(1e-9)(model, w0, data.x_train[p], data.y_train[p]) for p in parts])
    assert np.all(risks > means)  # tau > 0 leans towards each client's hardest samples
    assert built["client"].tau == 0.5  # the clients' own tilt follows aggregator.tau
