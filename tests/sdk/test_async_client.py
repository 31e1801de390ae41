"""AsyncClient (grpc.aio) against a real server."""
import asyncio

import pytest

import kakeya
from factories import make_engine, start_server


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_engine("qwen3", "full"))
    yield srv
    srv.stop()


def test_async_session_roundtrip_matches_sync(server):
    target = f"127.0.0.1:{server.port}"
    with kakeya.Client(target) as c, c.create_session([10, 11, 12], ignore_eos=True) as s:
        expected = list(s.generate(max_tokens=6))

    async def main():
        async with kakeya.AsyncClient(target) as ac:
            info = await ac.server_info()
            assert info.kv_strategy == "full"
            async with await ac.create_session(ignore_eos=True) as s:
                await s.append([10, 11, 12])
                toks = [t async for t in s.generate(max_tokens=6)]
                assert s.last_result.generated_tokens == 6
                assert (await s.info()).history_length == 9
            with pytest.raises(kakeya.SessionNotFoundError):
                await s.info()
            return toks

    assert asyncio.run(main()) == expected


def test_async_errors_are_typed(server):
    async def main():
        async with kakeya.AsyncClient(f"127.0.0.1:{server.port}") as ac:
            s = await ac.create_session()
            with pytest.raises(kakeya.InvalidArgumentError):
                await s.append([10**6])
            await s.close()

    asyncio.run(main())
