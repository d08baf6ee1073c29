"""Which computed prefixes the cache holds, found by hash chains. Pure Python: the keys and values
themselves stay in the slots of workers/engine/kv.py; this only says which slot's leading positions
equal a new row's.

A row's prefix is cut in blocks of BLOCK positions. Block i's hash covers the hash of block i - 1 and
the block's token ids, and block 0's the row's identity: what decides those positions besides the
token ids (the image's sha256 and the size it was fitted to, and the key that sent it: one tenant
never learns, by a faster answer, that another asked about the same photo). Equal hashes at block i
then mean equal positions 0 .. (i + 1) x BLOCK, whatever the rows' later tokens.

Holders are rows whose slot holds those positions: running rows (their leading positions never
change while they run) and rows that finished and left their slot to the cache (`retained`), which
are evicted least recently used when a slot is needed. A hit copies the positions (one copy, no
compute), so a holder is needed only for the length of that copy: no reference counts to keep.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

BLOCK = 16  # positions per hashed block: a hit reuses whole blocks


def chain(identity: Hashable, ids: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The hash of each whole block of `ids` (a partial last block has none)."""
    hashes: list[bytes] = []
    previous = hashlib.blake2b(repr(identity).encode(), digest_size=16).digest()
    for start in range(0, len(ids) - block + 1, block):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b",".join(str(int(t)).encode() for t in ids[start : start + block]))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class Hit:
    holder: str  # the row (or retained entry) whose slot holds the positions
    positions: int  # how many leading positions equal the new row's


@dataclass
class PrefixIndex:
    block: int = BLOCK
    _holders: dict[bytes, dict[str, None]] = field(default_factory=dict)  # hash -> holders (ordered)
    _chains: dict[str, list[bytes]] = field(default_factory=dict)  # holder -> its hashes
    _retained: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recently used first

    def add(self, holder: str, hashes: list[bytes]) -> None:
        """A row whose slot now holds these blocks (written so far)."""
        self.remove(holder)
        if not hashes:
            return
        self._chains[holder] = hashes
        for digest in hashes:
            self._holders.setdefault(digest, {})[holder] = None

    def remove(self, holder: str) -> None:
        """A holder whose slot no longer holds its blocks (freed, evicted, or recomputed)."""
        for digest in self._chains.pop(holder, []):
            holders = self._holders[digest]
            holders.pop(holder, None)
            if not holders:
                del self._holders[digest]
        self._retained.pop(holder, None)

    def rename(self, old: str, new: str) -> None:
        """The same blocks, held under another name (a slot passing from a row to the cache)."""
        hashes = self._chains.get(old, [])
        self.remove(old)
        self.add(new, hashes)

    def retain(self, holder: str) -> None:
        """A finished row's slot stays with the cache: evictable, least recently used first."""
        if holder in self._chains:
            self._retained[holder] = None
            self._retained.move_to_end(holder)

    def match(self, hashes: list[bytes]) -> Hit | None:
        """The holder of the longest run of these blocks, if any. A retained holder that serves a hit
        becomes the most recently used."""
        for index in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[index])
            if holders:
                holder = next(iter(holders))
                if holder in self._retained:
                    self._retained.move_to_end(holder)
                return Hit(holder, (index + 1) * self.block)
        return None

    def evict(self, keep: str | None = None) -> str | None:
        """The least recently used retained holder (never `keep`), removed from the index (its slot is
        to be freed)."""
        holder = next((h for h in self._retained if h != keep), None)
        if holder is not None:
            self.remove(holder)
        return holder

    def covering(self, holder: str) -> list[str]:
        """Other holders that hold every block of this holder's (its last block's: the chain says the
        rest)."""
        hashes = self._chains.get(holder)
        if not hashes:
            return []
        return [h for h in self._holders.get(hashes[-1], {}) if h != holder]

    def sharing(self, holder: str) -> tuple[str, int] | None:
        """The retained holder whose leading blocks equal the most of this holder's (another), and how
        many blocks: questions about one photo that diverge after it share its blocks."""
        hashes = self._chains.get(holder, [])
        for index in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[index], {})
            other = next((h for h in holders if h != holder and h in self._retained), None)
            if other is not None:
                return other, index + 1
        return None

    def blocks(self, holder: str) -> int:
        """Whole blocks the holder's slot holds that the index knows."""
        return len(self._chains.get(holder, []))

    def covered(self, holder: str) -> list[str]:
        """Other holders whose every block this holder holds (their last block is one of its)."""
        mine = set(self._chains.get(holder, []))
        return [h for h, hashes in self._chains.items() if h != holder and hashes and hashes[-1] in mine]

    def known(self, holder: str) -> int:
        """Leading positions of the holder's slot the index knows (whole blocks)."""
        return self.blocks(holder) * self.block

    def retained(self) -> list[str]:
        """Retained holders, least recently used first."""
        return list(self._retained)

    def __contains__(self, holder: object) -> bool:
        return holder in self._chains
