import { afterAll, describe, expect, inject, it } from "vitest";

import { AlreadyExistsError, CancelledError, Client, SessionNotFoundError, type Session } from "../src/index.js";

const client = new Client(inject("openTarget"));
afterAll(() => client.close());

const PROMPT = [1, 17, 42, 99, 7, 3, 250, 64];

async function collect(session: Session, options: Parameters<Session["generate"]>[0]): Promise<number[]> {
  const out: number[] = [];
  for await (const id of session.generate(options)) out.push(id);
  return out;
}

describe("session lifecycle", () => {
  it("creates, appends, generates, reports info and closes", async () => {
    const session = await client.createSession({ ignoreEos: true });
    expect(session.id).toMatch(/\S{16,}/);
    expect(await session.append(PROMPT.slice(0, 5))).toBe(5);
    expect(await session.append(PROMPT.slice(5))).toBe(PROMPT.length);

    let info = await session.info();
    expect(info).toMatchObject({ sessionId: session.id, historyLength: PROMPT.length, pendingTokens: PROMPT.length });

    const tokens = await collect(session, { maxTokens: 6 });
    expect(tokens).toHaveLength(6);
    for (const t of tokens) expect(Number.isInteger(t) && t >= 0 && t < 256).toBe(true);
    const result = session.lastResult!;
    expect(result).toMatchObject({ stopReason: "max_tokens", generatedTokens: 6, prefillTokens: PROMPT.length, tokens });
    expect(result.totalSeconds).toBeGreaterThan(0);
    expect(result.timeToFirstTokenSeconds).toBeGreaterThan(0);

    info = await session.info();
    expect(info.historyLength).toBe(PROMPT.length + 6);
    // The turn was saved before Done: all of it is durable, and the handle knows.
    expect(result).toMatchObject({ durableLength: PROMPT.length + 6, saveError: "", reencodedTokens: 0 });
    expect(info).toMatchObject({ durableLength: PROMPT.length + 6, saveError: "" });
    expect(session.durableLength).toBe(PROMPT.length + 6);
    expect(info.kvLiveBytes).toBeGreaterThan(0);
    // sink_window keeps everything in the hot set: no page selection data, no page store in RAM or on disk.
    expect(info).toMatchObject({ kvResidentBytes: info.kvLiveBytes, kvSelectionBytes: 0, kvStoredBytes: 0, kvColdBytes: 0 });

    // The next call prefills only what the previous one left pending plus the new tokens.
    await session.append([5, 6, 7]);
    const pending = (await session.info()).pendingTokens;
    expect(pending).toBeGreaterThanOrEqual(3);
    const second = await session.generateAll({ maxTokens: 2 });
    expect(second.prefillTokens).toBe(pending);
    expect((await session.info()).historyLength).toBe(PROMPT.length + 6 + 3 + 2);

    await session.close();
    expect(session.closed).toBe(true);
    await session.close(); // idempotent on the handle
    await expect(session.info()).rejects.toBeInstanceOf(SessionNotFoundError);
  });

  it("takes a client-chosen id once it is free", async () => {
    const sessionId = `ts-chosen-${Date.now()}-abcdefgh`;
    const session = await client.createSession({ sessionId, initialTokens: [1, 2] });
    expect(session.id).toBe(sessionId);
    await expect(client.createSession({ sessionId })).rejects.toBeInstanceOf(AlreadyExistsError);
    expect((await session.info()).historyLength).toBe(2);
    await session.close();
    const again = await client.createSession({ sessionId });
    expect((await again.info()).historyLength).toBe(0);
    await again.close();
  });

  it("takes initial tokens, typed arrays and custom eos ids", async () => {
    const session = await client.createSession({ initialTokens: Int32Array.from(PROMPT), eosTokenIds: [3, 4] });
    const info = await session.info();
    expect(info.historyLength).toBe(PROMPT.length);
    expect(info.eosTokenIds).toEqual([3, 4]);
    await session.close();
  });

  it("stops on eos and reports it", async () => {
    // Every token but the first generated one is eos: the call must stop right after it.
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    const [first] = await collect(session, { maxTokens: 1 });
    await session.close();
    const eosSession = await client.createSession({ initialTokens: PROMPT, eosTokenIds: [first!] });
    const tokens = await collect(eosSession, { maxTokens: 50 });
    expect(tokens).toEqual([first]);
    expect(eosSession.lastResult?.stopReason).toBe("eos");
    await eosSession.close();
  });

  it("disposes with `await using`", async () => {
    let id: string;
    {
      await using session = await client.createSession({ initialTokens: PROMPT });
      id = session.id;
    }
    await expect(client.session(id).info()).rejects.toBeInstanceOf(SessionNotFoundError);
  });
});

describe("streaming", () => {
  it("yields each token as the server commits it, not at the end", async () => {
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    const arrivals: number[] = [];
    for await (const _ of session.generate({ maxTokens: 200 })) {
      expect(session.lastResult).toBeUndefined(); // Done has not arrived yet
      arrivals.push(performance.now());
    }
    const r = session.lastResult!;
    expect(arrivals).toHaveLength(200);
    expect(r.generatedTokens).toBe(200);
    // Streamed tokens spread over the server's decode time; a buffered reply would arrive at once.
    const decodeMs = (r.totalSeconds - r.timeToFirstTokenSeconds) * 1000;
    expect(arrivals.at(-1)! - arrivals[0]!).toBeGreaterThan(0.25 * decodeMs);
    await session.close();
  });

  it("reports history truncation under the sink+window strategy", async () => {
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    const result = await session.generateAll({ maxTokens: 60 });
    expect(result.historyTruncated.length).toBeGreaterThan(0);
    const last = result.historyTruncated.at(-1)!;
    const dropped = result.historyTruncated.reduce((n, t) => n + t.droppedTokens, 0);
    expect(last.totalDroppedTokens).toBe(dropped);
    const info = await session.info();
    expect(info.droppedTokens).toBe(last.totalDroppedTokens);
    expect(info.residentPositions).toBeLessThanOrEqual(4 + 32);
    await session.close();
  });
});

describe("determinism", () => {
  it("greedy: the same history gives the same tokens, however it was built", async () => {
    const shapes = [
      async () => client.createSession({ initialTokens: PROMPT, ignoreEos: true }),
      async () => {
        const s = await client.createSession({ ignoreEos: true });
        await s.append(PROMPT);
        return s;
      },
      async () => {
        const s = await client.createSession({ ignoreEos: true });
        for (const t of PROMPT) await s.append([t]);
        return s;
      },
    ];
    const runs: number[][] = [];
    for (const make of shapes) {
      const s = await make();
      runs.push(await collect(s, { maxTokens: 24 }));
      await s.close();
    }
    expect(runs[0]).toHaveLength(24);
    expect(runs[1]).toEqual(runs[0]);
    expect(runs[2]).toEqual(runs[0]);
  });

  it("sampling: the same seed gives the same tokens", async () => {
    const sample = async (seed: number) => {
      const s = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
      const out = await collect(s, { maxTokens: 24, temperature: 1.0, topK: 50, topP: 0.95, seed });
      await s.close();
      return out;
    };
    const a = await sample(1234);
    expect(await sample(1234)).toEqual(a);
    expect(await sample(99)).not.toEqual(a);
  });
});

describe("cancellation", () => {
  it("aborting mid-stream cancels the call and leaves the session usable", async () => {
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    const controller = new AbortController();
    const received: number[] = [];
    const consume = async () => {
      for await (const id of session.generate({ maxTokens: 100_000, signal: controller.signal })) {
        received.push(id);
        if (received.length === 5) controller.abort(new Error("user pressed stop"));
      }
    };
    const err = await consume().then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(CancelledError);
    expect((err as CancelledError).codeName).toBe("CANCELLED");
    expect(((err as CancelledError).cause as Error).message).toBe("user pressed stop");
    expect(received).toHaveLength(5);
    expect(session.lastResult).toBeUndefined();

    // The server stopped, far below the 100k asked for. It may have committed a few tokens
    // past the last one received; history() waits for the cancelled call to wind down and
    // shows them all.
    const committed = await session.history(PROMPT.length);
    expect(committed.slice(0, 5)).toEqual(received);
    expect(committed.length).toBeLessThan(100_000);
    const length = await session.append([11, 12]);
    expect(length).toBe(PROMPT.length + committed.length + 2);
    expect(length).toBeGreaterThanOrEqual(PROMPT.length + 5 + 2);
    expect(length).toBeLessThan(PROMPT.length + 100_000);
    expect((await session.info()).historyLength).toBe(length);
    const next = await session.generateAll({ maxTokens: 4 });
    expect(next.generatedTokens).toBe(4);
    expect((await session.info()).historyLength).toBe(length + 4);
    await session.close();
  });

  it("breaking out of the loop cancels the server-side call", async () => {
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    let n = 0;
    for await (const _ of session.generate({ maxTokens: 100_000 })) if (++n === 3) break;
    // Append waits for the server's Generate to release the session, so it proves it ended.
    const length = await session.append([9]);
    expect(length).toBeLessThan(PROMPT.length + 100_000);
    await new Promise((r) => setTimeout(r, 200));
    expect((await session.info()).historyLength).toBe(length);
    await session.close();
  });

  it("an already-aborted signal throws before any call", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const it = session.generate({ maxTokens: 4, signal: AbortSignal.abort() });
    await expect(it.next()).rejects.toBeInstanceOf(CancelledError);
    await expect(session.append([1], { signal: AbortSignal.abort() })).rejects.toBeInstanceOf(CancelledError);
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });
});
