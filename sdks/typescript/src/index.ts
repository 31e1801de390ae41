/**
 * Kakeya TypeScript SDK: server-side sessions of raw token ids over gRPC.
 *
 *     import { Client } from "@kakeya/runtime";
 *     const client = new Client("127.0.0.1:50051");
 *     const session = await client.createSession();
 *     await session.append(ids);
 *     for await (const id of session.generate({ maxTokens: 64 })) { ... }
 *     await session.close();
 *     client.close();
 *
 * The core has no tokenizer: chat templates are the application's (ADR 0008 §2.4). The
 * opt-in helpers live in "@kakeya/runtime/tokenization".
 */
export { Client, type ClientOptions, type CreateSessionOptions } from "./client.js";
export { Session, type GenerateOptions } from "./session.js";
export type { RequestOptions } from "./rpc.js";
export type { GenerationResult, HistoryTruncation, PersistenceInfo, ServerInfo, SessionInfo, StopReason } from "./types.js";
export { SESSION_HEADER } from "./rpc.js";
export {
  AlreadyExistsError,
  CancelledError,
  DeadlineExceededError,
  FailedPreconditionError,
  InternalError,
  InvalidArgumentError,
  KakeyaError,
  OutOfRangeError,
  PermissionDeniedError,
  ResourceExhaustedError,
  SessionNotFoundError,
  SessionNotSavedWarning,
  SessionOwnedElsewhereError,
  Status,
  UnauthenticatedError,
  UnavailableError,
  type KakeyaErrorOptions,
} from "./errors.js";

export const VERSION = "0.4.0";
