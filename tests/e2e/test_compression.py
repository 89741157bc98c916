"""Compression through the real ``fedrun`` command, sync and async (the compressors: tests/unit/test_compression.py)."""

import pytest


@pytest.mark.slow
def test_compression_through_the_fedrun_command_sync_and_async(fedrun, store):
    from conftest import mlflow_runs

    common = ("schedule.rounds=2", "partition.num_clients=4", "compression.k=0.05")
    fedrun("compression=topk", *common, experiment="compression")
    fedrun("compression=topk", "aggregator=fedbuff", "aggregator.buffer_size=2", *common, experiment="compression")
    client, runs = mlflow_runs(store, "compression")
    assert len(runs) == 2
    ratios = []
    for done in runs:
        assert done.data.tags["compression"] == "topk" and done.info.status == "FINISHED"
        uploads = [m.value for m in client.get_metric_history(done.info.run_id, "3_communication/upload_mb")]
        downloads = [m.value for m in client.get_metric_history(done.info.run_id, "3_communication/download_mb")]
        ratios += [u / dl for u, dl in zip(uploads, downloads)]
    # every upload is a top-5% message, every download the dense float32 model: one ratio, 5% of the values plus
    # their indices, bits(d) / (32 d) = ceil(0.05 d) (32 + ceil(log2 d)) / (32 d), about 0.07 here
    assert len(ratios) >= 4 and max(ratios) - min(ratios) < 1e-12 and 0.05 < ratios[0] < 0.1
