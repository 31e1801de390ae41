/**
 * The transport under Client and Session: one grpc-js channel, the API-key metadata, and
 * promise-returning unary calls that honour an AbortSignal / timeout and throw typed errors.
 * Callers never see grpc-js objects.
 */
import {
  credentials as grpcCredentials,
  Metadata,
  type CallOptions,
  type ChannelCredentials,
  type ClientOptions,
  type ClientReadableStream,
  type ClientUnaryCall,
  type ServiceError,
} from "@grpc/grpc-js";

import { aborted, CancelledError, InvalidArgumentError, SessionOwnedElsewhereError, toKakeyaError } from "./errors.js";
import { RuntimeServiceClient, type GenerateRequest, type GenerateResponse } from "./gen/kakeya/v1/runtime.js";

/** Per-call settings accepted by every SDK method that makes an RPC. */
export interface RequestOptions {
  /** Aborting cancels the call; the method then throws a `CancelledError`. */
  signal?: AbortSignal;
  /** Deadline in milliseconds from now; past it the call fails with `DeadlineExceededError`. */
  timeoutMs?: number;
}

export interface TransportOptions {
  apiKey?: string | undefined;
  credentials?: ChannelCredentials | undefined;
  channelOptions?: Partial<ClientOptions> | undefined;
  ownerWaitMs?: number | undefined;
}

/** Request metadata carrying the session id on every session call, so a proxy can hash it. */
export const SESSION_HEADER = "x-kakeya-session";
export const DEFAULT_OWNER_WAIT_MS = 60_000;
/** The daemon's session id rule (inference_engine/session/store.py). */
export const SESSION_ID = /^[A-Za-z0-9_-]{8,128}$/;
const RETRY_FIRST_MS = 50;
const RETRY_MAX_MS = 500;

/**
 * Backoff for calls answered `SessionOwnedElsewhereError`: `delay(err)` is how long to wait before
 * the next try; it rethrows `err` once `waitMs` have passed since the first call.
 */
export class OwnerWait {
  readonly #deadline: number;
  #next = RETRY_FIRST_MS;

  constructor(waitMs: number) {
    this.#deadline = Date.now() + Math.max(0, waitMs);
  }

  delay(err: SessionOwnedElsewhereError): number {
    const left = this.#deadline - Date.now();
    if (left <= 0) throw err;
    const d = Math.min(this.#next, left);
    this.#next = Math.min(RETRY_MAX_MS, this.#next * 2);
    return d;
  }
}

export function pause(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(aborted(signal));
    const onAbort = () => {
      clearTimeout(timer);
      reject(aborted(signal!));
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

type Callback<Res> = (err: ServiceError | null, res?: Res) => void;

export class Rpc {
  readonly stub: RuntimeServiceClient;
  readonly ownerWaitMs: number;
  private readonly metadata: Metadata;
  private closed = false;

  constructor(target: string, options: TransportOptions) {
    this.stub = new RuntimeServiceClient(target, options.credentials ?? grpcCredentials.createInsecure(), options.channelOptions);
    this.metadata = new Metadata();
    if (options.apiKey) this.metadata.set("authorization", `Bearer ${options.apiKey}`);
    this.ownerWaitMs = options.ownerWaitMs ?? DEFAULT_OWNER_WAIT_MS;
  }

  /**
   * The metadata of a call: the API key, and for a session call the routing header. An id no session can
   * have (not 8-128 characters of [A-Za-z0-9_-]; some are not even legal header values) is not routed: any
   * daemon answers NOT_FOUND for it.
   */
  callMetadata(sessionId?: string): Metadata {
    const md = this.metadata.clone();
    if (sessionId !== undefined && SESSION_ID.test(sessionId)) md.set(SESSION_HEADER, sessionId);
    return md;
  }

  /**
   * Run one unary call: `start(metadata, callOptions, callback)` issues it on the stub. With `sessionId`
   * the call carries the routing header and is retried while another daemon holds the session.
   */
  async unary<Res>(
    start: (md: Metadata, opts: CallOptions, cb: Callback<Res>) => ClientUnaryCall,
    options: RequestOptions = {},
    sessionId?: string,
  ): Promise<Res> {
    const wait = new OwnerWait(this.ownerWaitMs);
    for (;;) {
      try {
        return await this.#unaryOnce(start, options, sessionId);
      } catch (err) {
        if (sessionId === undefined || !(err instanceof SessionOwnedElsewhereError)) throw err;
        await pause(wait.delay(err), options.signal);
      }
    }
  }

  #unaryOnce<Res>(
    start: (md: Metadata, opts: CallOptions, cb: Callback<Res>) => ClientUnaryCall,
    options: RequestOptions,
    sessionId?: string,
  ): Promise<Res> {
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(aborted(signal));
    if (this.closed) return Promise.reject(closedError());
    return new Promise<Res>((resolve, reject) => {
      const call = start(this.callMetadata(sessionId), callOptions(options), (err, res) => {
        signal?.removeEventListener("abort", onAbort);
        if (err) reject(toKakeyaError(err, signal));
        else resolve(res as Res);
      });
      const onAbort = () => call.cancel();
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** Start a Generate stream (routed by its session id); the caller owns cancelling it. */
  generate(request: GenerateRequest, options: RequestOptions = {}): ClientReadableStream<GenerateResponse> {
    if (this.closed) throw closedError();
    const call = this.stub.generate(request, this.callMetadata(request.sessionId), callOptions(options));
    // A cancelled stream emits 'error' even when nobody reads it any more; never let that
    // become an uncaught exception. Readers still see errors through their own listeners.
    call.on("error", () => {});
    return call;
  }

  /** Close the channel: calls in flight run to their end, new calls throw `CancelledError`. */
  close(): void {
    this.closed = true;
    this.stub.close();
  }
}

function closedError(): CancelledError {
  return new CancelledError("this Client was closed; create a new Client to make calls");
}

function callOptions({ timeoutMs }: RequestOptions): CallOptions {
  if (timeoutMs === undefined) return {};
  if (!(timeoutMs >= 0)) throw new InvalidArgumentError(`timeoutMs must be a non-negative number of milliseconds, got ${timeoutMs}`);
  return { deadline: Date.now() + timeoutMs };
}

const INT32_MIN = -(2 ** 31);
const INT32_MAX = 2 ** 31 - 1;

/**
 * Copy caller token ids into a plain array, rejecting values the wire cannot carry (the
 * server checks the vocabulary range itself). `what` names the argument in the message.
 */
export function tokenIds(ids: Iterable<number>, what: string): number[] {
  if (ids === null || ids === undefined || typeof (ids as Iterable<number>)[Symbol.iterator] !== "function") {
    throw new InvalidArgumentError(`${what} must be an iterable of integer token ids (number[] or Int32Array), got ${String(ids)}`);
  }
  const out = Array.from(ids);
  out.forEach((t, i) => {
    if (!Number.isInteger(t) || t < INT32_MIN || t > INT32_MAX) {
      throw new InvalidArgumentError(`${what}[${i}] = ${String(t)} is not a 32-bit integer token id; pass integer ids from your tokenizer`);
    }
  });
  return out;
}

/** Check a numeric option is an integer in [min, max]; the message names the option. */
export function integerOption(name: string, value: number, min: number, max: number): number {
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new InvalidArgumentError(`${name} must be an integer in [${min}, ${max}], got ${String(value)}`);
  }
  return value;
}

export function numberOption(name: string, value: number): number {
  if (typeof value !== "number" || !Number.isFinite(value)) {
    throw new InvalidArgumentError(`${name} must be a finite number, got ${String(value)}`);
  }
  return value;
}
