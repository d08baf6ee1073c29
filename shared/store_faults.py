"""An S3 outage waited out, not charged to the jobs it meets.

S3 away is no fault of a job's, and a job's result can only be stored there: a job that met it (its
image fetch, the look for an earlier result, its result's write) is retried without counting the
attempt, for `MRC_STORE_OUTAGE_S` from the first such fault, its delays doubling as those retries
mount. Before (review, helper-93), each retry counted: a 4.4 s outage failed 30 of 98 backlog jobs
`internal_error` for good, and a 20 s one dead-lettered 12 with no result object at all. Past the
budget the faults count as any retryable fault does (`MRC_MAX_ATTEMPTS`, then the dead-letter list),
so a fault that never clears for one job (a broken object) cannot keep it going round for ever.

The job's record keeps `store_fault_since` (epoch seconds) and `store_retries`; a requeued dead
letter starts again without them (shared/records.py `reset_attempts`).
"""

from __future__ import annotations

# KEYS[1] the job's record; ARGV: now (epoch seconds), the budget (seconds), the record's TTL.
# Returns the retries so far, this one included (the attempt given back), or -1 past the budget.
SCRIPT = """
redis.call('HSETNX', KEYS[1], 'store_fault_since', ARGV[1])
local since = tonumber(redis.call('HGET', KEYS[1], 'store_fault_since')) or tonumber(ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if tonumber(ARGV[1]) - since >= tonumber(ARGV[2]) then return -1 end
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return redis.call('HINCRBY', KEYS[1], 'store_retries', 1)
"""

FIELDS = ("store_fault_since", "store_retries")


def waited_out(record: dict[str, str], now: float, budget_s: float) -> int:
    """SCRIPT on a record held in memory (shared/memory_records.py), changing it the same way."""
    record.setdefault("store_fault_since", repr(now))
    if now - float(record["store_fault_since"]) >= budget_s:
        return -1
    record["attempts"] = str(int(record.get("attempts", "0")) - 1)
    record["store_retries"] = str(int(record.get("store_retries", "0")) + 1)
    return int(record["store_retries"])
