"""The KV layout: which rank owns a token position, and where it lives there.

Notation: ``N`` ranks, rank ``r``, interleave size ``I``,
global position ``p``, maximum sequence length ``S``.

Positions are dealt to ranks in blocks of ``I`` consecutive tokens, round robin:
block ``p // I`` goes to rank ``(p // I) % N``.  Within a rank, blocks are packed
in increasing global order, so local slot order equals global order.  That is what
lets the prefix attention express "global position < start" as "local slot <
local_length(start)".

Every method here works on Python ints and, unchanged, on integer torch tensors
(``//``, ``%`` and ``clamp`` broadcast), so the graph passes insert exactly these
formulas.  Nothing here touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """How one rank of an ``N``-way DCP group stores a sequence of up to ``S`` tokens."""

    size: int
    """N: the DCP group size."""
    rank: int
    """r: this rank, in ``[0, N)``."""
    max_seq_len: int
    """S: the global sequence capacity the model was built for."""
    interleave: int = 1
    """I: consecutive positions that land on the same rank."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"DCP size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.interleave < 1:
            raise ValueError(f"interleave size must be >= 1, got {self.interleave}")
        if self.max_seq_len < self.size * self.interleave:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} is smaller than DCP size x interleave = "
                f"{self.size} x {self.interleave}: some ranks would own no position. "
                f"Use a smaller group or a larger max_seq_len."
            )

    @property
    def block(self) -> int:
        """I * N: positions in one round of the round robin."""
        return self.interleave * self.size

    @property
    def local_capacity(self) -> int:
        """S_loc: real slots per rank (the trash slot comes after them)."""
        return self.capacity_of(self.max_seq_len, self.size, self.interleave)

    @property
    def trash_slot(self) -> int:
        """Index of the slot that absorbs writes of positions this rank does not own."""
        return self.local_capacity

    @property
    def local_cache_len(self) -> int:
        """Slots in a local cache buffer: S_loc real slots plus the trash slot."""
        return self.local_capacity + 1

    @staticmethod
    def capacity_of(max_seq_len: int, size: int, interleave: int = 1) -> int:
        """S_loc = ceil(S / (I*N)) * I real slots per rank, for planning without a rank."""
        return -(-max_seq_len // (interleave * size)) * interleave

    def owner(self, p):
        """Rank that stores global position ``p``."""
        return (p // self.interleave) % self.size

    def local_slot(self, p):
        """Slot of global position ``p`` on its owner."""
        return (p // self.block) * self.interleave + p % self.interleave

    def global_position(self, slot):
        """Global position held by this rank's local ``slot`` (inverse of owner and local_slot)."""
        return (slot // self.interleave) * self.block + self.rank * self.interleave + slot % self.interleave

    def local_length(self, length):
        """How many of the first ``length`` global positions this rank stores.

        Because local slots are in global order, these are exactly slots ``[0, result)``.
        """
        tail = length % self.block - self.rank * self.interleave
        if isinstance(tail, int):
            tail = min(max(tail, 0), self.interleave)
        else:
            tail = tail.clamp(0, self.interleave)
        return (length // self.block) * self.interleave + tail
