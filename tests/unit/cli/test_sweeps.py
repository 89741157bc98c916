"""fedrun.cli.sweeps: the cores each job of a sweep gets."""

from fedrun.backends import usable_cores


def test_cores_per_job_follow_joblib_n_jobs_and_ray_num_cpus():
    from omegaconf import OmegaConf

    from fedrun.cli.sweeps import job_cores

    def launcher(**keys):
        return OmegaConf.create({"launcher": keys})

    cores = usable_cores()
    assert job_cores(launcher()) == cores  # the basic launcher's one job at a time
    assert job_cores(launcher(n_jobs=2)) == max(1, cores // 2)
    assert job_cores(launcher(n_jobs=-1)) == 1  # joblib's -1: as many jobs as cores
    assert job_cores(launcher(n_jobs=64)) == 1
    assert job_cores(launcher(ray={"remote": {"num_cpus": 3}})) == 3  # what Ray gives each task
