"""The result of a batch (the poll, orphan recovery, activations, renewals, cleanup, outbox delivery,
sync-all, reconcile, prune): its JSON document for people and scripts, exactly as each batch reports it,
and a typed outcome the job runner and the CLI read for exit code 5 instead of guessing from key names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    errors: tuple[dict, ...] = field(default_factory=tuple)  # one per failed item, when the batch names them


class BatchResult(dict):
    """A batch's document (a dict: printed and compared as before) carrying its `outcome`."""

    outcome: Outcome

    def __init__(self, document: dict, *, done: int = 0, failed: int = 0, skipped: int = 0, errors=()):
        super().__init__(document)
        self.outcome = Outcome(done=done, failed=failed, skipped=skipped, errors=tuple(errors))


def failed_items(result) -> int:
    """How many items of a batch failed (0 for a result that is not a batch's)."""
    return result.outcome.failed if isinstance(result, BatchResult) else 0
