"""A prefix index shared by several router replicas through Redis, read synchronously from a local mirror.

``pick()`` never awaits, so each replica keeps a :class:`~kvindex.memory.MemoryPrefixIndex` *mirror*
that ``match`` reads, and Redis is the shared store: writes (``record``/``stored``/``removed``/
``cleared``/``drop_slot``) go to the mirror at once and into a bounded queue that a background task
flushes in batches (one script call each, pipelined when there are several); ``await lookup(...)``
(called by the request adapter *before* the pick, where I/O is allowed) asks Redis in one round
trip and copies what it learned into the mirror, so the following synchronous ``match`` sees other
replicas' blocks.

With ``push`` each flush is also published, as written (op by op, a prompt's keys in order), on the
channel ``<ns>:w``, and every replica applies the others' to its mirror as they come. Once nothing
Redis holds predates this replica's subscription (Redis held no block when it subscribed, or one
``ttl_s`` has passed since: every older entry has expired or been written again, and so pushed),
``lookup`` answers from the mirror without a round trip (``pushed``). A lost subscription or a
Redis outage (pushes may have been missed) starts that wait again. Redis stays the shared store:
new replicas and the outage resync read it. TTL expiry is not pushed: a mirror keeps a block until
its own LRU, a clear or a removal drops it, as a single replica's index does.

Endpoints are *slots* locally but slots differ between replicas, so Redis only ever sees stable
endpoint NAMES (``slot_names``/``slot_of`` translate).

Redis layout (standalone or Sentinel Redis; the scripts touch keys they are not passed, so not
Cluster), ``<ns>`` = ``namespace``:

* ``<ns>:b:<8 bytes>`` -> HASH ``{endpoint name: generation}``, one key per block. The block key is
  the raw big-endian uint64 (binary-safe keys: 14 bytes instead of 26 as decimal, and Lua slices
  the request blob instead of formatting numbers). Each write refreshes the key's TTL (``ttl_s``),
  so a block nobody wrote for ``ttl_s`` disappears: key count <= ttl x distinct-block write rate,
  and fields per key <= endpoints. A replica fed whole prompts does not write again a block it
  wrote for the same endpoint less than ``rewrite_after_s`` ago (``RecentWrites``; it sends it
  with the generation it was written under, written again only if that changed): a shared system
  prompt or a conversation's history, carried by every request, costs Redis one write per block per
  ``rewrite_after_s`` instead of one per request, and its TTL still never lapses while it is used.
* ``<ns>:gen:<name>`` -> STRING, the endpoint's current generation. A HASH field counts only when
  its value equals it, so ``cleared`` is ONE ``INCR`` and stale fields are skipped on read (and
  dropped with their key's TTL). Created on first write as ``TIME`` in µs (never reused, even after
  the gen key itself expires or Redis restarts empty, so old fields cannot come back to life); TTL
  refreshed on every write of that endpoint, so an endpoint silent for ``ttl_s`` vanishes at once.
  A HASH (rather than a SET of ``name@gen`` members) keeps one field per endpoint: re-recording
  after a clear overwrites the stale field instead of adding a second member.

  Known approximation: the TTL is per block key, not per (block, endpoint): an endpoint's field on
  a block that *other* endpoints keep writing lives as long as the key (per-field TTL needs Redis
  >= 7.4 ``HPEXPIRE``). The precise path removes such fields explicitly (``removed``).

* ``<ns>:w`` -> pub/sub channel (with ``push``): one message per flush, the sender's 4-byte id, the
  bisect flag, then per op its kind (``a``/``d``/``c``), name length and key count (``>HI``), the
  name and the big-endian keys.

Memory, measured on Redis 7.0.15 (jemalloc, ``used_memory`` delta over 102,400 blocks, see
``python -m loadtests.bench.redis_index``): **~150 bytes per block held by one endpoint** (14-byte key,
listpack HASH, dict and expiry entries), **+16 bytes per extra endpoint** on the same block.

Lookup cost (``python -m loadtests.bench.redis_index``: 256-block prompt, 64 candidates, loopback,
PING p50 ~0.1 ms), p50 walking every block → bisecting: ~0.26 ms either way when nobody holds block
0; 0.84 → 0.29 ms when 4 endpoints hold the whole prompt; 3.96 → 0.33 ms when all 64 do; 2.4 →
1.7 ms when each of the 64 holds a prefix of a different length (the bisection hands over to the
walk there). The walk's cost is Redis CPU (an HGETALL per block of the longest match); the
bisection, for an index fed whole prompts (a mirror made with ``whole_prompts``, as the router's;
the first ``stored`` or ``removed`` makes it walk for good), needs a few per distinct depth.

Redis going away: every call is bounded by ``asyncio.timeout`` (``lookup_timeout_s`` for lookups,
``write_timeout_s`` for flushes), so the client's own retry/backoff can never stall a request. On a
connection error or timeout the index goes LOCAL-ONLY (``healthy`` False, one warning): lookups
answer from the mirror, writes stay queued up to ``max_pending`` blocks (the oldest dropped and
counted beyond that). A probe PINGs every ``probe_interval_s``; once Redis answers, the queue is
flushed and — if Redis restarted (``run_id`` changed) or writes were dropped — the whole mirror is
pushed back for every endpoint this replica knows, then shared mode resumes (one info line).

Suggested client: ``redis.asyncio.Redis(..., retry=Retry(NoBackoff(), 0))`` (a retry inside a 50 ms
budget only wastes it; the probe is the retry) with ``decode_responses`` left False (checked).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.aio import follow_channel, stop_task
from kvindex.memory import MemoryPrefixIndex

log = logging.getLogger(__name__)

# Errors that mean "Redis is not there" (switch to local-only) as opposed to a command error.
_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    TimeoutError,
    OSError,
)

_ADD = b"a"
_ADD_IF_CLEARED = b"f"  # + the generation the blocks were written under
_DEL = b"d"
_CLEAR = b"c"

# ARGV: block-key prefix, gen-key prefix, blob of 8-byte big-endian block keys, "\n"-joined names,
# "1" to bisect. Returns {depths, gens} as two comma-joined strings (two bulk replies parse far
# faster in redis-py than 2 x 64 array elements): per name the longest consecutive prefix whose
# field equals the name's current generation, and that generation ("" when it holds nothing).
#
# The walk probes block after block until no name is left: exact on any index, one HGETALL per
# block of the longest match (256 for a shared 4k-token prompt). The bisection, for an index fed
# whole prompts only (see ``SharedPrefixIndex``), relies on a name's holders only shrinking along
# the prompt: it probes the first and last blocks and splits only intervals whose ends differ,
# about (distinct depths) x log2(blocks) probes; past 8 pending intervals it hands over to the walk.
_LOOKUP_LUA = """
local bp, gp, blob = ARGV[1], ARGV[2], ARGV[3]
local n = #blob / 8
local depth, gens, want, pos = {}, {}, {}, {}
local alive, k = 0, 0
for name in string.gmatch(ARGV[4], '[^\\n]+') do
  k = k + 1
  local g = redis.call('GET', gp .. name)
  depth[k] = 0
  gens[k] = g or ''
  if g and not want[name] then
    want[name] = g
    pos[name] = k
    alive = alive + 1
  end
end

-- The names of ``among`` holding block i (1-based) under their current generation, and how many.
local function holders(i, among)
  local fv = redis.call('HGETALL', bp .. string.sub(blob, 8 * i - 7, 8 * i))
  local got, c = {}, 0
  for f = 1, #fv, 2 do
    local name = fv[f]
    if among[name] and want[name] == fv[f + 1] then
      got[name] = true
      c = c + 1
    end
  end
  return got, c
end

local function walk()
  local left, count, i = {}, alive, 0
  for name in pairs(want) do left[name] = true end
  while count > 0 and i < n do
    i = i + 1
    local hit, seen = holders(i, left)
    if seen < count then
      for name in pairs(left) do
        if not hit[name] then depth[pos[name]] = i - 1 end
      end
      left, count = hit, seen
    end
  end
  for name in pairs(left) do depth[pos[name]] = n end
end

local function bisect()
  local all = {}
  for name in pairs(want) do all[name] = true end
  local first, fc = holders(1, all)
  if fc == 0 then return true end
  local last, lc = first, fc
  if n > 1 then last, lc = holders(n, first) end
  for name in pairs(last) do depth[pos[name]] = n end
  local todo = {}
  if lc < fc then todo[1] = {1, first, fc, n, last, lc} end
  while #todo > 0 do
    local t = table.remove(todo)
    local lo, lo_set, lo_c, hi, hi_set, hi_c = t[1], t[2], t[3], t[4], t[5], t[6]
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local m, mc = holders(mid, lo_set)
      if mc == lo_c then
        lo = mid
      else
        if mc ~= hi_c then
          if #todo == 8 then return false end
          todo[#todo + 1] = {mid, m, mc, hi, hi_set, hi_c}
        end
        hi, hi_set, hi_c = mid, m, mc
      end
    end
    for name in pairs(lo_set) do
      if not hi_set[name] then depth[pos[name]] = lo end
    end
  end
  return true
end

if alive > 0 and n > 0 and not (ARGV[5] == '1' and bisect()) then walk() end
return {table.concat(depth, ','), table.concat(gens, ',')}
"""

# ARGV: block-key prefix, gen-key prefix, ttl ms, then (op, name, blob) triples; op a/d/c, or f<gen>:
# blocks this replica wrote lately under generation <gen>, written again only if the endpoint's
# generation is no longer <gen> (another replica cleared it meanwhile). Returns the generation each
# add wrote under ("" for other ops).
_APPLY_LUA = """
local bp, gp, ttl = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for j = 4, #ARGV, 3 do
  local op, name, blob = ARGV[j], ARGV[j + 1], ARGV[j + 2]
  local gk = gp .. name
  local g = ''
  if op == 'c' then
    if redis.call('EXISTS', gk) == 1 then redis.call('INCR', gk) end
  elseif op == 'a' or string.sub(op, 1, 1) == 'f' then
    g = redis.call('GET', gk)
    if op == 'a' or g ~= string.sub(op, 2) then
      if not g then
        -- string concat, not arithmetic: Lua numbers are doubles and would print as 1.7e+15
        local t = redis.call('TIME')
        g = t[1] .. string.format('%06d', tonumber(t[2]))
        redis.call('SET', gk, g)
      end
      redis.call('PEXPIRE', gk, ttl)
      for i = 1, #blob, 8 do
        local k = bp .. string.sub(blob, i, i + 7)
        redis.call('HSET', k, name, g)
        redis.call('PEXPIRE', k, ttl)
      end
    end
  else
    for i = 1, #blob, 8 do redis.call('HDEL', bp .. string.sub(blob, i, i + 7), name) end
  end
  out[#out + 1] = g
end
return out
"""


# One queued write: (endpoint name, _ADD | _DEL, uint64 block keys).
_Op = tuple[str, bytes, np.ndarray]


class RecentWrites:
    """The blocks this replica wrote to Redis lately, per endpoint name: a flush sends those written
    less than ``rewrite_after_s`` ago (their TTL has nearly all its life left) as one ``f<gen>`` op,
    which Redis turns into writes only if the endpoint's generation changed since.

    Without it every request rewrote its whole prompt: on a 4k-token prompt whose first 3k tokens are
    a shared system prompt, 256 HSET + PEXPIRE pairs where 64 are new, 0.7-0.9 ms of Redis CPU per
    request (a single-threaded Redis then caps the whole fleet near 1,100-1,400 requests/s).

    Two generations of sets, the younger becoming the older every ``rewrite_after_s / 2``: a key
    counts as written while it is in either, so it is left out for at most ``rewrite_after_s``.
    Beyond ``cap`` keys everything is forgotten (the next flushes write in full). A clear or a new
    generation seen here, and a Redis outage, ``forget``; a clear by another replica not seen yet
    is caught by Redis itself (the flush's ``f<gen>`` op)."""

    def __init__(self, rewrite_after_s: float, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._half = rewrite_after_s / 2
        self._cap = cap
        self._clock = clock
        self._younger: dict[str, set[int]] = {}
        self._older: dict[str, set[int]] = {}
        self._size = 0  # keys in both generations (one written twice counts twice)
        self._turn_at = clock() + self._half

    def split(self, name: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``keys`` (distinct) as (not written lately for ``name``, written lately), each in no
        particular order."""
        self._turn()
        younger, older = self._younger.get(name), self._older.get(name)
        if not younger and not older:
            return keys, keys[:0]
        given = set(keys.tolist())
        left = given.difference(*(held for held in (younger, older) if held))
        if len(left) == keys.shape[0]:
            return keys, keys[:0]
        lately = given - left
        return _array(left), _array(lately)

    def wrote(self, name: str, keys: np.ndarray) -> None:
        self._turn()
        younger = self._younger.setdefault(name, set())
        before = len(younger)
        younger.update(keys.tolist())
        self._size += len(younger) - before
        if self._size > self._cap:
            self.forget_all()

    def forget(self, name: str, keys: np.ndarray | None = None) -> None:
        """Forget ``keys`` of ``name`` (None: all of them): the next flush writes them again."""
        for generation in (self._younger, self._older):
            held = generation.get(name)
            if held is None:
                continue
            if keys is None:
                self._size -= len(held)
                del generation[name]
            else:
                before = len(held)
                held.difference_update(keys.tolist())
                self._size -= before - len(held)

    def forget_all(self) -> None:
        self._younger, self._older, self._size = {}, {}, 0

    def __len__(self) -> int:
        return self._size

    def _turn(self) -> None:
        now = self._clock()
        if now < self._turn_at:
            return
        # Idle for a whole generation or more: the younger keys are old enough to write again too.
        self._older = self._younger if now < self._turn_at + self._half else {}
        self._younger = {}
        self._size = sum(map(len, self._older.values()))
        self._turn_at = now + self._half


def _array(keys: set[int]) -> np.ndarray:
    return np.fromiter(keys, dtype=np.uint64, count=len(keys))


class _Calls:
    """Apply-script calls: (op, name, blob) triples, at most ``blocks`` keys per call."""

    def __init__(self, blocks: int, first: list[bytes | str]) -> None:
        self._blocks = blocks
        self._room = blocks
        self._current = first
        self._calls: list[list[bytes | str]] = []

    def add(self, op: bytes, name: str, keys: np.ndarray) -> None:
        start = 0
        while start < keys.shape[0]:
            take = keys[start : start + self._room]
            self._current += (op, name, take.astype(">u8").tobytes())
            start += take.shape[0]
            self._room -= take.shape[0]
            if self._room == 0:
                self._calls.append(self._current)
                self._current, self._room = [], self._blocks

    def done(self) -> list[list[bytes | str]]:
        return [*self._calls, self._current] if self._current else self._calls


class SharedPrefixIndex:
    """``PrefixIndex`` over a local mirror, replicated through Redis; see the module docstring.

    Counters for metrics: ``redis_errors`` (failed Redis calls of any kind), ``dropped_writes``
    (blocks dropped from the full write queue), ``fallback_lookups`` (lookups answered from the
    mirror because Redis was down or failed), ``resyncs`` (full mirror pushes after an outage).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        local: MemoryPrefixIndex,
        *,
        namespace: str = "pdr",
        ttl_s: float = 600.0,
        flush_interval_s: float = 0.005,
        max_pending: int = 100_000,
        slot_names: Callable[[int], str],
        slot_of: Callable[[str], int | None],
        lookup_timeout_s: float = 0.05,
        write_timeout_s: float = 1.0,
        probe_interval_s: float = 0.5,
        batch_blocks: int = 1024,
        push: bool = False,
        rewrite_after_s: float | None = None,  # None: a tenth of ttl_s, at most 30 s; 0: every time
        recent_writes_cap: int = 262_144,  # keys remembered (~20 MB), beyond which all are forgotten
        clock: Callable[[], float] = time.monotonic,  # what rewrite_after_s is measured on
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        if batch_blocks < 1:
            raise ValueError(f"batch_blocks: must be >= 1, got {batch_blocks}")
        if rewrite_after_s is None:
            rewrite_after_s = min(ttl_s / 10, 30.0)
        if not 0 <= rewrite_after_s <= ttl_s / 2:
            raise ValueError(f"rewrite_after_s: must be within 0..ttl_s/2, got {rewrite_after_s}")
        if recent_writes_cap < 1:
            raise ValueError(f"recent_writes_cap: must be >= 1, got {recent_writes_cap}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("client: needs decode_responses=False (the scripts return bytes)")
        self._client = client
        # redis-py's script objects run EVALSHA and load the source on NOSCRIPT (Redis restarted
        # empty, or SCRIPT FLUSH); queued in a pipeline, they are loaded before it is sent.
        self._lookup_script: AsyncScript = client.register_script(_LOOKUP_LUA)
        self._apply_script: AsyncScript = client.register_script(_APPLY_LUA)
        self._local = local
        # Redis may bisect a lookup while every write is a whole prompt's prefix (the mirror's own
        # rule); the KV-event path (``stored`` chunk by chunk, ``removed``) makes it walk for good.
        self._bisect = b"1" if local.whole_prompts else b"0"
        self._bp = f"{namespace}:b:".encode()
        self._gp = f"{namespace}:gen:".encode()
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._flush_interval_s = flush_interval_s
        self._max_pending = max_pending
        self._slot_names = slot_names
        self._slot_of = slot_of
        self._lookup_timeout_s = lookup_timeout_s
        self._write_timeout_s = write_timeout_s
        self._probe_interval_s = probe_interval_s
        self._batch_blocks = batch_blocks
        self._ttl_s = ttl_s
        # Push: each flush is also published on ``<ns>:w`` and every replica applies the others'
        # to its mirror, so once nothing in Redis predates the subscription a lookup needs no
        # round trip (``pushed``).
        self._push = push
        self._channel = f"{namespace}:w".encode()
        self._sender = secrets.token_bytes(4)
        self._warm_at: float | None = None  # monotonic time from which the mirror has it all
        self._listener: asyncio.Task[None] | None = None

        self._ops: deque[_Op] = deque()
        self._clears: dict[str, None] = {}  # names to INCR, applied before any queued op
        self._pending_blocks = 0
        # Queued or in-flight ops per name: while > 0 the mirror may know more than Redis.
        self._unflushed: Counter[str] = Counter()
        self._gens: dict[str, bytes] = {}  # name -> generation last seen in Redis
        self._recent = (
            RecentWrites(rewrite_after_s, recent_writes_cap, clock) if rewrite_after_s > 0 else None
        )
        self._known_slots: set[int] = set()  # slots whose mirror contents a resync pushes
        self._run_id: str | None = None
        self._dropped_when_down = 0
        self._flush_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_error_log = 0.0

        self.healthy = True
        self.redis_errors = 0
        self.dropped_writes = 0
        self.fallback_lookups = 0
        self.resyncs = 0
        self.pushed_lookups = 0  # lookups the pushed mirror answered without a round trip
        self.applied_pushes = 0  # other replicas' flushes applied to the mirror

    # -- PrefixIndex (synchronous, no I/O) ---------------------------------------------------

    def match(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The mirror's longest cached prefix per slot (see ``PrefixIndex.match``); no I/O."""
        return self._local.match(block_keys, slots)

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        """Approximate path: ``slot`` now holds these blocks (mirror now, Redis on the next flush)."""
        self._local.record(slot, block_keys)
        self._known_slots.add(slot)
        self._enqueue(self._slot_names(slot), _ADD, block_keys)

    def shrink(self, slot: int, blocks: int) -> None:
        """The local mirror only: Redis entries age out with their TTL, and other replicas learn
        the same from their own answers."""
        self._local.shrink(slot, blocks)

    def limit(self, slot: int, blocks: int | None) -> None:
        """The local mirror only, as ``shrink``: every replica scrapes the engines itself."""
        self._local.limit(slot, blocks)

    def drop_slot(self, slot: int) -> None:
        """Forget ``slot`` here and clear its endpoint in Redis for every replica.

        Call it while ``slot_names(slot)`` still resolves; if it no longer does, only the mirror
        forgets (the endpoint's Redis entries then age out with the TTL).
        """
        self._local.drop_slot(slot)
        self._known_slots.discard(slot)
        try:
            name = self._slot_names(slot)
        except LookupError:
            return
        self._enqueue_clear(name)

    # -- precise (KV-event) path ---------------------------------------------------------------

    def stored(self, slot: int, block_keys: np.ndarray) -> None:
        """A ``BlockStored`` event: same as ``record``, but a chunk need not start at block 0."""
        self._bisect = b"0"
        self.record(slot, block_keys)

    def removed(self, slot: int, block_keys: np.ndarray) -> None:
        """A ``BlockRemoved`` event: the engine evicted these blocks."""
        self._bisect = b"0"
        self._local.remove(slot, block_keys)
        self._enqueue(self._slot_names(slot), _DEL, block_keys)

    def cleared(self, slot: int) -> None:
        """An ``AllBlocksCleared`` event (prefix-cache reset): one ``INCR`` hides all old blocks."""
        self.drop_slot(slot)

    # -- shared read path ------------------------------------------------------------------------

    async def lookup(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Longest consecutive prefix per slot across all replicas, in ONE Redis round trip.

        Same shape and meaning as ``match``. What Redis knows is copied into the mirror (so the
        synchronous ``match`` that follows agrees). Never raises for Redis trouble: falls back to
        the mirror and counts ``fallback_lookups``.
        """
        k = slots.shape[0]
        if k == 0 or block_keys.shape[0] == 0 or not self.healthy:
            if k and block_keys.shape[0]:
                self.fallback_lookups += 1
            return self._local.match(block_keys, slots)
        if self.pushed:
            self.pushed_lookups += 1
            return self._local.match(block_keys, slots)
        slot_list = slots.tolist()
        names = [self._slot_names(s) for s in slot_list]
        joined = "\n".join(names)
        if joined.count("\n") != k - 1 or "," in joined or not all(names):
            raise ValueError("endpoint names must be non-empty, without newlines or commas")
        blob = np.ascontiguousarray(block_keys, dtype=">u8").tobytes()
        try:
            async with asyncio.timeout(self._lookup_timeout_s):
                depths_csv, gens_csv = await self._lookup_script(
                    args=[self._bp, self._gp, blob, joined, self._bisect]
                )
            depths = np.array(depths_csv.split(b","), dtype=np.int32)
            gens = gens_csv.split(b",")
        except _DOWN_ERRORS as exc:
            self._went_down(exc)
            self.fallback_lookups += 1
            return self._local.match(block_keys, slots)
        except RedisError as exc:
            self._command_error("lookup", exc)
            self.fallback_lookups += 1
            return self._local.match(block_keys, slots)
        return self._learn(block_keys, slots, slot_list, names, depths, gens)

    def _learn(
        self,
        block_keys: np.ndarray,
        slots: np.ndarray,
        slot_list: list[int],
        names: list[str],
        depths: np.ndarray,
        gens: list[bytes],
    ) -> np.ndarray:
        local = self._local
        for slot, name, gen in zip(slot_list, names, gens, strict=True):
            known = self._gens.get(name)
            if gen != known:
                # A new generation means someone cleared the endpoint (or all its entries
                # expired): what the mirror learned under the old one is gone.
                if known is not None and not self._unflushed[name]:
                    local.drop_slot(slot)
                self._forget_writes(name)
                if gen:
                    self._gens[name] = gen
                else:
                    self._gens.pop(name, None)
        shared = depths
        mine = local.match(block_keys, slots)
        out = shared.copy()
        for i in np.flatnonzero(shared != mine).tolist():
            slot, d = slot_list[i], int(shared[i])
            if d > mine[i]:
                local.record(slot, block_keys[:d])
                self._known_slots.add(slot)
            elif self._unflushed[names[i]]:
                # Our own writes not yet in Redis: the mirror is ahead, trust it.
                out[i] = mine[i]
            else:
                # Redis is the shared truth (another replica removed it, or the TTL expired):
                # break the mirror's chain where Redis's ends so the sync match agrees.
                local.remove(slot, block_keys[d : d + 1])
        return out

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn the server identity and start the flush/probe task (Redis down is not an error)."""
        try:
            async with asyncio.timeout(self._write_timeout_s):
                self._run_id = await self._server_run_id()
        except (*_DOWN_ERRORS, RedisError) as exc:
            self._went_down(exc)
        self._task = asyncio.create_task(self._run(), name="redis-prefix-index")
        if self._push:
            self._listener = asyncio.create_task(self._listen(), name="redis-prefix-index-push")

    async def close(self, timeout_s: float = 1.0) -> None:
        """Stop the background task and flush pending writes, best effort within ``timeout_s``."""
        if self._listener is not None:
            await stop_task(self._listener)
            self._listener = None
        self._warm_at = None
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self.healthy and (self._ops or self._clears):
            try:
                async with asyncio.timeout(timeout_s):
                    await self.flush()
            except TimeoutError:
                log.warning("closing with %d kv-index writes not flushed to Redis", self._pending_blocks)

    @property
    def pending(self) -> int:
        """Blocks queued for Redis (clears not counted)."""
        return self._pending_blocks

    async def flush(self) -> bool:
        """Write everything queued now; False if Redis failed (the writes stay queued)."""
        async with self._flush_lock:
            while self._ops or self._clears:
                if not await self._flush_once():
                    return False
            return True

    # -- internals ---------------------------------------------------------------------------------

    def _enqueue(self, name: str, op: bytes, block_keys: np.ndarray) -> None:
        n = block_keys.shape[0]
        if n == 0:
            return
        self._ops.append((name, op, np.asarray(block_keys, dtype=np.uint64)))
        self._unflushed[name] += 1
        self._pending_blocks += n
        self._trim()
        self._work.set()

    def _enqueue_clear(self, name: str) -> None:
        # Ops queued before the clear are moot (the INCR hides them) and would otherwise land
        # after it, because clears go first in a flush.
        if any(op_name == name for op_name, _, _ in self._ops):
            kept: deque[_Op] = deque()
            for op in self._ops:
                if op[0] == name:
                    self._pending_blocks -= op[2].shape[0]
                    self._unflushed[name] -= 1
                else:
                    kept.append(op)
            self._ops = kept
        if name not in self._clears:
            self._clears[name] = None
            self._unflushed[name] += 1
        # Our own INCR: adopt the next generation we see without dropping the mirror again.
        self._gens.pop(name, None)
        self._forget_writes(name)
        self._work.set()

    def _trim(self) -> None:
        while self._pending_blocks > self._max_pending and self._ops:
            name, _, keys = self._ops.popleft()
            self._pending_blocks -= keys.shape[0]
            self.dropped_writes += keys.shape[0]
            self._done(name)

    def _done(self, name: str) -> None:
        left = self._unflushed[name] - 1
        if left > 0:
            self._unflushed[name] = left
        else:
            del self._unflushed[name]

    async def _run(self) -> None:
        task = asyncio.current_task()
        while True:
            # On Python 3.11 an asyncio.timeout() expiring as the task is cancelled can swallow the
            # cancellation; the request is still counted, so leave instead of waiting forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            try:
                if self.healthy:
                    await self._work.wait()  # also set by _went_down, so the probe starts
                    if self.healthy:
                        # Let a batch accumulate: one pipeline per interval, not one per request.
                        # Short, because until it lands other replicas send the same new prefix
                        # elsewhere: at 50 ms four replicas on shared prefixes had 3.7x one
                        # replica's p90 TTFT, at 5 ms 1.5x (loadtests.bench.replicas).
                        await asyncio.sleep(self._flush_interval_s)
                        self._work.clear()
                        await self.flush()
                else:
                    await asyncio.sleep(self._probe_interval_s)
                    await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception:
                # The task must outlive any bug in one iteration, or writes stop silently.
                log.exception("kv-index background iteration failed")

    async def _flush_once(self) -> bool:
        ops = list(self._ops)
        self._ops.clear()
        clears = list(self._clears)
        self._clears.clear()
        blocks = self._pending_blocks
        self._pending_blocks = 0
        try:
            await self._apply(clears, ops)
            if self._push:
                async with asyncio.timeout(self._write_timeout_s):
                    await self._client.publish(self._channel, self._encode(clears, ops))
        except asyncio.CancelledError:
            self._requeue(clears, ops, blocks)  # close() may still flush them
            raise
        except (*_DOWN_ERRORS, RedisError) as exc:
            if isinstance(exc, _DOWN_ERRORS):
                self._went_down(exc)
            else:
                self._command_error("flush", exc)
            self._requeue(clears, ops, blocks)
            return False
        for name in clears:
            self._done(name)
        for name, _, _ in ops:
            self._done(name)
        return True

    def _requeue(self, clears: list[str], ops: list[_Op], blocks: int) -> None:
        # Everything queued meanwhile is newer. A name cleared meanwhile makes its old ops moot
        # (kept, they would land after that clear, since clears go first).
        cleared_since = set(self._clears)
        for name in clears:
            if name in cleared_since:
                self._done(name)
            else:
                self._clears[name] = None
        for op in reversed(ops):
            if op[0] in cleared_since:
                self._done(op[0])
                blocks -= op[2].shape[0]
            else:
                self._ops.appendleft(op)
        self._pending_blocks += blocks
        self._trim()

    async def _apply(self, clears: list[str], ops: Iterable[_Op]) -> None:
        """Clears first, then the ops coalesced per name (last write wins), chunked per script call."""
        per_name: dict[str, list[tuple[bytes, np.ndarray]]] = {}
        for name, op, keys in ops:
            per_name.setdefault(name, []).append((op, keys))
        calls = _Calls(self._batch_blocks, [a for name in clears for a in (_CLEAR, name, b"")])
        written: list[tuple[str, np.ndarray]] = []
        # Only for an index fed whole prompts: a removal (the KV-event path) is not a generation,
        # so a block another replica removed could not be told from one still held.
        recent = self._recent if self._bisect == b"1" else None
        for name, name_ops in per_name.items():
            for op, keys in self._coalesce(name_ops):
                if recent is None or op != _ADD:
                    calls.add(op, name, keys)
                    continue
                gen = self._gens.get(name)  # what the blocks written lately were written under
                new, lately = recent.split(name, keys) if gen else (keys, keys[:0])
                calls.add(_ADD, name, new)
                if lately.shape[0]:  # none without a generation
                    calls.add(_ADD_IF_CLEARED + gen, name, lately)
                written.append((name, new))
        if recent is None:
            await self._run_calls(calls.done())
            return
        # Counted as written before the await, so a clear or a new generation seen meanwhile
        # (which forgets the name) wins; taken back if the calls fail.
        for name, keys in written:
            recent.wrote(name, keys)
        try:
            await self._run_calls(calls.done())
        except BaseException:
            for name, keys in written:
                recent.forget(name, keys)
            raise

    @staticmethod
    def _coalesce(name_ops: list[tuple[bytes, np.ndarray]]) -> list[tuple[bytes, np.ndarray]]:
        if all(op == _ADD for op, _ in name_ops):
            # The common case (routing records, shared prefixes over and over): dedupe in numpy.
            return [(_ADD, np.unique(np.concatenate([keys for _, keys in name_ops])))]
        last: dict[int, bool] = {}
        for op, keys in name_ops:
            last.update(dict.fromkeys(keys.tolist(), op == _ADD))
        adds = [k for k, add in last.items() if add]
        dels = [k for k, add in last.items() if not add]
        return [(_DEL, np.array(dels, dtype=np.uint64)), (_ADD, np.array(adds, dtype=np.uint64))]

    async def _run_calls(self, calls: list[list[bytes | str]], per_pipeline: int = 64) -> None:
        """The script calls, under the timeout: one alone (the common flush), else pipelined,
        ``per_pipeline`` per pipeline."""
        for first in range(0, len(calls), per_pipeline):
            group = calls[first : first + per_pipeline]
            async with asyncio.timeout(self._write_timeout_s):
                if len(group) == 1:  # EVALSHA alone: no SCRIPT EXISTS round trip, as a pipeline asks
                    results = [await self._apply_script(args=self._apply_args(group[0]))]
                else:
                    results = await self._pipeline(group)
            for args, gens in zip(group, results, strict=True):
                for j in range(0, len(args), 3):
                    gen = gens[j // 3]
                    if gen:
                        self._adopt_gen(str(args[j + 1]), gen)

    def _apply_args(self, call: list[bytes | str]) -> list[Any]:
        """One apply-script call's ARGV: the key prefixes and TTL, then its (op, name, blob) triples."""
        return [self._bp, self._gp, self._ttl_ms, *call]

    async def _pipeline(self, group: list[list[bytes | str]]) -> list[Any]:
        # execute() first asks SCRIPT EXISTS (one more round trip, plus SCRIPT LOAD after a flush or
        # restart), so a flushed script no longer fails the whole pipeline with NOSCRIPT. That check
        # runs on the pipeline's connection before execute()'s own cleanup is in force: the context
        # manager is what hands the connection back to the pool when it fails or is cancelled.
        async with self._client.pipeline(transaction=False) as pipe:
            for args in group:
                # Against a pipeline the call only queues the EVALSHA; nothing is awaited on Redis.
                await self._apply_script(args=self._apply_args(args), client=pipe)
            return await pipe.execute()

    def _forget_writes(self, name: str) -> None:
        if self._recent is not None:
            self._recent.forget(name)

    def _adopt_gen(self, name: str, gen: bytes) -> None:
        known = self._gens.get(name)
        if known is not None and known != gen:
            # Someone cleared the endpoint since we last looked: the mirror's older blocks are gone
            # (the ones just written are in Redis under the new generation; lookups relearn them).
            slot = self._slot_of(name)
            if slot is not None:
                self._local.drop_slot(slot)
            self._forget_writes(name)
        self._gens[name] = gen

    async def _server_run_id(self) -> str:
        info = await self._client.info("server")
        return str(info["run_id"])

    def _went_down(self, exc: BaseException) -> None:
        self.redis_errors += 1
        if not self.healthy:
            return
        self.healthy = False
        self._warm_at = None  # pushes may be lost meanwhile: pull again until warm
        self._dropped_when_down = self.dropped_writes
        self._work.set()  # the background task may be idle-waiting for writes; it must probe
        log.warning(
            "Redis unreachable (%s: %s): kv index is local-only until it answers again",
            type(exc).__name__,
            str(exc) or "timeout",
        )

    def _command_error(self, what: str, exc: RedisError) -> None:
        self.redis_errors += 1
        now = time.monotonic()
        # A broken script or an OOM Redis fails every call; one line a minute is enough.
        if now - self._last_error_log >= 60.0:
            self._last_error_log = now
            log.warning(
                "Redis %s failed (%s: %s); answering from the local mirror", what, type(exc).__name__, exc
            )

    async def _probe(self) -> None:
        try:
            async with asyncio.timeout(self._probe_interval_s):
                await self._client.ping()
                run_id = await self._server_run_id()
        except (*_DOWN_ERRORS, RedisError):
            return
        restarted = run_id != self._run_id
        lost = self.dropped_writes != self._dropped_when_down
        if restarted:
            self._gens.clear()  # generations restart too; adopt the new ones without dropping
        if self._recent is not None:
            self._recent.forget_all()  # what Redis kept through the outage is not known
        started = time.perf_counter()
        try:
            async with self._flush_lock:
                while self._ops or self._clears:
                    if not await self._flush_once():
                        raise RedisConnectionError("flush after reconnect failed")
                pushed = await self._push_view() if restarted or lost else 0
        except (*_DOWN_ERRORS, RedisError):
            return  # still (or again) down; the next probe retries
        self._run_id = run_id
        self.healthy = True
        if pushed:
            self.resyncs += 1
        log.info(
            "Redis reachable again: kv index shared again (resynced %d blocks%s in %.3f s)",
            pushed,
            ", server restarted" if restarted else "",
            time.perf_counter() - started,
        )

    async def _push_view(self) -> int:
        """Write the mirror's blocks for every endpoint this replica knows; returns blocks pushed."""
        ops: list[_Op] = []
        total = 0
        for slot in sorted(self._known_slots):
            try:
                name = self._slot_names(slot)
            except LookupError:
                continue
            if self._slot_of(name) != slot:
                continue  # the slot now belongs to another endpoint, or none
            keys = np.array(self._local.slot_keys(slot), dtype=np.uint64)
            if keys.shape[0]:
                ops.append((name, _ADD, keys))
                total += keys.shape[0]
        await self._apply([], ops)
        return total

    # -- push: other replicas' flushes straight into the mirror -----------------------------------

    @property
    def pushed(self) -> bool:
        """Whether the mirror holds everything Redis does (pushed since before anything Redis
        still keeps was written), so a lookup can answer from it alone."""
        return self.healthy and self._warm_at is not None and time.monotonic() >= self._warm_at

    def _encode(self, clears: list[str], ops: Iterable[_Op]) -> bytes:
        """One flush as published: sender, whether lookups may bisect, then per op its kind, name
        and big-endian block keys, in the order they were made (the mirror's invariants need a
        prompt's keys as recorded, not coalesced)."""
        parts = [self._sender, self._bisect]
        for name in clears:
            raw = name.encode()
            parts += (_CLEAR, struct.pack(">HI", len(raw), 0), raw)
        for name, op, keys in ops:
            raw = name.encode()
            parts += (op, struct.pack(">HI", len(raw), keys.shape[0]), raw, keys.astype(">u8").tobytes())
        return b"".join(parts)

    def _receive(self, data: bytes) -> None:
        """Apply another replica's published flush to the mirror, whole or not at all (a malformed
        one raises ``ValueError`` before anything is applied). Names this replica does not know are
        skipped: their endpoints' blocks arrive again once they are in the pool."""
        if data[:4] == self._sender:
            return
        ops = self._decode(data)
        if data[4:5] == b"0":
            self._bisect = b"0"
        local = self._local
        for op, name, keys in ops:
            slot = self._slot_of(name)
            if slot is None:
                continue
            if op == _CLEAR:
                local.drop_slot(slot)
                self._gens.pop(name, None)  # adopt the new generation without dropping again
                self._forget_writes(name)
            elif op == _ADD:
                local.record(slot, keys)
                self._known_slots.add(slot)
            else:
                local.remove(slot, keys)
        self.applied_pushes += 1

    @staticmethod
    def _decode(data: bytes) -> list[tuple[bytes, str, np.ndarray]]:
        """``_encode``'s ops back; ``ValueError`` for anything else."""
        if len(data) < 5 or data[4:5] not in (b"0", b"1"):
            raise ValueError("no header")
        ops, at, end = [], 5, len(data)
        while at < end:
            op = data[at : at + 1]
            if op not in (_ADD, _DEL, _CLEAR) or at + 7 > end:
                raise ValueError(f"bad op at byte {at}")
            size, n = struct.unpack_from(">HI", data, at + 1)
            keys_at = at + 7 + size
            at = keys_at + 8 * n
            if at > end:
                raise ValueError("cut off")
            name = data[keys_at - size : keys_at].decode()  # UnicodeDecodeError is a ValueError
            ops.append(
                (op, name, np.frombuffer(data, dtype=">u8", count=n, offset=keys_at).astype(np.uint64))
            )
        return ops

    async def _holds_blocks(self) -> bool:
        async for _ in self._client.scan_iter(match=self._bp + b"*", count=1000):
            return True
        return False

    async def _listen(self) -> None:
        """Follow ``<ns>:w`` for good, applying the other replicas' flushes."""
        await follow_channel(
            self._client,
            self._channel,
            self._delivered,
            subscribed=self._subscribed,
            lost=self._push_lost,
            retry_s=self._probe_interval_s,
        )

    async def _subscribed(self) -> None:
        # Blocks written before the subscription reach this mirror only through lookups: ask Redis
        # until they have expired, unless it holds none.
        held = await self._holds_blocks()
        self._warm_at = time.monotonic() + (self._ttl_s if held else 0.0)
        log.info(
            "kv index: replicas push their writes; lookups %s",
            f"ask Redis for {self._ttl_s:g} s more (it holds older blocks)" if held else "local",
        )

    def _push_lost(self, exc: Exception) -> None:
        if self._warm_at is not None:  # once per outage
            log.warning(
                "kv index push subscription lost (%s: %s); lookups ask Redis", type(exc).__name__, exc
            )
        self._warm_at = None  # pushes may be lost meanwhile: ask Redis until warm again
        self.redis_errors += 1

    def _delivered(self, data: bytes) -> None:
        try:
            self._receive(data)
        except ValueError as exc:
            self.redis_errors += 1
            log.warning("kv index: ignoring a malformed push on %s (%s)", self._channel, exc)
