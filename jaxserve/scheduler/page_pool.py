"""Host-side allocator of KV-cache pages: the ids of free pages in the device page pool."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """A free list over page ids ``0 .. num_pages - 1``.

    Pages are handed out lowest id first so runs are deterministic. Every page is either free or owned;
    freeing a page that is already free is a bug in the caller and raises.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]
