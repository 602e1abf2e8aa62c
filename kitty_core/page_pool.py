"""The page pool: a layer's packed pages of one kind in field-wise tensors, with per-sequence page
tables on the host and on the device."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from kernels.pages import KeyPages, ValuePages, page_nbytes


class PagePool:
    """Pages of one kind (KeyPages or ValuePages) in field-wise tensors [P, ...], grown by doubling.

    Each sequence keeps the ids of its pages in order, as a paged KV cache does: row b of a page
    table held twice, on the host (`ids` [B, width] and `n` [B], numpy) for the cache's own logic and
    on the device (`device_ids`, `device_n`, int32) for the kernels. Adding pages writes the new
    entries into both with a few vector operations, so a batch of hundreds of sequences packing a
    page each (every G decode steps) costs no Python per sequence and no rebuilt table.
    The packed code planes are stored with their last two dims swapped in memory and held as
    transposed views, so that they read as the page format does while the axis a decode kernel
    reduces over is the contiguous one: key channels (dense [D, G/4] is channel-contiguous, high
    [Db, G/4] likewise) and value tokens (low/high [G, D/4] are token-contiguous). A tensor-core
    operand then takes four codes' bytes with one 32-bit shared-memory read instead of four byte reads.
    """

    PLANES = ("dense", "high", "low")

    def __init__(self, kind: type, batch: int, device, width: int = 16):
        self.kind = kind
        self.store: dict[str, torch.Tensor] | None = None
        self.count = 0  # slots of the store ever used; those in `free` are held by no sequence
        self.free: list[int] = []  # slots of pages dropped (a crop, a sliding window), reused first
        self.n = np.zeros(batch, dtype=np.int64)
        self.ids = np.zeros((batch, width), dtype=np.int32)
        self.device_n = torch.zeros(batch, dtype=torch.int32, device=device)
        self.device_ids = torch.zeros((batch, width), dtype=torch.int32, device=device)

    @property
    def table(self) -> list[list[int]]:
        """Each sequence's page ids, in order (a copy)."""
        return [row[:k].tolist() for row, k in zip(self.ids, self.n)]

    def pages_of(self, b: int) -> int:
        return int(self.n[b])

    def reserve_slots(self, width: int) -> None:
        """Room for `width` pages per sequence in the tables. The device tables move only here, so
        a CUDA graph that captured them stays valid while no sequence outgrows the width."""
        if width <= self.ids.shape[1]:
            return
        ids = np.zeros((len(self.n), width), dtype=np.int32)
        ids[:, : self.ids.shape[1]] = self.ids
        device_ids = self.device_ids.new_zeros((len(self.n), width))
        device_ids[:, : self.ids.shape[1]] = self.device_ids
        self.ids, self.device_ids = ids, device_ids

    def _room(self, need: int) -> None:
        if need > self.ids.shape[1]:
            self.reserve_slots(max(need, 2 * self.ids.shape[1]))

    def add(self, b: int, pages: KeyPages | ValuePages) -> None:
        """pages [n, ...]: n new pages for sequence b."""
        ids = self._store(pages)
        n, at = len(ids), int(self.n[b])
        self._room(at + n)
        self.ids[b, at : at + n] = ids
        self.device_ids[b, at : at + n] = self._on_device(ids)
        self.n[b] += n
        self.device_n[b] += n

    def add_all(self, pages: KeyPages | ValuePages) -> None:
        """pages [B * n, ...], sequence-major: n new pages for every sequence, which all hold the
        same number of pages (a batch without padding)."""
        batch, at = len(self.n), int(self.n[0])
        if (self.n != at).any():
            raise RuntimeError("add_all needs every sequence at the same page count; use add_rows")
        ids = self._store(pages)
        per = len(ids) // batch
        self._room(at + per)
        self.ids[:, at : at + per] = ids.reshape(batch, per)
        self.device_ids[:, at : at + per] = self._on_device(ids).reshape(batch, per)
        self.n += per
        self.device_n += per

    def add_rows(self, rows: list[int], pages: KeyPages | ValuePages) -> None:
        """pages [len(rows), ...]: one new page for each listed sequence (distinct)."""
        if not len(rows):
            return
        ids = self._store(pages)
        rows_h = np.asarray(rows)
        at = self.n[rows_h]
        self._room(int(at.max()) + 1)
        self.ids[rows_h, at] = ids
        dev = self.device_ids.device
        rows_d = torch.from_numpy(rows_h).to(dev, non_blocking=True)
        self.device_ids[rows_d, torch.from_numpy(at).to(dev, non_blocking=True)] = self._on_device(ids)
        self.n[rows_h] += 1
        self.device_n[rows_d] += 1

    def _store(self, pages: KeyPages | ValuePages) -> np.ndarray:
        """Store pages [n, ...] in free slots first, then new ones; their slot ids (int32 [n])."""
        n = next(iter(vars(pages).values())).shape[0]
        if self.store is None:
            self.store = {f.name: self._zeros(f.name, getattr(pages, f.name), 0) for f in fields(pages)}
        reused, self.free = self.free[:n], self.free[n:]
        fresh = n - len(reused)
        cap = next(iter(self.store.values())).shape[0]
        if self.count + fresh > cap:
            self._grow(max(self.count + fresh, 2 * cap, 4))
        ids = np.array(reused + list(range(self.count, self.count + fresh)), dtype=np.int32)
        where = slice(self.count, self.count + n) if not reused else torch.from_numpy(ids).to(self.device_ids.device)
        for f in fields(pages):
            self.store[f.name][where] = getattr(pages, f.name)
        self.count += fresh
        return ids

    def _on_device(self, ids: np.ndarray) -> torch.Tensor:
        """Slot ids on the device; a run of new slots is made there (no copy from the host)."""
        dev = self.device_ids.device
        if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (np.diff(ids) == 1).all():
            return torch.arange(int(ids[0]), int(ids[-1]) + 1, dtype=torch.int32, device=dev)
        return torch.from_numpy(ids).to(dev)

    def drop_oldest(self, b: int | None, k: int) -> None:
        """Drop the k oldest pages of sequence b (None: of every sequence, which hold the same count);
        their slots go back to the pool."""
        rows = slice(None) if b is None else b
        n = int(self.n[0 if b is None else b])
        self.free += self.ids[rows, :k].flatten().tolist()
        self.ids[rows, : n - k] = self.ids[rows, k:n].copy()
        self.device_ids[rows, : n - k] = self.device_ids[rows, k:n].clone()
        self.n[rows] -= k
        self.device_n[rows] -= k

    def pop(self, b: int) -> None:
        """Drop sequence b's newest page; its slot goes back to the pool."""
        self.n[b] -= 1
        self.device_n[b] -= 1
        self.free.append(int(self.ids[b, self.n[b]]))

    def pages(self, b: int, first: int = 0) -> KeyPages | ValuePages | None:
        """Pages first, first+1, ... of sequence b, gathered (None if there are none)."""
        if first >= self.n[b]:
            return None
        index = self.device_ids[b, first : self.n[b]]
        return self.kind(**{name: t.index_select(0, index) for name, t in self.store.items()})

    def reserve(self, template: KeyPages | ValuePages, pages: int) -> None:
        """Room for `pages` pages in all, shaped like `template`, from now on (the pages held are kept):
        no doubling until they are used up."""
        if self.store is None:
            self.store = {f.name: self._zeros(f.name, getattr(template, f.name), pages) for f in fields(template)}
        elif pages > next(iter(self.store.values())).shape[0]:
            self._grow(pages)

    def _grow(self, pages: int) -> None:
        for name, t in self.store.items():
            grown = self._zeros(name, t, pages)
            grown[: self.count] = t[: self.count]
            self.store[name] = grown

    @classmethod
    def _zeros(cls, name: str, like: torch.Tensor, pages: int) -> torch.Tensor:
        """Zero storage for `pages` pages of field `name` shaped like `like` (see the class doc)."""
        shape = (pages, *like.shape[1:])
        if name in cls.PLANES:
            return like.new_zeros((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
        return like.new_zeros(shape)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored pages, per field."""
        if self.store is None:
            return {f.name: 0 for f in fields(self.kind)}
        per_page = page_nbytes(self.kind(**{k: v[:1] for k, v in self.store.items()}))
        return {name: per_page[name] * (self.count - len(self.free)) for name in per_page}
