"""The bytes of request bodies the admission endpoints hold at once: room is taken at once, a full budget
makes a request wait until room is released, and a request that fits is not held up behind a larger one
waiting."""

from __future__ import annotations

import asyncio

from webhook.admission.app import BodyBudget


async def _settle() -> None:
    """Lets every task that can run, run (a waiter woken by a release needs a few turns of the loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_room_is_taken_at_once_and_given_back() -> None:
    async def scenario() -> None:
        budget = BodyBudget(10)
        await budget.reserve(4)
        await budget.reserve(6)
        assert budget.held == 10
        await budget.release(4)
        await budget.release(6)
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_full_budget_makes_a_request_wait_until_room_is_released() -> None:
    async def scenario() -> None:
        budget = BodyBudget(10)
        await budget.reserve(8)
        waiting = asyncio.create_task(budget.reserve(5))
        await _settle()
        assert not waiting.done() and budget.held == 8
        await budget.release(8)
        await _settle()
        assert waiting.done() and budget.held == 5

    asyncio.run(scenario())


def test_a_request_that_fits_goes_ahead_of_a_larger_one_waiting() -> None:
    async def scenario() -> None:
        budget = BodyBudget(10)
        await budget.reserve(8)
        large = asyncio.create_task(budget.reserve(5))
        await _settle()
        await budget.reserve(1)  # 8 + 1 fits: a small review is not held up behind the large body
        assert not large.done() and budget.held == 9
        await budget.release(8)
        await _settle()
        assert large.done() and budget.held == 6
        await budget.release(1)
        await budget.release(5)
        assert budget.held == 0

    asyncio.run(scenario())
