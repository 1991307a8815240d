"""Shared fixtures: a real Kafka-protocol broker and a real S3 server, both on loopback."""

import pytest

pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.s3", "tests.fixtures.policy"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the group into the test's id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist with ``--dist loadgroup`` (``make test``), the end-to-end runs go one after
    another on one process: each keeps both cores of a small machine busy, and two at once would only
    slow each other. The unit and integration tests, half of their time waiting on brokers, run
    beside them on the others."""
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.xdist_group("e2e"))
