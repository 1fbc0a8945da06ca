"""Issue "One architecture step": every batch returns a typed result; the job runner and the CLI's exit
code 5 read its outcome instead of guessing failures from key names."""

import json

import pytest

from billingctl.domain.batch import BatchResult, failed_items

pytestmark = pytest.mark.unit


def test_a_batch_result_prints_its_document_unchanged_and_carries_a_typed_outcome():
    result = BatchResult({"outcomes": {"succeeded": 3, "error": 1}, "errors": []}, done=3, failed=1,
                         errors=[{"invoice_id": "inv_1", "error": "declined"}])
    assert result == {"outcomes": {"succeeded": 3, "error": 1}, "errors": []}
    assert json.loads(json.dumps(result)) == dict(result)
    assert (result.outcome.done, result.outcome.failed, result.outcome.skipped) == (3, 1, 0)
    assert result.outcome.errors == ({"invoice_id": "inv_1", "error": "declined"},)
    assert failed_items(result) == 1


def test_only_the_outcome_decides_a_partial_failure():
    # A key named like a failure is not one: the old runner counted any "failed" or "errors" key.
    assert failed_items({"failed": [1, 2], "errors": ["x"], "violations": [1]}) == 0
    assert failed_items(BatchResult({"failed": [1, 2]}, failed=0)) == 0


def test_every_scheduled_batch_returns_a_typed_result():
    import inspect

    from jobs.schedule import JOBS, resolve

    not_batches = {"poller-watchdog", "velocity-watch"}  # a freshness check and a watch, not batches of items
    for job in JOBS:
        if job.name in not_batches:
            continue
        source = inspect.getsource(resolve(job))
        assert "BatchResult(" in source, f"{job.name} does not return a BatchResult"

