"""The Python SDK refuses values the wire cannot carry with InvalidArgumentError naming them, as the
TypeScript SDK does (issue 30, item 6), before any RPC: no daemon is needed here."""
import asyncio

import numpy as np
import pytest

import kakeya

DEAD = "127.0.0.1:1"  # nothing listens: a check that let a call through would fail UNAVAILABLE instead


@pytest.mark.parametrize("ids, shown", [([2**32], "4294967296"), ([5, -(2**31) - 1], "-2147483649"), ([1.5], "1.5"),
                                        ([True], "True"), (["7"], "'7'")])
def test_token_ids_past_32_bits_are_invalid_argument(ids, shown):
    with kakeya.Client(DEAD) as c:
        s = c.session("x" * 32)
        with pytest.raises(kakeya.InvalidArgumentError, match=rf"token_ids\[{len(ids) - 1}\] = {shown} is not a 32-bit"):
            s.append(ids)
        with pytest.raises(kakeya.InvalidArgumentError, match=r"initial_tokens\[\d\] = .* is not a 32-bit"):
            c.create_session(ids)
        with pytest.raises(kakeya.InvalidArgumentError, match=r"eos_token_ids\[\d\]"):
            c.create_session([1], eos_token_ids=ids)


@pytest.mark.parametrize("kw, name", [(dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(temperature=float("inf")), "temperature"),
                                      (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("nan")), "top_p"),
                                      (dict(top_k=-1), "top_k"), (dict(top_k=2**31), "top_k"), (dict(max_tokens=2**32), "max_tokens"),
                                      (dict(max_tokens=2.0), "max_tokens")])
def test_generate_options_the_wire_cannot_carry_are_invalid_argument(kw, name):
    with kakeya.Client(DEAD) as c:
        with pytest.raises(kakeya.InvalidArgumentError, match=rf"^{name} must be"):
            list(c.session("x" * 32).generate(**kw))
    with pytest.raises(kakeya.InvalidArgumentError, match=r"^start must be"):
        kakeya.Client(DEAD).session("x" * 32).history(-1)


def test_the_async_client_checks_the_same():
    async def main():
        async with kakeya.AsyncClient(DEAD) as c:
            s = c.session("x" * 32)
            with pytest.raises(kakeya.InvalidArgumentError, match="is not a 32-bit"):
                await s.append([2**40])
            with pytest.raises(kakeya.InvalidArgumentError, match="seed"):
                async for _ in s.generate(seed=-1):
                    pass

    asyncio.run(main())


def test_numpy_integer_ids_are_accepted():
    from kakeya.requests import append_request

    assert list(append_request("s", np.array([1, 2, 3], dtype=np.int64)).token_ids) == [1, 2, 3]
