"""The pure parts of app/object_store.py: which mapping is the object store's file, on
which filesystem it lies, and how much to prefault (the prefault itself runs against a
real Ray in tests/integration/test_object_store.py)."""

from __future__ import annotations

from app.object_store import (
    cgroup_available,
    filesystem_of,
    memory_available,
    plasma_mappings,
    prefault_budget,
    store_mapping,
)

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fd:01 1234                       /usr/bin/python3.11
7f1e00000000-7f1e00100000 rw-p 00000000 00:00 0
7f1eac000000-7f1f2c000000 rw-s 00000000 00:1a 77                         /dev/shm/plasmaefQvzk (deleted)
7f1f30000000-7f1f30400000 rw-s 00000000 fd:01 99                         /tmp/ray/plasma fallback/plasmaAbCdEf (deleted)
7f1f40000000-7f1f40001000 rw-s 00000000 00:1a 78                         /dev/shm/other-shared
7f1f50000000-7f1f50001000 r--p 00000000 00:1a 79                         /dev/shm/plasmaPrivateCopy
7f1d00000000-7f1d00200000 rw-s 00000000 00:1a 80                         /dev/shm/plasmaLowAddr
"""

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24683652k 0 0
tmpfs /tmp/ray/hugepages\\040dir hugetlbfs rw 0 0
proc /proc proc rw 0 0
"""


def test_only_shared_plasma_file_mappings_in_address_order():
    found = plasma_mappings(MAPS)
    assert [(hex(m.start), m.path) for m in found] == [
        ("0x7f1d00000000", "/dev/shm/plasmaLowAddr"),
        ("0x7f1eac000000", "/dev/shm/plasmaefQvzk"),
        ("0x7f1f30000000", "/tmp/ray/plasma fallback/plasmaAbCdEf"),
    ]
    assert found[1].end - found[1].start == 2 << 30


def test_the_store_is_the_largest_plasma_mapping_in_memory():
    found = plasma_mappings(MAPS)
    assert store_mapping(found, MOUNTS).path == "/dev/shm/plasmaefQvzk"
    on_disk = [m for m in found if m.path.startswith("/tmp/")]
    assert store_mapping(on_disk, MOUNTS) is None  # a fallback file on disk is never it
    assert store_mapping([], MOUNTS) is None


def test_filesystem_is_that_of_the_longest_mount_point_holding_the_path():
    assert filesystem_of("/dev/shm/plasmaefQvzk", MOUNTS) == "tmpfs"
    assert filesystem_of("/tmp/ray/plasmaAbCdEf", MOUNTS) == "ext4"
    assert filesystem_of("/tmp/ray/hugepages dir/plasmaX", MOUNTS) == "hugetlbfs"
    # A mount point is a whole path component, not a string prefix.
    assert filesystem_of("/dev/shmother/plasmaX", MOUNTS) == "ext4"
    assert filesystem_of("relative/plasmaX", MOUNTS) is None


GiB = 1 << 30


def test_memory_available_is_meminfos_memavailable_in_bytes():
    text = "MemTotal:       24683652 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    assert memory_available(text) == 20000000 * 1024
    assert memory_available("MemTotal: 1 kB\n") is None


def test_budget_is_the_least_of_asked_mapping_and_a_quarter_of_available_in_2mib_units():
    assert prefault_budget(2 * GiB, 7 * GiB, 20 * GiB) == 2 * GiB
    assert prefault_budget(2 * GiB, 200_000_000, 20 * GiB) == 200_000_000 // (2 << 20) * (2 << 20)
    # An 8 GiB laptop with 4 GiB left: at most 1 GiB goes to the store at start.
    assert prefault_budget(2 * GiB, 2 * GiB, 4 * GiB) == 1 * GiB
    assert prefault_budget(2 * GiB, 7 * GiB, None) == 2 * GiB
    assert prefault_budget(0, 7 * GiB, 20 * GiB) == 0
    assert prefault_budget(2 * GiB, 7 * GiB, 3 << 20) == 0  # under one unit


def test_a_cgroup_limit_leaves_its_limit_minus_its_use():
    assert cgroup_available("17179869184\n", "4294967296\n") == 12 * GiB
    assert cgroup_available("max\n", "4294967296\n") is None
    assert cgroup_available("1000\n", "5000\n") == 0
    assert cgroup_available("", "1") is None
