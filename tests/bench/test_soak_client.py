"""``vattn bench soak``'s load: the request plan and the streaming client, against a fake server."""

import asyncio
import json

import pytest

from vattn.bench.soak_client import LoadSpec, Request, one_request, parse_url, plan_requests, run_load
from vattn.core.errors import ConfigError


def test_the_plan_is_seeded_and_within_bounds():
    spec = LoadSpec(num_requests=2000, rate=50.0, input_len=(1, 3000), output_len=(1, 500),
                    abort_share=0.1, prefix_share=0.4, num_prefixes=3, prefix_len=700, vocab=97,
                    max_model_len=2048, seed=5)
    plan = plan_requests(spec)
    assert plan == plan_requests(spec) and plan != plan_requests(LoadSpec(**{**spec.__dict__, "seed": 6}))
    assert [r.at_s for r in plan] == sorted(r.at_s for r in plan)
    assert 2000 / 50 * 0.9 < plan[-1].at_s < 2000 / 50 * 1.1          # Poisson at 50 / s
    for r in plan:
        assert 1 <= len(r.prompt) <= 2047 and 1 <= r.max_tokens <= 500
        assert len(r.prompt) + r.max_tokens <= 2048 and all(1 <= t < 97 for t in r.prompt)
        assert r.abort_after is None or 0 <= r.abort_after < max(1, r.max_tokens)
    shared = [r for r in plan if r.prefix is not None]
    assert 0.35 < len(shared) / 2000 < 0.45 and 0.07 < sum(r.abort_after is not None for r in plan) / 2000 < 0.13
    heads = {}
    for r in shared:                                   # one prefix, the same tokens every time
        n = min(len(r.prompt) - 1, 700)
        head = heads.setdefault(r.prefix, r.prompt[:n])
        m = min(n, len(head))
        assert r.prompt[:m] == head[:m]
        if n > len(head):
            heads[r.prefix] = r.prompt[:n]
    assert len(heads) == 3 and len({tuple(h[:20]) for h in heads.values()}) == 3
    lens = sorted(len(r.prompt) for r in plan)
    assert lens[len(lens) // 2] < 400                  # log-uniform: short prompts dominate
    assert all(r.at_s == 0 for r in plan_requests(LoadSpec(num_requests=5, rate=float("inf"))))


@pytest.mark.parametrize("bad, match", [
    (dict(input_len=(0, 5)), "input_len: expected 1 <= low <= high"),
    (dict(output_len=(9, 5)), "output_len"), (dict(rate=0.0), "rate > 0"),
    (dict(abort_share=1.5), "abort_share: expected a share"), (dict(vocab=1), "vocab >= 2"),
    (dict(max_model_len=1), "max_model_len: expected >= 2")])
def test_bad_load_specs(bad, match):
    with pytest.raises(ConfigError, match=match):
        LoadSpec(**{"num_requests": 3, "rate": 1.0, **bad})


class FakeServer:
    """A streaming /v1/completions server; ``prompt[0]`` picks its behaviour."""

    def __init__(self):
        self.open = self.most_open = 0
        self.hangups = 0
        self.bodies = []

    async def handle(self, reader, writer):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            kind, n = body["prompt"][0], body["max_tokens"]
            if kind == 3:
                msg = b'{"error": "boom"}'
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg))
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

            def chunk(data: bytes):
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))

            for i in range(n):
                chunk(b'data: {"choices": [{"text": "t%d"}]}\n\n' % i)
                await writer.drain()
                await asyncio.sleep(0.005)
            if kind == 4:                                # the stream breaks off
                return
            usage = n - 1 if kind == 2 else n
            chunk(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % usage)
            chunk(b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.hangups += 1
        finally:
            self.open -= 1
            writer.close()


async def _with_server(coro_fn):
    fake = FakeServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await coro_fn(fake, port)
    return fake, result


def _req(kind, n, abort=None, i=0):
    return Request(i, 0.0, [kind, 5, 6], n, abort, None)


def test_one_request_ok_short_error_broken_and_aborted():
    async def go(fake, port):
        out = {}
        for name, req in (("ok", _req(1, 6)), ("short", _req(2, 6)), ("http", _req(3, 6)),
                          ("broken", _req(4, 3)), ("abort", _req(1, 200, abort=2))):
            out[name] = await one_request("127.0.0.1", port, "m", req, 0.0, timeout_s=30)
        await asyncio.sleep(0.2)
        return out

    fake, out = asyncio.run(_with_server(go))
    assert out["ok"].status == "ok" and out["ok"].output_tokens == 6 and out["ok"].ttft_s > 0
    assert out["short"].status == "error" and "the usage says 5" in out["short"].error
    assert out["http"].status == "error" and out["http"].error.startswith("HTTP 500")
    assert out["broken"].status == "error" and "[DONE]" in out["broken"].error
    assert out["abort"].status == "aborted" and out["abort"].output_tokens == 3
    assert fake.hangups == 1                            # the server saw the client hang up
    body = fake.bodies[0]
    assert body["ignore_eos"] is True and body["stream"] is True and body["prompt"] == [1, 5, 6]


def test_run_load_keeps_to_max_in_flight_and_the_deadline():
    reqs = [Request(i, 0.0 if i < 12 else 30.0, [1, i + 7], 4, None, None) for i in range(14)]
    sent, done = [], []

    async def go(fake, port):
        return await run_load(f"http://127.0.0.1:{port}", "m", reqs, max_in_flight=3,
                              on_send=lambda r: sent.append(r.index), on_done=done.append, stop_after_s=5.0)

    fake, results = asyncio.run(_with_server(go))
    assert fake.most_open <= 3 and len(results) == 12 == len(sent) == len(done)   # 2 would come after 5 s
    assert all(r.status == "ok" for r in results)
    with pytest.raises(ConfigError, match="max_in_flight"):
        asyncio.run(run_load("http://127.0.0.1:1", "m", reqs, max_in_flight=0))
    with pytest.raises(ConfigError, match="http://HOST:PORT"):
        parse_url("localhost")


def test_run_load_sends_nothing_more_once_halted():
    reqs = [Request(i, 0.0, [1, i + 7], 4, None, None) for i in range(10)]
    halt = asyncio.Event()

    def on_send(r):
        if r.index == 3:
            halt.set()                                  # the soak's sampler saw the engine die

    async def go(fake, port):
        return await run_load(f"http://127.0.0.1:{port}", "m", reqs, max_in_flight=2,
                              on_send=on_send, halt=halt)

    _, results = asyncio.run(_with_server(go))
    assert sorted(r.index for r in results) == [0, 1, 2, 3]   # the ones sent still finish


def test_a_dead_server_is_an_error_not_a_hang():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return await one_request("127.0.0.1", port, "m", _req(1, 2), 0.0, timeout_s=5)

    res = asyncio.run(go())
    assert res.status == "error" and ("Connect" in res.error or "refused" in res.error.lower()), res.error
