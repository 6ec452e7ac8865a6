"""The service meter's batch charges (policies/service_cost.py `charge_tokens`) against one write
per request: the same value in every account, to the bit, and the accounts written in the order
they were first charged (a ledger records each account at its first write).

Batches mix clients in runs and interleaved, requests the meter never started (no charge), both
cost functions and both charge modes, and keys made from the request (D²LPM's (client, worker)).
"""

from __future__ import annotations

import random

import pytest

from policies.service_cost import ServiceMeter
from policies.service_params import ServiceCostParams
from router.request import Request


class Recorded(dict):
    """An account dict that remembers the order of its writes."""

    def __init__(self, values: dict) -> None:
        super().__init__(values)
        self.writes: list = []

    def __setitem__(self, key, value) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)


def one_write_per_request(meter, requests, num_tokens, accounts, sign, account_of) -> list:
    order = []
    for request in requests:
        charge = meter.tokens(request, num_tokens)
        if charge:
            key = request.client if account_of is None else account_of(request)
            accounts[key] = accounts.get(key, 0.0) + sign * charge
            if key not in order:
                order.append(key)
    return order


def meters(params: ServiceCostParams, started: list[Request]) -> tuple[ServiceMeter, ...]:
    pair = (params.meter(), params.meter())
    for meter in pair:
        for r in started:
            meter.start(r, r.prompt_len)
    return pair


@pytest.mark.parametrize("seed", range(30))
def test_a_batch_charges_as_one_write_per_request(seed: int) -> None:
    rng = random.Random(seed)
    params = ServiceCostParams(
        cost=rng.choice(["linear", "profiled"]),
        charge_output=rng.choice(["on_token", "predicted"]),
        w_out=rng.choice([2.0, 0.3]),
    )
    clients = [f"c{k}" for k in range(rng.choice([1, 2, 5]))]
    requests = [
        Request(i, 0.0, rng.randrange(1, 3000), 50, [], client=rng.choice(clients),
                weight=rng.choice([1.0, 3.0, 0.7]))
        for i in range(rng.randrange(1, 40))
    ]  # fmt: skip
    started = [r for r in requests if rng.random() < 0.8]
    batched, single = meters(params, started)
    account_of = None if rng.random() < 0.5 else (lambda r: (r.client, r.id % 3))
    sign = rng.choice([1.0, -1.0])
    start = {c: rng.uniform(-100, 100) for c in clients[:1]}
    accounts, expected = Recorded(start), dict(start)
    for _ in range(rng.randrange(1, 6)):  # settles, each a batch of the running requests
        batch = [rng.choice(requests) for _ in range(rng.randrange(0, 30))]
        if rng.random() < 0.5:
            batch.sort(key=lambda r: r.client)  # runs of one client
        steps = rng.randrange(1, 9)
        accounts.writes.clear()
        batched.charge_tokens(batch, steps, accounts, sign, account_of)
        order = one_write_per_request(single, batch, steps, expected, sign, account_of)
        assert dict(accounts) == expected  # floats compared exactly
        assert accounts.writes == order
