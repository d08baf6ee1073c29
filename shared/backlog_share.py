"""Each key's share of the backlog lane: one key's big batch no longer fills the lane for every other.

The lane has one depth limit (MRC_BACKLOG_MAX_DEPTH). While one key (or the keyless command line) has
work in it, that key may fill it, as before. Once several have, each may hold up to the limit divided
by their number, and one under its share is let in even while the lane is full of another's jobs: the
other's feeder stops until it is back under its own share, so the lane's throughput is shared by the
keys with work in it, and a key's single submissions are not refused 503 because another's batch
holds the lane. The lane then holds at most twice the limit while the shares settle.

What is counted is a key's backlog jobs *held*: queued, and not yet ended (`succeeded` or `failed`).
A job is held when it is queued (in the run's enqueue step, once a single submission is confirmed,
when a dead letter is requeued or a lost message pushed again) and let go in the same step that
writes its end; a pop, a retry or a restore of a dead worker's messages moves no count (the job is
still held, and a hold is kept once per job), so nothing in the transport has to keep a count exact.
A job held past HELD_MAX_AGE_S is let go at the next look (a record lost with Redis's data, a job
purged by hand): a lost count opens the lane, it never shuts a key out.

A single submission takes its room in the step that claims its job id (CLAIM_LUA): its claim counts
in the lane's depth and in its owner's jobs until its confirm holds the job or its release (or its
lease, CLAIM_TTL_S) lets it go, so submissions at once get no more room than the lane has, however
many producers send them (before, each looked at the room and then claimed: forty at once held twelve
against a share of ten, and passed the depth alike; review, helper-103).

Redis holds a sorted set (`"<owner> <job id>"` -> when held), a hash (owner -> jobs held) and a sorted
set of the claims taking room (`"<owner> <job id>"` -> when their lease ends; `"<owner> <job id> ^"`
for a claim bound for the lane's ahead list, which counts against the ahead list's cap until its
confirm), written only by the scripts below. Owner: the key's 12 hex (shared/tenants.py), `-` for a
job without one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from shared import names, tenants

HELD_MAX_AGE_S = 24 * 3600  # a backlog job held this long without an end is taken for lost
NO_KEY = "-"
_PRUNE_AT_ONCE = 200
AHEAD_MARK = " ^"  # ends the member of a claim bound for the ahead list

# room(zset, counts, claims, owner, now, max_age, limit, depth, shared) -> {room, held by owner, keys
# with work, depth, claims, claims bound for the ahead list}. Let go of what is held past max_age (a few
# at a time) and of claims past their lease; the claims taking room count in the depth and in their
# owners' jobs. Then: alone (no other owner holds a job) or with shares off (MRC_BACKLOG_KEY_SHARES=
# false), the room left under the limit; shared, the least of what is left of the owner's share and of
# twice the limit.
# A claim's lease is read on Redis's clock (claim_now), never a producer's: a producer whose clock ran
# 40 s ahead let go of every other producer's claims, and one 40 s behind made its own look lapsed to
# all the others (review, helper-105). Holds (24 h) take the producer's clock: seconds do not matter.
ROOM_LUA = f"""
local function claim_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function backlog_room(zset, counts, claims, owner, now, max_age, limit, depth, shared)
  local old = redis.call('ZRANGEBYSCORE', zset, '-inf', now - max_age, 'LIMIT', 0, {_PRUNE_AT_ONCE})
  for _, member in ipairs(old) do
    redis.call('ZREM', zset, member)
    local who = string.match(member, '^(%S+) ')
    if who and redis.call('HINCRBY', counts, who, -1) <= 0 then redis.call('HDEL', counts, who) end
  end
  redis.call('ZREMRANGEBYSCORE', claims, '-inf', claim_now())
  local jobs, claimed, ahead = {{}}, 0, 0
  for _, member in ipairs(redis.call('ZRANGE', claims, 0, -1)) do
    local who = string.match(member, '^(%S+) ')
    if who then jobs[who] = (jobs[who] or 0) + 1; claimed = claimed + 1 end
    if string.sub(member, -2) == '{AHEAD_MARK}' then ahead = ahead + 1 end
  end
  depth = depth + claimed
  local held = redis.call('HGETALL', counts)
  for i = 1, #held, 2 do jobs[held[i]] = (jobs[held[i]] or 0) + tonumber(held[i + 1]) end
  local others, mine = 0, jobs[owner] or 0
  for who, n in pairs(jobs) do
    if who ~= owner and n > 0 then others = others + 1 end
  end
  if others == 0 or not shared then return {{limit - depth, mine, others + 1, depth, claimed, ahead}} end
  local share = math.ceil(limit / (others + 1))
  return {{math.min(share - mine, 2 * limit - depth), mine, others + 1, depth, claimed, ahead}}
end
local function backlog_hold(zset, counts, owner, job_id, now)
  if redis.call('ZADD', zset, 'NX', now, owner .. ' ' .. job_id) == 1 then
    redis.call('HINCRBY', counts, owner, 1)
  end
end
"""

# Where the lane's ahead list is among its lists as the scripts get them (names.queue_keys' order).
_AHEAD_AT = names.queue_keys("backlog").index(
    names.priority_list(names.queue_name("backlog"), names.AHEAD_STEP)
)

# KEYS[1] zset, KEYS[2] counts, KEYS[3] claims, KEYS[4..] the lane's lists; ARGV owner, now, max_age,
# limit, shared. -> {room, depth, held, keys, claims, jobs on the ahead list}
_ROOM_SCRIPT = (
    ROOM_LUA
    + """
local depth = 0
for i = 4, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
local r = backlog_room(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                       tonumber(ARGV[4]), depth, ARGV[5] == '1')
return {r[1], r[4], r[2], r[3], r[5], redis.call('LLEN', KEYS[4 + AHEAD_AT]) + r[6]}
""".replace("AHEAD_AT", str(_AHEAD_AT))
)
# KEYS[1] the job's hash, KEYS[2] zset, KEYS[3] counts, KEYS[4] claims, KEYS[5..] the lane's lists; ARGV
# ttl, lane, submitted_at, fingerprint, claim token, owner, now, max_age, limit ('': none), shared, job
# id, ahead list's cap (MRC_BACKLOG_AHEAD_JOBS). A claim (shared/records.py) that takes its room in the
# same step on the backlog lane: {1, room, depth, held, keys, claims, ahead, bound ahead} claimed (the
# room as it was before it; {1} off the backlog, and for a claim of its own sent again), {0} the id is
# taken, {-1, room, ...} no room for it now (nothing written). `ahead` counts the list and the claims
# bound for it; a claim is bound for it (1) while another owner has jobs in the lane, its owner holds
# fewer than the cap, and fewer than the cap are ahead: decided here, so submissions at once never
# put more there than the cap (each read the list's length alone before: four keys' bursts of eight
# put 9 and 12 there against 8; review, helper-108).
CLAIM_LUA = (
    ROOM_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'claim') == ARGV[5] then return {1} end
  return {0}
end
local room = {1}
if ARGV[2] == 'backlog' and ARGV[9] ~= '' then
  local depth = 0
  for i = 5, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
  local r = backlog_room(KEYS[2], KEYS[3], KEYS[4], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]),
                         tonumber(ARGV[9]), depth, ARGV[10] == '1')
  local ahead = redis.call('LLEN', KEYS[5 + AHEAD_AT]) + r[6]
  if r[1] <= 0 then return {-1, r[1], r[4], r[2], r[3], r[5], ahead} end
  local most = tonumber(ARGV[12])
  local bound = (r[3] > 1 and r[2] < most and ahead < most) and 1 or 0
  local member = ARGV[6] .. ' ' .. ARGV[11] .. (bound == 1 and 'AHEAD_MARK' or '')
  redis.call('ZADD', KEYS[4], claim_now() + tonumber(ARGV[1]), member)
  room = {1, r[1], r[4], r[2], r[3], r[5], ahead, bound}
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'lane', ARGV[2], 'submitted_at', ARGV[3],
           'fingerprint', ARGV[4], 'published', '0', 'claim', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return room
""".replace("AHEAD_AT", str(_AHEAD_AT)).replace("AHEAD_MARK", AHEAD_MARK)
)
# KEYS[1] the job's hash, KEYS[2] zset, KEYS[3] counts; ARGV owner, job id, now. A backlog job queued
# again (a dead letter requeued, a lost message pushed again) is held, unless it has ended.
HOLD_SCRIPT = (
    ROOM_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'lane') == 'backlog' and state ~= 'succeeded' and state ~= 'failed' then
  backlog_hold(KEYS[2], KEYS[3], ARGV[1], ARGV[2], tonumber(ARGV[3]))
end
return 1
"""
)
# KEYS[1] zset, KEYS[2] counts; ARGV owner, job id. Idempotent: a job let go twice counts once.
RELEASE_SCRIPT = """
if redis.call('ZREM', KEYS[1], ARGV[1] .. ' ' .. ARGV[2]) == 1 then
  if redis.call('HINCRBY', KEYS[2], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
end
return 1
"""


@dataclass(frozen=True)
class Room:
    """What the lane has room for, for one owner: `room` jobs (0 or less: none now)."""

    room: int
    depth: int  # jobs waiting in the lane, and those being queued (their claims)
    held: int  # the owner's jobs held (queued or running) or being queued
    keys: int  # owners with work in the lane, this one included
    claims: int = 0  # of `depth`, the jobs being queued now (claimed, not yet in the lane)
    ahead: int = 0  # the jobs on the lane's ahead list (shared/names.py AHEAD_STEP) and bound for it
    bound_ahead: bool = False  # a claim's: its job goes on the ahead list (decided in its claim step)

    def ahead_for(self, most: int) -> int:
        """How many of the owner's next jobs go on the lane's ahead list (MRC_BACKLOG_AHEAD_JOBS =
        `most`): while another owner has backlog jobs, as many as keep this one under `most` held and
        the ahead list under `most` in all. The second bound keeps a few light keys from starving a
        big batch (review, helper-107: four keys holding 8 each left it 6 % of the jobs ended): a
        worker's batch takes at most `most` of its jobs from the ahead list."""
        return max(0, min(most - self.held, most - self.ahead)) if self.keys > 1 else 0

    def refusal(self, limit: int, shares: bool = True, owner: str = "") -> str:
        """Why there is no room, after "the backlog lane holds N jobs; the limit is L": the jobs being
        queued now among them (claims no view of the lane shows: review, helper-105), and while keys
        share the lane, the owner's share, or the lane at twice its limit where that is what stops an
        owner under its share (it said the share alone: review, helper-105)."""
        said = [f"{self.claims} of them being queued now"] if self.claims else []
        if self.keys > 1 and shares:
            share = -(-limit // self.keys)  # rounded up, as the scripts do
            who = "the command line (its runs, no key, count as one)" if owner == NO_KEY else "this key"
            said.append(
                f"the lane is shared by the {self.keys} keys with work in it (queued or running): {who} "
                f"holds {self.held} jobs, its share is {share}"
            )
            if self.room <= 0 and self.held < share:
                said.append(f"the lane holds twice its limit while the shares settle (at most {2 * limit})")
        return "; ".join(said)


def owner_of(job_id: str) -> str:
    return tenants.owner_of(job_id) or NO_KEY


class NoRoom(Exception):
    """A backlog claim found no room for its job (nothing was written): `room` says why."""

    def __init__(self, room: Room) -> None:
        super().__init__(f"no room on the backlog lane: {room}")
        self.room = room


def keys() -> list[str]:
    """The keys every script here takes first, in this order: held, counts, claims."""
    return [names.backlog_held_key(), names.backlog_held_counts_key(), names.backlog_claims_key()]


def claim_member(job_id: str) -> str:
    """A claim's member in the claims' set (one bound for the ahead list adds AHEAD_MARK)."""
    return f"{owner_of(job_id)} {job_id}"


def room_call(owner: str, limit: int, shared: bool = True) -> tuple[str, list[str], list[str | float | int]]:
    """(script, keys, args) of a look at the room for `owner` (it lets go of what is held too long)."""
    args: list[str | float | int] = [owner, time.time(), HELD_MAX_AGE_S, limit, "1" if shared else "0"]
    return _ROOM_SCRIPT, [*keys(), *names.queue_keys("backlog")], args


def hold_call(job_id: str) -> tuple[str, list[str], list[str | float]]:
    """(script, keys, args) holding a backlog job queued again, unless it ended."""
    return HOLD_SCRIPT, [names.job_key(job_id), *keys()], [owner_of(job_id), job_id, time.time()]


def release_call(job_id: str) -> tuple[str, list[str], list[str]]:
    return RELEASE_SCRIPT, keys(), [owner_of(job_id), job_id]


def held(client: redis.Redis) -> dict[str, int]:
    """Each owner's backlog jobs held now, those being queued (their claims) included: they take room
    as the held ones do, and views that left them out showed a lane with room that refused (review,
    helper-105). Owners holding none are absent."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(names.backlog_held_counts_key())
        pipe.time()
        pipe.zrange(names.backlog_claims_key(), 0, -1, withscores=True)
        counts, (seconds, micros), claims = pipe.execute()
    owners = {str(owner): int(n) for owner, n in counts.items()}
    for member, until in claims:
        if float(until) > seconds + micros / 1e6:  # its lease, on Redis's clock as the scripts read it
            who = str(member).split(" ", 1)[0]
            owners[who] = owners.get(who, 0) + 1
    return {owner: n for owner, n in sorted(owners.items()) if n > 0}


def share_each(held_by_key: dict[str, int], limit: int, shares: bool) -> int | None:
    """Each key's share of the lane now, or None while one key (or none) holds its jobs, or shares are
    off: the depth limit alone then decides."""
    keys = sum(1 for count in held_by_key.values() if count > 0)
    return -(-limit // keys) if shares and keys > 1 else None


def room_from(reply: list[int]) -> Room:
    """The Room a script answered: {room, depth, held, keys, claims, ahead[, bound ahead]}."""
    room, depth, held, count, claims, ahead, *bound = (int(x) for x in reply)
    return Room(room, depth, held, count, claims, ahead, bool(bound and bound[0]))
