/**
 * A server-side session: an append-only history of raw token ids plus the attention state
 * the daemon keeps between turns (ADR 0008 §2.2). Mirrors `kakeya.Session` in Python.
 */
import { aborted, KakeyaError, SessionNotSavedWarning, SessionOwnedElsewhereError, toKakeyaError } from "./errors.js";
import type {
  AppendTokensResponse,
  CloseSessionResponse,
  GenerateResponse,
  GetHistoryResponse,
  GetSessionInfoResponse,
} from "./gen/kakeya/v1/runtime.js";
import { integerOption, numberOption, OwnerWait, pause, tokenIds, type RequestOptions, type Rpc } from "./rpc.js";
import { generationResult, sessionInfo, type GenerationResult, type HistoryTruncation, type SessionInfo } from "./types.js";

const UINT32_MAX = 2 ** 32 - 1;
const INT32_MAX = 2 ** 31 - 1;

export interface GenerateOptions {
  /** Most tokens to generate in this call (default 128). */
  maxTokens?: number;
  /** 0 (the default) is greedy decoding. */
  temperature?: number;
  /** 0 (the default) disables top-k filtering. */
  topK?: number;
  /** 1 (the default) disables nucleus filtering. */
  topP?: number;
  /** Seed of this call's sampler: same (history, seed, params) gives the same tokens. */
  seed?: number;
  /**
   * Aborting cancels the call on the server and the loop throws a `CancelledError`. The
   * session stays usable. Tokens the server committed before it saw the cancellation stay
   * in the history, including any past the last one yielded: the next `append()` waits for
   * the cancelled call to wind down and resolves to the exact history length (`info()`
   * right after the abort may not count them yet).
   */
  signal?: AbortSignal;
  /** Deadline for the whole call, in milliseconds. */
  timeoutMs?: number;
}

export class Session {
  /** The server-issued session id. */
  readonly id: string;
  /**
   * The Done information of the last `generate()` that ran to completion; `undefined` while
   * a call streams and after one that was cancelled, broken out of or failed.
   */
  lastResult: GenerationResult | undefined = undefined;
  /** Set once `close()` was called on this handle. */
  closed = false;
  /**
   * What the daemon last reported (append, generate, info): history tokens on disk, i.e. what the
   * session resumes with after a crash (0 when the daemon does not persist sessions).
   */
  durableLength = 0;
  /** Why the daemon cannot save this session ("" while it can); see `SessionNotSavedWarning`. */
  saveError = "";

  readonly #rpc: Rpc;

  /** @internal Sessions come from `Client.createSession()` or `Client.session(id)`. */
  constructor(rpc: Rpc, id: string) {
    this.#rpc = rpc;
    this.id = id;
  }

  /** Append raw token ids; resolves to the history length. No model work happens here. */
  async append(ids: Iterable<number>, options?: RequestOptions): Promise<number> {
    const request = { sessionId: this.id, tokenIds: tokenIds(ids, "ids") };
    const r = await this.#rpc.unary<AppendTokensResponse>((md, o, cb) => this.#rpc.stub.appendTokens(request, md, o, cb), options, this.id);
    this.#noteDurability(r.durableLength, r.saveError);
    return r.historyLength;
  }

  #noteDurability(durableLength: number, saveError: string): void {
    if (saveError && !this.saveError) process.emitWarning(new SessionNotSavedWarning(this.id, durableLength, saveError));
    this.durableLength = durableLength;
    this.saveError = saveError;
  }

  /**
   * Stream generated token ids as the server commits them; they join the history. After the
   * loop, `lastResult` holds the Done event (stop reason, counts, timings, truncations).
   * Breaking out of the loop cancels the call on the server, like aborting `signal`.
   */
  async *generate(options: GenerateOptions = {}): AsyncGenerator<number, void, undefined> {
    const { maxTokens = 128, temperature = 0, topK = 0, topP = 1, seed = 0, signal, timeoutMs } = options;
    this.lastResult = undefined;
    const request = {
      sessionId: this.id,
      maxTokens: integerOption("maxTokens", maxTokens, 0, UINT32_MAX),
      sampling: {
        temperature: numberOption("temperature", temperature),
        topK: integerOption("topK", topK, 0, INT32_MAX),
        topP: numberOption("topP", topP),
        seed: integerOption("seed", seed, 0, Number.MAX_SAFE_INTEGER),
      },
    };
    if (signal?.aborted) throw aborted(signal);
    const wait = new OwnerWait(this.#rpc.ownerWaitMs);
    for (;;) {
      const started = { value: false };
      try {
        yield* this.#generateOnce(request, started, signal, timeoutMs);
        return;
      } catch (err) {
        // refused before its first event because another daemon holds the session: nothing ran, retry
        if (started.value || !(err instanceof SessionOwnedElsewhereError)) throw err;
        await pause(wait.delay(err), signal);
      }
    }
  }

  async *#generateOnce(
    request: Parameters<Rpc["generate"]>[0],
    started: { value: boolean },
    signal: AbortSignal | undefined,
    timeoutMs: number | undefined,
  ): AsyncGenerator<number, void, undefined> {
    const call = this.#rpc.generate(request, timeoutMs === undefined ? {} : { timeoutMs });
    const onAbort = () => call.cancel();
    signal?.addEventListener("abort", onAbort, { once: true });
    const tokens: number[] = [];
    const truncated: HistoryTruncation[] = [];
    try {
      for await (const ev of call as AsyncIterable<GenerateResponse>) {
        started.value = true;
        if (ev.token) {
          tokens.push(ev.token.tokenId);
          yield ev.token.tokenId;
          if (signal?.aborted) throw aborted(signal);
        } else if (ev.historyTruncated) {
          truncated.push({ droppedTokens: ev.historyTruncated.droppedTokens, totalDroppedTokens: ev.historyTruncated.totalDroppedTokens });
        } else if (ev.done) {
          this.lastResult = generationResult(ev.done, tokens, truncated);
          this.#noteDurability(ev.done.durableLength, ev.done.saveError);
        }
      }
    } catch (err) {
      throw toKakeyaError(err, signal);
    } finally {
      signal?.removeEventListener("abort", onAbort);
      call.cancel(); // no-op when the call already ended; stops the server when we left early
    }
  }

  /** Run a whole Generate and resolve to its result (tokens included). */
  async generateAll(options: GenerateOptions = {}): Promise<GenerationResult> {
    for await (const _ of this.generate(options)) {
      // drain
    }
    return this.lastResult as GenerationResult;
  }

  /** History length, resident KV, pending tokens and invariant counters. */
  async info(options?: RequestOptions): Promise<SessionInfo> {
    const request = { sessionId: this.id };
    const info = sessionInfo(
      await this.#rpc.unary<GetSessionInfoResponse>((md, o, cb) => this.#rpc.stub.getSessionInfo(request, md, o, cb), options, this.id),
    );
    this.#noteDurability(info.durableLength, info.saveError);
    return info;
  }

  /**
   * Token ids from `start`. Waits for an in-flight generate, so after a cancelled call it
   * returns exactly what the server committed (including tokens the client never received).
   */
  async history(start = 0, options?: RequestOptions): Promise<number[]> {
    const request = { sessionId: this.id, start: integerOption("start", start, 0, Number.MAX_SAFE_INTEGER) };
    const r = await this.#rpc.unary<GetHistoryResponse>((md, o, cb) => this.#rpc.stub.getHistory(request, md, o, cb), options, this.id);
    return r.tokenIds;
  }

  /** Free the session and its KV state on the server. A second call is a no-op. */
  async close(options?: RequestOptions): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    const request = { sessionId: this.id };
    await this.#rpc.unary<CloseSessionResponse>((md, o, cb) => this.#rpc.stub.closeSession(request, md, o, cb), options, this.id);
  }

  /** `await using session = await client.createSession()` closes it at scope exit. */
  async [Symbol.asyncDispose](): Promise<void> {
    try {
      await this.close();
    } catch (err) {
      if (!(err instanceof KakeyaError)) throw err; // already gone server-side: nothing left to free
    }
  }
}
