/** Each gRPC status the open daemon returns surfaces as its typed error, and a rejected call changes nothing. */
import { afterAll, describe, expect, inject, it } from "vitest";

import {
  Client,
  DeadlineExceededError,
  FailedPreconditionError,
  InvalidArgumentError,
  KakeyaError,
  SessionNotFoundError,
  Status,
  UnavailableError,
} from "../src/index.js";

const client = new Client(inject("openTarget"));
afterAll(() => client.close());

const PROMPT = [1, 17, 42, 99];

async function drain(it: AsyncIterable<number>): Promise<void> {
  for await (const _ of it) {
    // drain
  }
}

describe("NOT_FOUND", () => {
  it("every session call on an unknown id throws SessionNotFoundError", async () => {
    const ghost = client.session("no-such-session");
    const calls: Array<[string, () => Promise<unknown>]> = [
      ["append", () => ghost.append([1])],
      ["generate", () => drain(ghost.generate({ maxTokens: 1 }))],
      ["info", () => ghost.info()],
      ["close", () => ghost.close()],
    ];
    for (const [name, call] of calls) {
      const err = await call().then(
        () => new Error(`${name} succeeded`),
        (e: unknown) => e,
      );
      expect(err, name).toBeInstanceOf(SessionNotFoundError);
      expect((err as KakeyaError).code, name).toBe(Status.NOT_FOUND);
      expect((err as KakeyaError).details, name).toContain("no-such-session");
    }
  });

  it("a closed session is gone", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    await session.close();
    await expect(client.session(session.id).append([1])).rejects.toBeInstanceOf(SessionNotFoundError);
  });
});

describe("INVALID_ARGUMENT", () => {
  it.each([
    ["id == vocab size", [256]],
    ["id > vocab size", [1, 2, 100_000]],
    ["negative id", [5, -1]],
  ])("rejects an append with %s and leaves the history unchanged", async (_what, ids) => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const err = await session.append(ids).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidArgumentError);
    expect((err as KakeyaError).code).toBe(Status.INVALID_ARGUMENT);
    expect((err as KakeyaError).details).toMatch(/outside the model vocabulary/);
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("rejects an empty append", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    const err = await session.append([]).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(InvalidArgumentError);
    expect((err as KakeyaError).details).toMatch(/empty/);
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("rejects bad initial tokens and eos ids at creation", async () => {
    await expect(client.createSession({ initialTokens: [1, 300] })).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(client.createSession({ eosTokenIds: [-2] })).rejects.toBeInstanceOf(InvalidArgumentError);
  });

  it("rejects bad generation parameters", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    await expect(drain(session.generate({ maxTokens: 0 }))).rejects.toBeInstanceOf(InvalidArgumentError);
    await expect(drain(session.generate({ maxTokens: 4, temperature: -1 }))).rejects.toBeInstanceOf(InvalidArgumentError);
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });

  it("rejects values the wire cannot carry before sending them", async () => {
    const session = await client.createSession({ initialTokens: PROMPT });
    for (const ids of [[1.5], [2 ** 31], [Number.NaN]]) {
      const err = await session.append(ids).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(InvalidArgumentError);
      expect((err as KakeyaError).details).toContain(`ids[0] = ${ids[0]}`);
    }
    await expect(drain(session.generate({ maxTokens: -1 }))).rejects.toThrow(/maxTokens/);
    await expect(drain(session.generate({ seed: 0.5 }))).rejects.toThrow(/seed/);
    expect((await session.info()).historyLength).toBe(PROMPT.length);
    await session.close();
  });
});

describe("FAILED_PRECONDITION", () => {
  it("generating from an empty history", async () => {
    const session = await client.createSession();
    const err = await drain(session.generate({ maxTokens: 2 })).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(FailedPreconditionError);
    expect((err as KakeyaError).details).toMatch(/empty/);
    await session.append(PROMPT); // still usable
    expect((await session.generateAll({ maxTokens: 2 })).generatedTokens).toBeGreaterThan(0);
    await session.close();
  });
});

describe("DEADLINE_EXCEEDED", () => {
  it("a Generate past its timeoutMs; the session stays usable", async () => {
    const session = await client.createSession({ initialTokens: PROMPT, ignoreEos: true });
    const err = await drain(session.generate({ maxTokens: 100_000, timeoutMs: 300 })).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(DeadlineExceededError);
    await session.append([5]); // waits for the server to let go of the session
    expect((await session.generateAll({ maxTokens: 2 })).generatedTokens).toBe(2);
    await session.close();
  });
});

describe("UNAVAILABLE", () => {
  it("no daemon on the target", async () => {
    const nowhere = new Client("127.0.0.1:1");
    await expect(nowhere.serverInfo()).rejects.toBeInstanceOf(UnavailableError);
    nowhere.close();
  });
});
