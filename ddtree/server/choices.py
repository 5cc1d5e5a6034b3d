"""`n` > 1: one request's n choices are n jobs of the scheduler, answered as one response.

    seeds = choice_seeds(seed, n)              # choice i: (seed + i) mod 2^64
    async for i, item in merged([gen_0, ...]): # the choices' items as they come, tagged with the choice index
    usage = merged_usage([usage_0, ...])       # the prompt once, the completions summed

Seeds: choice i samples with seed (seed + i) mod 2^64, so choice i of a request is exactly the same request
with n = 1 and that seed (docs/serving.md). Choices with temperature 0 are all the greedy answer.
"""
from __future__ import annotations

import asyncio

SEED_MOD = 2**64                               # seeds are Philox keys of 64 bits (docs/interfaces.md section 5)


def choice_seeds(seed: int, n: int) -> list[int]:
    return [(seed + i) % SEED_MOD for i in range(n)]


async def merged(gens: list):
    """Yields (index, item) from every async generator as items arrive; ends when all have ended. An exception
    in one is raised here, and every generator still running is cancelled (its finally blocks run: a job
    leaves the queue or the batch)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, done, None))
        except Exception as e:                             # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merged_usage(usages: list[dict]) -> dict:
    """The choices' usage objects (server/app.py usage_of) as one: prompt_tokens once, completion_tokens and
    ddtree.steps summed, mean_accept_len over all the steps."""
    if len(usages) == 1:
        return usages[0]
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    steps = sum(u["ddtree"]["steps"] for u in usages)
    accepted = sum(u["ddtree"]["mean_accept_len"] * u["ddtree"]["steps"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "ddtree": {"steps": steps, "mean_accept_len": accepted / steps if steps else 0.0}}
