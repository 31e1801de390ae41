/**
 * Connection to a Kakeya daemon over gRPC (HTTP/2 via @grpc/grpc-js). Mirrors
 * `kakeya.Client` in the Python SDK: create sessions, read server info, close.
 */
import { randomBytes } from "node:crypto";

import type { ChannelCredentials, ClientOptions as GrpcChannelOptions } from "@grpc/grpc-js";

import type { CreateSessionResponse, GetServerInfoResponse } from "./gen/kakeya/v1/runtime.js";
import { InvalidArgumentError } from "./errors.js";
import { Rpc, SESSION_ID, tokenIds, type RequestOptions } from "./rpc.js";
import { Session } from "./session.js";
import { serverInfo, type ServerInfo } from "./types.js";

export interface ClientOptions {
  /** Sent as `authorization: Bearer <apiKey>` on every call (daemon started with --api-key). */
  apiKey?: string;
  /** Channel credentials; default insecure (the daemon serves plaintext on loopback). */
  credentials?: ChannelCredentials;
  /** Extra grpc-js channel options, e.g. `{ "grpc.max_receive_message_length": ... }`. */
  channelOptions?: Partial<GrpcChannelOptions>;
  /**
   * How long a session call keeps retrying while another daemon still holds the session
   * (`SessionOwnedElsewhereError`, e.g. a replica behind a proxy died and its lease has not expired)
   * before throwing it. Default 60 000 ms.
   */
  ownerWaitMs?: number;
}

export interface CreateSessionOptions extends RequestOptions {
  /** Initial history; validated like `Session.append`. */
  initialTokens?: Iterable<number>;
  /** Token ids that end generation; empty means the model's default eos ids. */
  eosTokenIds?: Iterable<number>;
  /** Never stop on eos (eosTokenIds is ignored). */
  ignoreEos?: boolean;
  /**
   * The session's id: 8 to 128 characters of [A-Za-z0-9_-]; an id in use throws `AlreadyExistsError`.
   * Default: 24 random bytes chosen here (url-safe base64), so that a proxy routes the create call like
   * every later call of the session (they all carry the id as `x-kakeya-session` metadata).
   */
  sessionId?: string;
}

export class Client {
  readonly target: string;
  readonly #rpc: Rpc;

  /**
   * `target` is HOST:PORT (default: $KAKEYA_ADDRESS, the one variable every client and example reads, else
   * the daemon's default 127.0.0.1:50051). No connection is made until the first call.
   */
  constructor(target: string = process.env.KAKEYA_ADDRESS || "127.0.0.1:50051", options: ClientOptions = {}) {
    this.target = target;
    this.#rpc = new Rpc(target, options);
  }

  async createSession(options: CreateSessionOptions = {}): Promise<Session> {
    const sessionId = options.sessionId ?? newSessionId();
    if (typeof sessionId !== "string" || !SESSION_ID.test(sessionId)) {
      throw new InvalidArgumentError(
        `sessionId ${JSON.stringify(sessionId)} is not a valid session id: use 8 to 128 characters of [A-Za-z0-9_-], or leave it out for a random one`,
      );
    }
    const request = {
      initialTokens: tokenIds(options.initialTokens ?? [], "initialTokens"),
      eosTokenIds: tokenIds(options.eosTokenIds ?? [], "eosTokenIds"),
      ignoreEos: options.ignoreEos ?? false,
      sessionId,
    };
    const r = await this.#rpc.unary<CreateSessionResponse>(
      (md, o, cb) => this.#rpc.stub.createSession(request, md, o, cb),
      options,
      sessionId,
    );
    return new Session(this.#rpc, r.sessionId);
  }

  /** A handle on an existing session id (no RPC). */
  session(sessionId: string): Session {
    return new Session(this.#rpc, sessionId);
  }

  /** The loaded model, vocabulary size, default eos ids and KV strategy. */
  async serverInfo(options?: RequestOptions): Promise<ServerInfo> {
    const r = await this.#rpc.unary<GetServerInfoResponse>((md, o, cb) => this.#rpc.stub.getServerInfo({}, md, o, cb), options);
    return serverInfo(r);
  }

  /** Close the channel. Calls already in flight run to their end; later calls throw `CancelledError`. */
  close(): void {
    this.#rpc.close();
  }

  /** `using client = new Client(...)` closes it at scope exit. */
  [Symbol.dispose](): void {
    this.close();
  }
}

/** 24 random bytes as base64url (32 characters), never starting with "-" (as the daemon's ids): a command line
 * (`kakeya chat --session ID`) would read such an id as an option. */
export function newSessionId(): string {
  for (;;) {
    const id = randomBytes(24).toString("base64url");
    if (!id.startsWith("-")) return id;
  }
}
