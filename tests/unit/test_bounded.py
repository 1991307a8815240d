"""Bounded calls: a result, an error or a timeout, never a stalled caller; a killed worker is gone."""

from __future__ import annotations

import importlib
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from producers.tasks.bounded import BoundedCallError, BoundedPool


def test_results_errors_and_reuse() -> None:
    pool = BoundedPool(timeout_s=30)
    try:
        assert pool.call(math.factorial, 5) == 120
        with pytest.raises(BoundedCallError, match="ValueError: math domain error") as err:
            pool.call(math.sqrt, -1)
        assert not err.value.timed_out
        first = pool.call(os.getpid)
        assert first != os.getpid() and pool.call(os.getpid) == first  # an idle worker serves the next call
        with ThreadPoolExecutor(4) as threads:
            assert list(threads.map(lambda n: pool.call(math.factorial, n), range(12))) == [
                math.factorial(n) for n in range(12)]
    finally:
        pool.close()


def test_a_call_past_its_deadline_kills_its_worker() -> None:
    pool = BoundedPool(timeout_s=1)
    try:
        stuck = pool.call(os.getpid)
        with pytest.raises(BoundedCallError, match="no result in 1 s") as err:
            pool.call(time.sleep, 3600)
        assert err.value.timed_out
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)
        assert pool.call(math.factorial, 3) == 6 and pool.call(os.getpid) != stuck
    finally:
        pool.close()


def test_a_warmup_that_fails_is_reported_at_start() -> None:
    pool = BoundedPool(timeout_s=5, warmup=_no_such_module)
    with pytest.raises(RuntimeError, match="did not start: ModuleNotFoundError"):
        pool.call(math.factorial, 3)


def _no_such_module() -> None:
    importlib.import_module("no_such_module_for_rlbus")
