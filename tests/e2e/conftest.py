"""The session's Slurm cluster (see slurm_cluster.py): a running one, or a private one-node
cluster set up here. Set-up failures fail the tests that need it, with the reason; only a
platform without apt (and without Slurm) skips them."""

import pytest

from tests.support.slurm_cluster import SlurmCluster, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    try:
        cluster = SlurmCluster.start(str(tmp_path_factory.mktemp("slurm")))
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()
