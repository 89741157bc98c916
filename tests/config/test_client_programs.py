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
