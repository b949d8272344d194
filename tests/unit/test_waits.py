"""tests.support.waits: eventually returns the first truthy value and fails with the last one seen;
consistently checks every poll and fails at the first falsy one. Intervals of 0 and probes that
count their calls keep these free of real waiting."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.waits import (
    WaitFailed,
    consistently,
    consistently_async,
    eventually,
    eventually_async,
    no_problems,
)


def test_eventually_returns_the_first_truthy_value() -> None:
    seen: Iterator[object] = iter([None, [], {"phase": "Bound"}, "later"])
    assert eventually("a bound claim", lambda: next(seen), timeout=5, interval=0) == {"phase": "Bound"}


def test_eventually_fails_with_what_and_the_last_value() -> None:
    phases = iter([None, "", 0])
    with pytest.raises(
        WaitFailed, match=r"after 0s waiting for the claim bound; the last of 1 probes saw: None"
    ):
        eventually("the claim bound", lambda: next(phases), timeout=0)


def test_eventually_ignores_only_the_exceptions_it_is_told_to() -> None:
    calls = [0]

    def probe() -> str:
        calls[0] += 1
        if calls[0] < 3:
            raise ConnectionRefusedError("not yet")
        return "up"

    assert eventually("up", probe, timeout=5, interval=0, ignoring=(OSError,)) == "up"
    calls[0] = 0
    with pytest.raises(WaitFailed, match="saw: 'ConnectionRefusedError: not yet'"):
        eventually("up", probe, timeout=0, ignoring=(OSError,))
    with pytest.raises(KeyError):
        eventually("up", lambda: dict[str, str]()["x"], timeout=5, interval=0, ignoring=(OSError,))


def test_consistently_checks_every_poll_and_fails_at_the_first_violation() -> None:
    values = iter([True, True, False, True])
    with pytest.raises(WaitFailed, match=r"nothing attached: failed .* \(probe 3\) with False"):
        consistently("nothing attached", lambda: next(values), duration=60, interval=0)
    assert consistently("always", lambda: "yes", duration=0) == "yes"


async def test_the_async_variants_await_their_probe() -> None:
    values = iter([0, 0, 7])

    async def probe() -> int:
        return next(values)

    assert await eventually_async("seven", probe, timeout=5, interval=0) == 7

    async def empty() -> list[str]:
        return []

    with pytest.raises(WaitFailed, match="last of 1 probes saw: \\[\\]"):
        await eventually_async("events", empty, timeout=0)

    flags = iter([True, False])

    async def flag() -> bool:
        return next(flags)

    with pytest.raises(WaitFailed, match=r"\(probe 2\) with False"):
        await consistently_async("held", flag, duration=60, interval=0)


def test_satisfied_says_what_a_wanted_value_is_and_context_explains_a_failure() -> None:
    problems = iter([["claim Pending"], ["pv missing"], []])
    assert (
        eventually("no problems", lambda: next(problems), timeout=5, interval=0, satisfied=no_problems) == []
    )
    with pytest.raises(WaitFailed, match=r"saw: \['still Pending'\]\nthe log's tail"):
        eventually(
            "no problems",
            lambda: ["still Pending"],
            timeout=0,
            satisfied=no_problems,
            context=lambda: "the log's tail",
        )
    counts = iter([3, 3, 4])
    with pytest.raises(WaitFailed, match=r"\(probe 3\) with 4\nbefore: 3"):
        consistently(
            "the count stays",
            lambda: next(counts),
            60,
            0,
            satisfied=lambda n: n == 3,
            context=lambda: "before: 3",
        )


def test_an_ignored_exception_is_not_given_to_satisfied() -> None:
    def health() -> dict[str, str]:
        raise ConnectionResetError("the apiserver restarts")

    with pytest.raises(WaitFailed, match="saw: 'ConnectionResetError: the apiserver restarts'"):
        eventually(
            "healthy", health, 0, satisfied=lambda h: all(v == "ok" for v in h.values()), ignoring=(OSError,)
        )
