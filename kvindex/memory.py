"""In-memory approximate prefix index: which endpoint slot holds which chained block keys.

Layout (chosen by measurement, see ``python -m loadtests.bench.kvindex``):

* ``owners``: ``dict[block_key, int]`` whose value is a *bitmask of slots* (a Python int used as a
  bitset) holding that block. A lookup of one block answers for every candidate at once, so a
  match is one dict probe and one ``&`` per prompt block, whatever the number of candidates.
* one ``OrderedDict`` LRU per slot, bounded by ``capacity_blocks_per_slot`` and, lower, by what
  the slot's engine can hold (``limit``: its KV cache) or proved to hold (``shrink``). Eviction is
  per slot and clears only that slot's bit; a key whose mask reaches 0 leaves ``owners``.

``match`` has two ways, with identical answers where both apply:

* the *walk* probes the prompt's blocks from the start with an ``alive`` mask of the candidates
  and stops when it reaches 0, so it costs (longest match + 1) probes of ~0.12 µs (a dict probe
  and an ``&``), whatever the prompt length or the index size. Exact on any index.
* the *bisection*, on an index made with ``whole_prompts=True``: the holders of block i
  (``owners[key_i] & alive``) only shrink as i grows, so a slot's depth is where it leaves that
  mask. Probing block 0 and the last block, then splitting only the intervals whose end masks
  differ, finds every depth in about (distinct depths) × log2(prompt blocks) probes of ~0.25
  µs. On ``loadtests.bench.pick``'s index, a 4k-token prompt (256 blocks) whose 192-block
  system prompt 1 in 8 candidates hold: ~10 probes, p50 5.6 µs instead of 22.6 µs at 64
  candidates (4.1 vs 21.0 at 8, 7.3 vs 25.9 at 512). With many distinct depths it hands over to
  the walk (``_MAX_PENDING``), so it is never much dearer than the walk (64 candidates at 64
  distinct depths: ~39 µs for both). The blocks where the last bisection found depths are probed
  first (any block inside an interval splits it correctly): prompts on one system prompt end their
  match at the same block, so the next such match takes 4 probes (block 0, the last block, the
  two around the depth) instead of ~10; a hint that misses costs at most two probes per depth
  kept.

Why the holders only shrink, for an index fed only whole prompts (``record`` with a prompt's
chained keys from block 0; ``shrink``; ``drop_slot``): key i hashes key i-1 (``kvindex.hashing``),
so a key determines its whole prefix (up to a 64-bit hash collision). ``record`` touches a
prompt's keys last to first, so within a slot every held key is more recent than every held key
that extends it: LRU eviction (``record``, ``shrink``) removes a key only after everything that
extends it, and ``drop_slot`` removes all. So a slot holding block i of a prompt holds blocks
0..i-1: no holes. ``remove`` breaks that (it takes any blocks, and the precise index's KV events
also store a prompt chunk by chunk, later chunks more recent than earlier ones), so a slot that
``remove`` touched is walked until ``drop_slot`` empties it, and an index without
``whole_prompts`` always walks.

Where ``whole_prompts`` is set: the approximate index of ``router.server.compose``, fed by
``Picker._commit`` (``record`` of the request's whole ``block_keys``, from
``kvindex.hashing``) and ``Picker.shrink``; behind ``kvindex.redis_index.SharedPrefixIndex`` it
is the mirror, which also gets ``record(slot, keys[:d])`` (a prefix from block 0),
``drop_slot`` and ``remove`` (a chain broken where Redis's ends: that slot walks until dropped);
``slot_keys`` only reads. Its ``stored`` (KV events, chunk by chunk) must not feed such a mirror;
nothing in the router calls it. The precise index (KV events) does not set it.

``record`` is the costlier call: ~0.9 µs per *new* block on a 1M-entry index (insert plus an
eviction, both cache misses in big dicts; ~0.25 µs on a 10k-entry index) and ~0.08 µs per block
already held, so a caller on the request path should prefer to record after answering.

Memory, measured with tracemalloc (CPython 3.11, 64-bit keys from ``text_block_keys``, 1,000,000
(slot, block) entries, each key held by one slot, across 64 or 512 slots): **164 bytes per
entry**: about 90 in the slot's ``OrderedDict`` (hash-table entry + linked-list node), 40 in
``owners`` (its table is sized in powers of two, so 30-60) and 36 for the key int (shared by
both). Keys held by several slots cost one ``owners`` entry and one LRU entry per holder; a
multi-slot mask is an extra int of 28 + 4·⌈max_slot/30⌉ bytes. ``memory_bytes()`` returns an
estimate from these constants.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# Measured per-entry costs (see module docstring); used only by ``memory_bytes``.
_LRU_ENTRY_BYTES = 90
_OWNERS_ENTRY_BYTES = 40
_KEY_INT_BYTES = 36

# Below this many set bits a Python loop decodes a slot mask faster than numpy's unpackbits.
_BIT_LOOP_MAX = 24
# Up to this many matched slots, setting their depths item by item costs less than two arrays
# made from the dict (measured: 0.5 against 1.1 µs at 8 slots, even at ~40, 8.8 against 12.4 at 256).
_ITEM_SET_MAX = 32
# The walk converts keys to Python ints in chunks of 8, 32, 128, ... blocks.
_FIRST_CHUNK = 8
# Bisection hands over to the walk once this many intervals wait, each with depths ending in it:
# with that many distinct depths it would probe nearly every block, each probe dearer than a step
# of the walk (measured: 4 keeps 64 candidates of 64 distinct depths at the walk's cost, and
# leaves up to ~16 distinct depths to the bisection, which still wins there).
_MAX_PENDING = 4


class MemoryPrefixIndex:
    """Per-slot LRU of block keys with a key -> slot-bitmask map for one-pass matching.

    Slots are integers in ``[0, max_slots)``; ``max_slots`` bounds the bitmask width and the
    scratch arrays of ``match``. Implements :class:`kvindex.base.PrefixIndex`.
    """

    __slots__ = (
        "_bits",
        "_capacity",
        "_caps",
        "_entries",
        "_hints",
        "_holes",
        "_last_slots",
        "_limits",
        "_lru",
        "_max_slots",
        "_owners",
        "_whole_prompts",
    )

    def __init__(
        self, capacity_blocks_per_slot: int, max_slots: int = 4096, *, whole_prompts: bool = False
    ) -> None:
        if capacity_blocks_per_slot < 1:
            raise ValueError(f"capacity_blocks_per_slot: must be >= 1, got {capacity_blocks_per_slot}")
        if max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {max_slots}")
        self._capacity = capacity_blocks_per_slot
        self._caps: dict[int, int] = {}  # slots whose engine proved to hold less (``shrink``)
        self._limits: dict[int, int] = {}  # slots whose engine said how much it can hold (``limit``)
        self._max_slots = max_slots
        self._owners: dict[int, int] = {}
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._entries = 0
        # One shared int per single-slot mask: most keys have one holder, so their mask values
        # are references to these objects instead of one new int each.
        self._bits = [1 << s for s in range(max_slots)]
        # The last candidate set's (bytes, highest slot, bitmask): a router asks about the same
        # candidates pick after pick, and building their mask costs as much as a short match.
        self._last_slots: tuple[bytes, int, int] = (b"", -1, 0)
        # The caller's promise that ``record`` only ever gets a whole prompt's chained keys from
        # block 0 (see the module docstring); without it ``match`` always walks.
        self._whole_prompts = whole_prompts
        # Slots that ``remove`` may have left with holes: ``match`` walks while a candidate is one.
        self._holes = 0
        # Where the last bisections found depths (blocks d - 1 and d of a depth d), probed first
        # by the next: prompts that share a system prompt end their match at the same block, found
        # in two probes instead of log2(prompt blocks).
        self._hints: tuple[int, ...] = ()

    @property
    def whole_prompts(self) -> bool:
        """Fed whole prompts only (see the module docstring): ``match`` may bisect."""
        return self._whole_prompts

    @property
    def capacity_blocks_per_slot(self) -> int:
        return self._capacity

    @property
    def max_slots(self) -> int:
        return self._max_slots

    def __len__(self) -> int:
        """Number of (slot, block) entries held."""
        return self._entries

    def match(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Longest consecutive cached prefix (in blocks) per slot of ``slots``; see ``PrefixIndex``."""
        k = slots.shape[0]
        if k == 0 or block_keys.shape[0] == 0 or not self._owners:
            return np.zeros(k, dtype=np.int32)
        hi, alive = self._mask_of(slots)
        depth = np.zeros(hi + 1, dtype=np.int32)
        found: dict[int, int] = {}  # slot -> depth, for slots that matched at least one block
        if self._whole_prompts and not alive & self._holes:
            self._bisect(block_keys, alive, found, depth)
        else:
            self._walk(block_keys, alive, found, depth)
        n = len(found)
        if n > _ITEM_SET_MAX:
            depth[np.fromiter(found, np.int64, n)] = np.fromiter(found.values(), np.int32, n)
        else:
            for slot, blocks in found.items():
                depth[slot] = blocks
        return depth[slots]

    def _walk(self, block_keys: np.ndarray, alive: int, found: dict[int, int], depth: np.ndarray) -> None:
        """Depths by probing block after block until no candidate is left: exact on any index."""
        n_blocks = block_keys.shape[0]
        get = self._owners.get
        bits = self._bits
        start = 0
        chunk = _FIRST_CHUNK
        # Keys become Python ints chunk by chunk (growing): indexing numpy per block boxes a scalar
        # each time, and converting the whole prompt up front is wasted work on a short match.
        while alive and start < n_blocks:
            for i, key in enumerate(block_keys[start : start + chunk].tolist(), start):
                still = alive & get(key, 0)
                if still != alive:
                    # Slots dropping out at block 0 keep depth 0: the common "nobody has it" case
                    # decodes no bits at all.
                    if i:
                        gone = alive ^ still
                        if gone & (gone - 1):
                            self._decode(gone, i, found, depth, bits)
                        else:  # one slot left: the usual case, kept free of a call
                            found[gone.bit_length() - 1] = i
                    alive = still
                    if not alive:
                        break
            start += chunk
            chunk *= 4
        if alive:
            self._decode(alive, n_blocks, found, depth, bits)

    def _bisect(self, block_keys: np.ndarray, alive: int, found: dict[int, int], depth: np.ndarray) -> None:
        """Depths from the change points of the holders mask, found by bisection.

        Only valid where the holders of block i are a subset of those of block i - 1 (see the
        module docstring): then equal masks at both ends of an interval mean no slot's depth
        ends inside it, and only intervals whose end masks differ are split.
        """
        get = self._owners.get
        key = block_keys.item  # one Python int per probe: no list of the whole prompt
        bits = self._bits
        first = alive & get(key(0), 0)
        if not first:
            return
        last = block_keys.shape[0] - 1
        end = first & get(key(last), 0) if last else first
        if end:
            self._decode(end, last + 1, found, depth, bits)
        # (lo, holders of lo, hi, holders of hi), lo < hi, masks differ: a slot of lo's mask and not
        # hi's holds blocks 0..j for some lo <= j < hi.
        todo = [(0, first, last, end)] if first != end else []
        hints = self._hints
        depths: list[int] = []
        while todo:
            lo, lo_mask, hi, hi_mask = todo.pop()
            # Narrow the left half in place and queue the right one only if it changes too: with
            # one change point (the usual shared prefix) nothing is queued at all.
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                for hint in hints:  # any block inside the interval splits it as well as the middle
                    if lo < hint < hi:
                        mid = hint
                        break
                mid_mask = lo_mask & get(key(mid), 0)
                if mid_mask == lo_mask:
                    lo = mid
                    continue
                if mid_mask != hi_mask:
                    if len(todo) == _MAX_PENDING:
                        # What was found so far is exact; the walk finds it again, and the rest.
                        self._walk(block_keys, alive, found, depth)
                        return
                    todo.append((mid, mid_mask, hi, hi_mask))
                hi, hi_mask = mid, mid_mask
            self._decode(lo_mask ^ hi_mask, hi, found, depth, bits)
            depths.append(hi)
        if depths:
            self._hints = tuple(at for d in depths[:2] for at in (d - 1, d))

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        """Note that ``slot`` holds these blocks, now the most recently used; evict over capacity.

        Keys are touched last-to-first so block 0 ends up most recent: evicting the least recent
        then drops a prompt's tail before its head (as vLLM frees blocks), which keeps the shared
        prefix that every later match must walk through.
        """
        if not 0 <= slot < self._max_slots:
            raise ValueError(f"slot must be in [0, {self._max_slots}), got {slot}")
        keys = block_keys.tolist()
        if not keys:
            return
        lru = self._lru.get(slot)
        if lru is None:
            lru = self._lru[slot] = OrderedDict()
        bit = self._bits[slot]
        owners = self._owners
        before = len(lru)
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                mask = owners.get(key)
                owners[key] = bit if mask is None else mask | bit
        self._entries += len(lru) - before
        self._evict_over(slot, lru, self._cap(slot))

    def shrink(self, slot: int, blocks: int) -> None:
        """``slot``'s engine holds ``blocks`` fewer blocks than recorded (it said so): drop that
        many least recently used, and hold no more than what remains for it from now on."""
        lru = self._lru.get(slot)
        if lru is None or blocks <= 0:
            return
        self._caps[slot] = max(len(lru) - blocks, 1)
        self._evict_over(slot, lru, self._cap(slot))

    def limit(self, slot: int, blocks: int | None) -> None:
        """``slot``'s engine holds at most ``blocks`` blocks (its whole KV cache; None: not known,
        as when its endpoint left): hold no more than that for it, least recently used first out.
        Kept across ``drop_slot`` (an emptied cache is as big as before)."""
        if blocks is None:
            self._limits.pop(slot, None)
            return
        if blocks < 1:
            raise ValueError(f"limit: a slot holds at least 1 block, got {blocks}")
        self._limits[slot] = blocks
        lru = self._lru.get(slot)
        if lru is not None:
            self._evict_over(slot, lru, self._cap(slot))

    def _cap(self, slot: int) -> int:
        """How many blocks ``slot`` may hold: the least of the default, what its engine proved
        (``shrink``) and what it can hold (``limit``)."""
        return min(self._caps.get(slot, self._capacity), self._limits.get(slot, self._capacity))

    def _evict_over(self, slot: int, lru: OrderedDict[int, None], cap: int) -> None:
        over = len(lru) - cap
        if over <= 0:
            return
        owners = self._owners
        clear = ~self._bits[slot]
        for _ in range(over):
            old, _none = lru.popitem(last=False)
            mask = owners[old] & clear
            if mask:
                owners[old] = mask
            else:
                del owners[old]
        self._entries -= over

    def remove(self, slot: int, block_keys: np.ndarray | list[int]) -> None:
        """Forget these blocks of ``slot`` (an engine evicted them); unknown keys are a no-op.

        Blocks removed from the middle of a prompt leave holes, so ``match`` walks for ``slot``
        until ``drop_slot`` empties it."""
        lru = self._lru.get(slot)
        if lru is None:
            return
        owners = self._owners
        clear = ~self._bits[slot]
        keys = block_keys.tolist() if isinstance(block_keys, np.ndarray) else block_keys
        for key in keys:
            if lru.pop(key, 0) is None:  # it was there (the LRU stores None as the value)
                mask = owners[key] & clear
                if mask:
                    owners[key] = mask
                else:
                    del owners[key]
                self._entries -= 1
                self._holes |= self._bits[slot]

    def drop_slot(self, slot: int) -> None:
        """Forget everything about ``slot``; unknown slots are a no-op."""
        self._caps.pop(slot, None)
        lru = self._lru.pop(slot, None)
        if lru is None:
            return
        # Empty, it has no holes, and whole-prompt records keep it so.
        self._holes &= ~self._bits[slot]
        owners = self._owners
        clear = ~self._bits[slot]
        for key in lru:
            mask = owners[key] & clear
            if mask:
                owners[key] = mask
            else:
                del owners[key]
        self._entries -= len(lru)

    def slot_keys(self, slot: int) -> list[int]:
        """The block keys recorded for ``slot``, least recently used first (a copy; read-only).

        For replicating the index elsewhere (``kvindex.redis_index`` pushes it after a Redis
        outage); passing the list reversed to ``record`` rebuilds the same LRU order.
        """
        lru = self._lru.get(slot)
        return [] if lru is None else list(lru)

    def memory_bytes(self) -> int:
        """Estimated bytes held, from the per-entry costs measured in the module docstring."""
        return (
            self._entries * _LRU_ENTRY_BYTES
            + len(self._owners) * (_OWNERS_ENTRY_BYTES + _KEY_INT_BYTES)
            + self._max_slots * 8
        )

    def _mask_of(self, slots: np.ndarray) -> tuple[int, int]:
        """(highest slot, bitmask of ``slots``); the last set's is kept."""
        key = slots.tobytes()
        kept, hi, mask = self._last_slots
        if key == kept and slots.dtype == np.int64:
            return hi, mask
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self._max_slots:
            raise ValueError(f"slots must be in [0, {self._max_slots}), got [{lo}, {hi}]")
        if slots.shape[0] <= _BIT_LOOP_MAX:
            bits = self._bits
            mask = 0
            for s in slots.tolist():
                mask |= bits[s]
        else:  # many candidates: set bytes in numpy and read them as one little-endian int
            flags = np.zeros(hi + 1, dtype=np.bool_)
            flags[slots] = True
            mask = int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")
        if slots.dtype == np.int64:
            self._last_slots = (key, hi, mask)
        return hi, mask

    @staticmethod
    def _decode(mask: int, value: int, found: dict[int, int], depth: np.ndarray, bits: list[int]) -> None:
        """Give every slot whose bit is set in ``mask`` the match depth ``value``."""
        if mask.bit_count() <= _BIT_LOOP_MAX:
            # Clear the top bit each step: bit_length + xor with a prebuilt power of two allocates
            # less than isolating the low bit of a wide int.
            while mask:
                top = mask.bit_length() - 1
                found[top] = value
                mask ^= bits[top]
            return
        raw = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        flags = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        n = min(flags.shape[0], depth.shape[0])
        depth[:n][flags[:n].view(np.bool_)] = value
