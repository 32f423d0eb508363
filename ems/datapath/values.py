"""The values a load received for one call or one chunk, as one value object (`ReceivedValues`): their bytes, the
values they are expected to be, where they lie, and what the pool checked of them.

Contract:
* Columns, never an object per value: value i is `buffers[i]` (its bytes; None: missing), expected to be value i of
  `expected` (one per value: ValueError otherwise; `ExpectedValues`: kind, layout signature, tokens digest and
  payload length of each, numpy), at `addresses[i]` where the pool knows it (the embedded store), else None.
* `checked` (`ReadCheck`) is what the pool's read checked of them: `EXPECTED`, each value it placed is exactly the
  expected one already (nothing is checked again); `NONE`, the bytes as stored (the load checks them:
  `verified_prefix` here, or its copier's `Copier.check`).
* A value is a hit only from the first on: every prefix here stops at the first value that is missing or wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ems.backends.base import ReadCheck
from ems.buffers import Buffer
from ems.store.value_format import ExpectedValues, valid_prefix


@dataclass(slots=True)
class ReceivedValues:
    """A load's received values (see the module docstring). A value: never changed once built (not a frozen
    dataclass only for the cost of building one, on every load: see `PoolCall`)."""

    buffers: Sequence[Buffer | None]
    expected: ExpectedValues
    checked: ReadCheck = ReadCheck.NONE
    addresses: Sequence[int | None] | None = None

    def __post_init__(self) -> None:
        if len(self.expected.payload_len) != len(self.buffers):
            raise ValueError(f"{len(self.buffers)} values but {len(self.expected.payload_len)} expected")

    def present(self) -> int:
        """How many values, from the first, are there (not checked)."""
        return next((i for i, value in enumerate(self.buffers) if value is None), len(self.buffers))

    def range(self, a: int, b: int) -> ReceivedValues:
        """Values a..b-1 (value 0 of the result is value a of this; all of them: this one)."""
        if a == 0 and b == len(self.buffers):
            return self
        addresses = None if self.addresses is None else self.addresses[a:b]
        return ReceivedValues(self.buffers[a:b], self.expected.range(a, b), self.checked, addresses)

    def verified_prefix(self) -> int:
        """How many values, from the first, are present and exactly the expected ones: those present where the pool
        checked them (`ReadCheck.EXPECTED`), else checked here, header and checksum (`valid_prefix`)."""
        if self.checked is ReadCheck.EXPECTED:
            return self.present()
        return valid_prefix(self.buffers, self.expected)
