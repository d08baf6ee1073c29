"""In-process twin of the Redis job records, for unit tests: the same operations on dicts and lists."""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from typing import Any

from shared import backlog_share, ops_counts, pushes, store_faults
from shared import usage as usage_book
from shared.jobs import State
from shared.records import CLAIM_TTL_S, read_answer


class MemoryJobRecords:
    """In-process twin of RedisJobRecords (shared/records.py)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, str]] = {}
        self.answers: dict[str, str] = {}  # kept for good here: a test's records live minutes
        self.dlq: list[dict[str, object]] = []  # oldest first
        self.processing: list[str] = []
        self.events: list[dict[str, str]] = []
        self._event_ids: list[int] = []  # each kept event's id (a count that never goes back, as XADD's)
        self.usage: dict[str, dict[str, int]] = {}  # per key, as shared/usage.py totals() reads them
        self.held: dict[str, set[str]] = {}  # owner -> backlog jobs held (shared/backlog_share.py)
        self.claims: dict[str, float] = {}  # backlog claims taking room: job id -> when their lease ends
        self.claims_ahead: set[str] = set()  # of them, those bound for the ahead list
        self.claim_ttl_s = float(CLAIM_TTL_S)
        self._lock = threading.Lock()
        self._event_added = threading.Condition(self._lock)  # events_after's block, as XREAD's

    def pushed(self, push_id: str) -> bool:
        return False  # no broker here: nothing is ever pushed through these records

    def look(self, job_id: str) -> tuple[dict[str, str], str]:
        """No broker here: a published job's message is taken to be where its push put it."""
        record = self.get(job_id)
        return record, pushes.HELD if record.get("published") == "1" else ""

    def replicas(self, wanted: int, timeout_ms: int) -> int:
        return wanted  # one process: nothing to wait for

    def claim(
        self, job_id: str, lane: str, fingerprint: str = "", limit: int | None = None, shares: bool = True
    ) -> str | None:
        if lane == "backlog" and limit is not None:
            taken = self.claim_backlog(job_id, fingerprint, limit, shares)
            return None if taken is None else taken[0]
        with self._lock:
            return None if job_id in self.records else self._new_claim(job_id, lane, fingerprint)

    def claim_backlog(
        self, job_id: str, fingerprint: str, limit: int, shares: bool = True, ahead_most: int = 0
    ) -> tuple[str, backlog_share.Room] | None:
        with self._lock:
            if job_id in self.records:
                return None
            room = self._room(backlog_share.owner_of(job_id), limit, shares)
            if room.room <= 0:
                raise backlog_share.NoRoom(room)
            self.claims[job_id] = time.monotonic() + self.claim_ttl_s
            if room.keys > 1 and room.held < ahead_most and room.ahead < ahead_most:
                self.claims_ahead.add(job_id)
                room = dataclasses.replace(room, bound_ahead=True)
            return self._new_claim(job_id, "backlog", fingerprint), room

    def _new_claim(self, job_id: str, lane: str, fingerprint: str) -> str:
        token = secrets.token_hex(8)
        self.records[job_id] = {
            "state": "queued", "lane": lane, "fingerprint": fingerprint, "published": "0", "claim": token
        }  # fmt: skip
        return token

    def _holds(self, job_id: str, token: str) -> bool:
        return self.records.get(job_id, {}).get("claim") == token

    def renew(self, job_id: str, token: str) -> bool:
        with self._lock:
            if not (self._holds(job_id, token) and self.records[job_id].get("published") == "0"):
                return False
            if job_id in self.claims:
                self.claims[job_id] = time.monotonic() + self.claim_ttl_s
            return True

    def confirm(self, job_id: str, token: str, checked: bool = True) -> bool:
        with self._lock:
            if not self._holds(job_id, token):
                return False
            record = self.records[job_id]
            record.pop("claim", None)
            record.update(published="1", checked="1" if checked else "0")
            self._let_go(job_id)
            self._hold(job_id)
            return True

    def _hold(self, job_id: str) -> None:
        record = self.records.get(job_id, {})
        if record.get("lane") == "backlog" and record.get("state") not in ("succeeded", "failed"):
            self.held.setdefault(backlog_share.owner_of(job_id), set()).add(job_id)

    def hold_backlog(self, job_id: str) -> None:
        with self._lock:
            self._hold(job_id)

    def backlog_room(self, owner: str, limit: int, shares: bool = True) -> backlog_share.Room:
        """As shared/backlog_share.py decides it, over the jobs held and claimed here (no queues: the
        depth is the claims')."""
        with self._lock:
            return self._room(owner, limit, shares)

    def _room(self, owner: str, limit: int, shares: bool) -> backlog_share.Room:
        now = time.monotonic()
        for job_id in [job_id for job_id, until in self.claims.items() if until <= now]:
            self._let_go(job_id)
        jobs = {who: len(held) for who, held in self.held.items()}
        for job_id in self.claims:
            jobs[backlog_share.owner_of(job_id)] = jobs.get(backlog_share.owner_of(job_id), 0) + 1
        depth, mine = len(self.claims), jobs.get(owner, 0)
        others = sum(1 for who, n in jobs.items() if who != owner and n)
        ahead = len(self.claims_ahead)  # no queues here: the claims bound for the ahead list
        if others == 0 or not shares:
            return backlog_share.Room(limit - depth, depth, mine, others + 1, depth, ahead)
        share = -(-limit // (others + 1))
        return backlog_share.Room(min(share - mine, 2 * limit - depth), depth, mine, others + 1, depth, ahead)

    def _let_go(self, job_id: str) -> None:
        self.claims.pop(job_id, None)
        self.claims_ahead.discard(job_id)

    def release(self, job_id: str, token: str) -> None:
        with self._lock:
            if self._holds(job_id, token) and self.records[job_id].get("published") == "0":
                del self.records[job_id]
                self._let_go(job_id)

    def set_state(self, job_id: str, state: State, *, answer: str | None = None, **fields: str) -> None:
        with self._lock:
            self.records.setdefault(job_id, {}).update({"state": state, **fields})
            if answer is not None:
                self.answers[job_id] = answer
            else:
                self.answers.pop(job_id, None)
            if state in ("succeeded", "failed"):
                self.held.get(backlog_share.owner_of(job_id), set()).discard(job_id)

    def get(self, job_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self.records.get(job_id, {}))

    def get_with_answer(self, job_id: str) -> tuple[dict[str, str], dict[str, Any] | None]:
        record = self.get(job_id)  # as a subclass reads it (tests' records that fail)
        with self._lock:
            return read_answer(record, self.answers.get(job_id))

    def dead_letter(self, entry: dict[str, object]) -> None:
        with self._lock:
            self.dlq.append(dict(entry))

    def begin(self, job_id: str) -> int:
        with self._lock:
            record = self.records.setdefault(job_id, {})
            attempts = int(record.get("attempts", "0")) + 1
            record.update({"state": "running", "attempts": str(attempts)})
            return attempts

    def get_many(self, job_ids: list[str]) -> list[dict[str, str]]:
        return [self.get(job_id) for job_id in job_ids]

    def begin_many(self, job_ids: list[str], worker: str = "") -> list[int]:
        attempts = [self.begin(job_id) for job_id in job_ids]
        with self._lock:
            for job_id in job_ids:
                self.records[job_id]["worker"] = worker
        return attempts

    def solo_run(self, job_id: str) -> int:
        with self._lock:
            record = self.records.setdefault(job_id, {})
            earlier = int(record.get("solo_runs", "0"))
            record.update(solo_runs=str(earlier + 1), suspect_group="1")
            return earlier

    def withdraw_solo_run(self, job_id: str) -> None:
        with self._lock:
            record = self.records.setdefault(job_id, {})
            record["solo_runs"] = str(int(record.get("solo_runs", "0")) - 1)

    def suspect_group(self, job_ids: list[str], size: int) -> None:
        with self._lock:
            for job_id in job_ids:
                self.records.setdefault(job_id, {})["suspect_group"] = str(size)

    def reset_attempts(self, job_id: str, push_id: str) -> None:
        with self._lock:
            record = self.records.setdefault(job_id, {})
            record.update(
                {"attempts": "0", "solo_runs": "0", "state": "queued", "published": "1", "push": push_id}
            )
            record.pop("usage_counted", None)
            record.pop("suspect_group", None)
            self.answers.pop(job_id, None)
            for field in store_faults.FIELDS:
                record.pop(field, None)
            self._hold(job_id)

    def store_fault(self, job_id: str, budget_s: float) -> int:
        with self._lock:
            return store_faults.waited_out(self.records.setdefault(job_id, {}), time.time(), budget_s)

    def count_usage(
        self,
        job_id: str,
        api_key: str | None,
        usage: dict[str, int],
        cache_hit: bool,
        done: ops_counts.Finished | None = None,  # the ops page's counts live in Redis only
    ) -> bool:
        args = usage_book.count_args(api_key, usage, cache_hit)
        with self._lock:
            record = self.records.get(job_id)
            if record is not None:
                if record.get("usage_counted") == "1":
                    return False
                fields = dict(
                    zip(usage_book.RECORD_FIELDS, (args[1], args[2], args[3], args[5], args[6]), strict=True)
                )
                record.update({"usage_counted": "1", **{k: str(v) for k, v in fields.items()}})
            key = str(args[0])
            counts = self.usage.setdefault(key, {})
            for kind, value in zip(("prompt_tokens", "image_tokens", "completion_tokens", "total_tokens",
                                    "cache_hits"), args[1:6], strict=True):  # fmt: skip
                counts[kind] = counts.get(kind, 0) + int(value)
            counts["jobs"] = counts.get("jobs", 0) + 1
            return True

    def list_lengths(self, keys: list[str]) -> int:
        return 0  # no queues in process

    def dead_letters(self, limit: int = 100) -> list[dict[str, object]]:
        with self._lock:
            return [dict(e) for e in reversed(self.dlq[-limit:])]

    def dead_letter_count(self) -> int:
        with self._lock:
            return len(self.dlq)

    def take_dead_letter(self) -> str | None:
        with self._lock:
            if not self.dlq:
                return None
            raw = json.dumps(self.dlq.pop(0))
            self.processing.append(raw)
            return raw

    def ack_dead_letter(self, raw: str) -> None:
        with self._lock:
            self.processing.remove(raw)

    def return_dead_letter(self, raw: str, oldest: bool = True) -> None:
        with self._lock:
            self.processing.remove(raw)
            entry = json.loads(raw)
            if oldest:
                self.dlq.insert(0, entry)
            else:
                self.dlq.append(entry)

    def recover_dead_letters(self) -> int:
        with self._lock:
            moved = [json.loads(raw) for raw in self.processing]
            self.processing.clear()
            self.dlq[:0] = moved
            return len(moved)

    def purge_dead_letters(self) -> int:
        with self._lock:
            count = len(self.dlq)
            self.dlq.clear()
            return count

    def add_event(self, event: dict[str, str], keep: int) -> str:
        with self._lock:
            number = (self._event_ids[-1] if self._event_ids else 0) + 1
            self.events.append(dict(event))
            self._event_ids.append(number)
            del self.events[:-keep], self._event_ids[:-keep]
            self._event_added.notify_all()
            return f"{number}-0"

    def events_after(self, after: str, block_s: float = 0.0, count: int = 1000) -> list[dict[str, str]]:
        start = int(after.split("-")[0])
        with self._lock:
            if block_s > 0:
                self._event_added.wait_for(lambda: self._newest_event() > start, timeout=block_s)
            pairs = zip(self._event_ids, self.events, strict=True)
            return [{"id": f"{n}-0", **e} for n, e in pairs if n > start][:count]

    def events_tail(self) -> str:
        with self._lock:
            return f"{self._newest_event()}-0"

    def _newest_event(self) -> int:
        return self._event_ids[-1] if self._event_ids else 0
