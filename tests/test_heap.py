"""Giving freed memory back: a trim is due only every ``TRIM_EVERY_S``, one thread trims at a
time, and a trim really hands a fragmented heap's free pages back (RssAnon falls)."""

from __future__ import annotations

import ctypes
import platform
import threading

import pytest

from coordinator.service import heap


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_trim_is_due_only_after_the_interval():
    assert heap.should_trim(now=10.0, last=9.0, every_s=0.25)
    assert not heap.should_trim(now=10.0, last=9.9, every_s=0.25)
    assert heap.should_trim(now=10.25, last=10.0, every_s=0.25)


def test_trims_are_throttled_and_one_thread_at_a_time():
    if heap._LIBC is None:
        pytest.skip("not glibc: trim is a no-op")
    now = [1e9]
    assert heap.trim(clock=lambda: now[0])
    assert not heap.trim(clock=lambda: now[0] + 0.1)  # within the interval
    now[0] += 1.0
    with heap._trimming:  # another thread is trimming: this one does not wait for it
        done = []
        t = threading.Thread(target=lambda: done.append(heap.trim(clock=lambda: now[0])))
        t.start()
        t.join(5)
        assert done == [False]
    assert heap.trim(clock=lambda: now[0])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_trim_gives_a_fragmented_heaps_free_pages_back():
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold = -1
    libc.mallopt(m_trim_threshold, 1 << 30)  # free() alone gives nothing back
    try:
        # 64 KiB blocks sit below the mmap threshold: they come from the heap. Keeping every
        # tenth pins the heap's top, so only a trim can return the freed pages in between.
        blocks = [bytearray(64 << 10) for _ in range(2000)]
        kept = blocks[::10]
        del blocks
        before = rss_anon_bytes()
        assert heap.trim(clock=lambda: 2e9)
        after = rss_anon_bytes()
        assert before - after > 60 << 20, (before, after)
        assert len(kept) == 200
    finally:
        libc.mallopt(m_trim_threshold, 128 << 10)  # glibc's default
