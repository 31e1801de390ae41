/**
 * Every session call carries `x-kakeya-session` (so a proxy can hash it), createSession picks the id,
 * and a call a daemon refuses as owned elsewhere (UNAVAILABLE + `kakeya-session-owner` trailing
 * metadata) is retried until it goes through or `ownerWaitMs` runs out. A fake daemon on a loopback
 * port records what arrives; no model is needed.
 */
import { Metadata, Server, ServerCredentials, status, type ServerUnaryCall, type ServerWritableStream, type sendUnaryData } from "@grpc/grpc-js";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import {
  AppendTokensResponse,
  CloseSessionResponse,
  CreateSessionResponse,
  GenerateResponse,
  GetHistoryResponse,
  GetServerInfoResponse,
  GetSessionInfoResponse,
  RuntimeServiceService,
  type GenerateRequest,
} from "../src/gen/kakeya/v1/runtime.js";
import { newSessionId } from "../src/client.js";
import { AlreadyExistsError, Client, InvalidArgumentError, SESSION_HEADER, SessionOwnedElsewhereError, UnavailableError } from "../src/index.js";

interface Fake {
  target: string;
  calls: Array<[string, string | undefined]>;
  owned: number;
  refused: Map<string, number>;
}

let server: Server;
const fake: Fake = { target: "", calls: [], owned: 0, refused: new Map() };

function arrive(method: string, md: Metadata): { code: number; details: string; metadata: Metadata } | null {
  const header = md.get(SESSION_HEADER)[0];
  fake.calls.push([method, header === undefined ? undefined : String(header)]);
  const n = fake.refused.get(method) ?? 0;
  if (method === "GetServerInfo" || n >= fake.owned) return null;
  fake.refused.set(method, n + 1);
  const trailers = new Metadata();
  trailers.set("kakeya-session-owner", "replica-b");
  return { code: status.UNAVAILABLE, details: "session held by replica-b; asked it to let go", metadata: trailers };
}

function unary(method: string, answer: (req: any) => object) {
  return (call: ServerUnaryCall<any, any>, cb: sendUnaryData<any>) => {
    const refusal = arrive(method, call.metadata);
    if (refusal) return cb(refusal, null);
    if (method === "CreateSession" && call.request.sessionId === "taken-id-0000") {
      return cb({ code: status.ALREADY_EXISTS, details: "session 'taken-id-0000' already exists" }, null);
    }
    cb(null, answer(call.request));
  };
}

beforeAll(async () => {
  server = new Server();
  server.addService(RuntimeServiceService, {
    createSession: unary("CreateSession", (r) => CreateSessionResponse.fromPartial({ sessionId: r.sessionId })),
    appendTokens: unary("AppendTokens", (r) => AppendTokensResponse.fromPartial({ historyLength: r.tokenIds.length })),
    getSessionInfo: unary("GetSessionInfo", (r) => GetSessionInfoResponse.fromPartial({ sessionId: r.sessionId })),
    getHistory: unary("GetHistory", () => GetHistoryResponse.fromPartial({ tokenIds: [1, 2], historyLength: 2 })),
    closeSession: unary("CloseSession", () => CloseSessionResponse.fromPartial({})),
    getServerInfo: unary("GetServerInfo", () => GetServerInfoResponse.fromPartial({ modelId: "fake" })),
    generate: (call: ServerWritableStream<GenerateRequest, GenerateResponse>) => {
      const refusal = arrive("Generate", call.metadata);
      if (refusal) return call.emit("error", refusal);
      for (let i = 0; i < 3; i++) call.write(GenerateResponse.fromPartial({ token: { tokenId: 10 + i, position: i } }));
      call.write(GenerateResponse.fromPartial({ done: { stopReason: 1, generatedTokens: 3 } }));
      call.end();
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  fake.target = `127.0.0.1:${port}`;
});

afterAll(() => server.forceShutdown());

const SESSION_CALLS = ["CreateSession", "AppendTokens", "Generate", "GetSessionInfo", "GetHistory", "CloseSession"];

async function oneOfEach(client: Client): Promise<string> {
  const s = await client.createSession({ initialTokens: [1] });
  await s.append([2]);
  const got: number[] = [];
  for await (const t of s.generate({ maxTokens: 3 })) got.push(t);
  expect(got).toEqual([10, 11, 12]);
  await s.info();
  expect(await s.history()).toEqual([1, 2]);
  await s.close();
  await client.serverInfo();
  return s.id;
}

describe("routing by session id", () => {
  it("sends the session header on every session call and picks the id", async () => {
    fake.calls = [];
    fake.owned = 0;
    const client = new Client(fake.target);
    const id = await oneOfEach(client);
    expect(id).toMatch(/^[A-Za-z0-9_-]{32}$/);
    expect(fake.calls).toEqual([...SESSION_CALLS.map((m) => [m, id]), ["GetServerInfo", undefined]]);
    expect((await client.createSession({ sessionId: "my-chosen-id" })).id).toBe("my-chosen-id");
    await expect(client.createSession({ sessionId: "taken-id-0000" })).rejects.toBeInstanceOf(AlreadyExistsError);
    await expect(client.createSession({ sessionId: "no spaces" })).rejects.toBeInstanceOf(InvalidArgumentError);
    client.close();
  });

  it("never picks an id starting with a dash (a command line would read it as an option)", () => {
    // 2,000 draws: without the redraw, one in 64 starts with "-", so this fails with odds 1 - (63/64)^2000.
    const ids = Array.from({ length: 2000 }, () => newSessionId());
    expect(ids.filter((id) => id.startsWith("-"))).toEqual([]);
    expect(ids.every((id) => /^[A-Za-z0-9_-]{32}$/.test(id))).toBe(true);
  });

  it("retries calls refused as owned elsewhere until they go through", async () => {
    fake.calls = [];
    fake.owned = 2;
    fake.refused = new Map();
    const client = new Client(fake.target, { ownerWaitMs: 30_000 });
    const id = await oneOfEach(client);
    for (const m of SESSION_CALLS) expect(fake.calls.filter((c) => c[0] === m)).toEqual([[m, id], [m, id], [m, id]]);
    client.close();
  });

  it("throws the typed error once ownerWaitMs has passed", async () => {
    fake.calls = [];
    fake.owned = 1_000_000;
    fake.refused = new Map();
    const client = new Client(fake.target, { ownerWaitMs: 200 });
    const s = client.session("held-by-b-000");
    const err = await s.append([1]).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SessionOwnedElsewhereError);
    expect(err).toBeInstanceOf(UnavailableError);
    expect((err as SessionOwnedElsewhereError).owner).toBe("replica-b");
    await expect(s.generateAll({ maxTokens: 2 })).rejects.toBeInstanceOf(SessionOwnedElsewhereError);
    expect(fake.calls.filter((c) => c[0] === "AppendTokens").length).toBeGreaterThanOrEqual(2);
    client.close();
  });
});
