"""The private redis-server for tests (bench/redis_server.py), with the tests' policy: in CI
(CI=true) a missing redis-server binary is a failure, not a skip: .ci/run installs it.
"""

from __future__ import annotations

import os

import pytest

from bench import redis_server as _launcher


class RedisServer(_launcher.RedisServer):
    def __init__(self, maxmemory: str | None = None) -> None:
        try:
            super().__init__(maxmemory)
        except FileNotFoundError:
            if os.environ.get("CI") == "true":
                pytest.fail("redis-server is not installed (CI must install it)")
            pytest.skip("redis-server is not installed")
