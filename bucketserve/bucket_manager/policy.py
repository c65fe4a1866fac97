"""Queue orders inside a tenant: FCFS, SJF, LJF."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bucketserve.bucket_manager.request import BucketRequest

OrderKey = tuple[float, ...]


class Policy(str, Enum):
    FCFS = "fcfs"
    SJF = "sjf"
    LJF = "ljf"

    def order_key(self, request: BucketRequest, seq: int) -> OrderKey:
        """Smaller is served first: request priority, then the policy, then arrival.

        `seq` (admission order) makes keys unique, so a re-queued request
        returns to exactly its old place. A job's length is the tokens it computes: a
        prompt found in a prefix cache is a short job, however long it is.
        """
        if self is Policy.FCFS:
            return (request.priority, request.arrival_time, seq)
        length = request.expected_work if self is Policy.SJF else -request.expected_work
        return (request.priority, length, request.arrival_time, seq)
