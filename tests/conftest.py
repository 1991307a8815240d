"""Shared fixtures: a real Kafka-protocol broker and a real S3 server, both on loopback."""

pytest_plugins = ["tests.fixtures.kafka", "tests.fixtures.s3", "tests.fixtures.policy"]
