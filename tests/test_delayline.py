"""The shaped link between namespaces (tests/delayline.py): delay, integrity, clean teardown.

Needs root, ``ip netns``, gcc and ``/dev/net/tun``; skips with the reason otherwise.  A few seconds; the only
timed assertion is a lower bound (the configured delay), which load cannot break.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from delayline import DelayLine, client, ip, missing_requirements, namespaces, parse_rate, run, server

REASON = missing_requirements()
DELAY_S = 0.002
ADDR_A, ADDR_B = "10.99.0.1", "10.99.0.2"

needs_netns = pytest.mark.skipif(REASON is not None, reason=f"delayline: {REASON}")
pytestmark = pytest.mark.timeout(60)  # a hang guard only: the tests take a few seconds


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    """Two fresh namespaces with unique names, removed even when the test fails."""
    for line in ip("netns", "list").stdout.splitlines():  # left by a killed run (its pid is gone)
        m = re.match(r"(dmlt(\d+)-[ab])\b", line)
        if m and not Path(f"/proc/{m[2]}").exists():
            ip("netns", "del", m[1], check=False)
    with namespaces(f"dmlt{os.getpid()}-a", f"dmlt{os.getpid()}-b") as names:
        yield names[0], names[1]


def _has_device(ns: str, name: str = "dl0") -> bool:
    return ip("link", "show", "dev", name, ns=ns, check=False).returncode == 0


@needs_netns
def test_delay_and_integrity(pair: tuple[str, str]) -> None:
    """TCP works across a 2 ms link, the round trip takes at least 4 ms, and 4 MiB arrive intact."""
    ns_a, ns_b = pair
    with DelayLine(ns_a, ns_b, ADDR_A, ADDR_B, delay_s=DELAY_S) as link, server(ns_b, ADDR_B):
        assert link.relay_pid is not None
        result = client(ns_a, ADDR_B, pings=20, mib=4, verify=True, timeout=30)
    # The relay sends a packet up to its wake-up advance early (the median overshoot of its sleeps, at most
    # 0.2 ms), so departures centre on the due time: a round trip may be short of 2 delays by what each way was early.
    early_s = (link.stats["a2b_early_max_ns"] + link.stats["b2a_early_max_ns"]) / 1e9
    for kind in ("udp", "tcp"):
        median = statistics.median(result[f"{kind}_rtt_s"])
        assert median >= 2 * DELAY_S - early_s, (
            f"{kind} round trip {median * 1e3:.3f} ms < {2 * DELAY_S * 1e3} ms - {early_s * 1e3:.3f} ms early"
        )
    assert result["received"] == result["bytes"] == 4 << 20
    assert result["intact"] is True
    # The relay's own count: every byte crossed it (plus headers and the pings).
    assert link.stats["a2b_bytes"] > 4 << 20
    assert link.stats["a2b_write_err"] == link.stats["b2a_write_err"] == 0


@needs_netns
def test_teardown(pair: tuple[str, str]) -> None:
    """Leaving the block stops the relay and removes both devices; a deleted namespace stops the relay."""
    ns_a, ns_b = pair
    with DelayLine(ns_a, ns_b, ADDR_A, ADDR_B, delay_s=DELAY_S, rate_bit_s=1e9) as link:
        pid = link.relay_pid
        assert pid is not None and _has_device(ns_a) and _has_device(ns_b)
        assert "tbf" in run(["tc", "-n", ns_a, "qdisc", "show", "dev", "dl0"]).stdout
    assert link.relay_pid is None and not Path(f"/proc/{pid}").exists()
    assert not _has_device(ns_a) and not _has_device(ns_b)

    link = DelayLine(ns_a, ns_b, ADDR_A, ADDR_B, delay_s=DELAY_S)
    with link:
        ip("netns", "del", ns_b)  # a fixture tearing down in the wrong order
        assert link._proc is not None
        link._proc.wait(timeout=10)  # the relay sees its device go and exits
    assert "gone" in link.error
    assert not _has_device(ns_a)


@needs_netns
def test_bad_namespace_leaves_nothing(pair: tuple[str, str]) -> None:
    """A failed start (no such namespace) raises and leaves no relay and no device behind."""
    ns_a, _ = pair
    link = DelayLine(ns_a, "dmlt-no-such-ns", ADDR_A, ADDR_B, delay_s=DELAY_S)
    with pytest.raises(RuntimeError, match="dmlt-no-such-ns"):
        link.start()
    assert link.relay_pid is None and not _has_device(ns_a)


def test_parse_rate() -> None:
    """Rates as tc writes them."""
    assert parse_rate("10gbit") == 10e9
    assert parse_rate("1g") == 1e9
    assert parse_rate("500mbit") == 500e6
    assert parse_rate("none") is None
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate("fast")
