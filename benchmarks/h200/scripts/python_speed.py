"""Single-thread Python speed of a host: the same pure-Python work timed on each machine.

bench_host's numbers are host-bound: run this on the device and on the CI machine to compare
them. Attribute loads of dataclass instances with a __dict__ and with __slots__, struct packs,
a dict.
"""

import platform
import struct
import sysconfig
import timeit
from dataclasses import dataclass


@dataclass
class Plain:
    a: int = 1
    b: int = 2
    c: list | None = None


@dataclass(slots=True)
class Slotted:
    a: int = 1
    b: int = 2
    c: list | None = None


def attribute_loop(rows) -> int:
    total = 0
    for row in rows:
        if row.a < 0 or row.b > 10**9:
            break
        total += row.c[1] + row.a
    return total


MEMORY = memoryview(bytearray(32 * 1024))
SCALARS = struct.Struct("<qqii")


def pack_loop() -> None:
    for i in range(32):
        SCALARS.pack_into(MEMORY, i * 1024, i, i, i, i)


def dict_work() -> int:
    table = {}
    for i in range(100):
        table[i] = i
    return sum(table.values())


def main() -> None:
    print(platform.python_version(), platform.machine(), (sysconfig.get_config_var("CONFIG_ARGS") or "")[:160])
    plain = [Plain(i, i + 1, [1, 2, 3]) for i in range(32)]
    slotted = [Slotted(i, i + 1, [1, 2, 3]) for i in range(32)]
    cases = (("attributes x32", lambda: attribute_loop(plain)), ("slots x32", lambda: attribute_loop(slotted)),
             ("pack_into x32", pack_loop), ("dict of 100", dict_work))
    for name, work in cases:
        print(f"{name:>15} {min(timeit.repeat(work, number=20000, repeat=7)) / 20000 * 1e6:.3f} us")


if __name__ == "__main__":
    main()
