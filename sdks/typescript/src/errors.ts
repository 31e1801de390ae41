/**
 * Typed SDK errors, one class per gRPC status the runtime returns (mirrors
 * `kakeya.errors` in the Python SDK). Every error the SDK throws for a failed call is a
 * `KakeyaError`; `code` is the numeric gRPC status, `details` the server's message.
 */
import { status as Status, type Metadata } from "@grpc/grpc-js";

export { Status };

export interface KakeyaErrorOptions {
  code?: Status;
  metadata?: Metadata;
  cause?: unknown;
}

export class KakeyaError extends Error {
  /** The status this class stands for; the base class stands for any other status. */
  static readonly code: Status = Status.UNKNOWN;

  readonly code: Status;
  readonly details: string;
  /** Trailing metadata of the failed call, when the server sent any. */
  readonly metadata: Metadata | undefined;

  constructor(details: string, options: KakeyaErrorOptions = {}) {
    super(details, options.cause === undefined ? undefined : { cause: options.cause });
    const cls = new.target as typeof KakeyaError;
    this.name = cls.name;
    this.code = options.code ?? cls.code;
    this.details = details;
    this.metadata = options.metadata;
  }

  /** The status name, e.g. "NOT_FOUND". */
  get codeName(): string {
    return Status[this.code] ?? `STATUS_${this.code}`;
  }
}

/**
 * Not thrown: emitted once (`process.emitWarning`) each time a session's saves start failing on the
 * daemon (e.g. its disk is full). What lies past `durableLength` would be lost in a crash; the
 * daemon retries, and `session.durableLength` grows again once a save succeeds. Mirrors Python's
 * `kakeya.SessionNotSavedWarning`.
 */
export class SessionNotSavedWarning extends Error {
  constructor(
    readonly sessionId: string,
    readonly durableLength: number,
    readonly reason: string,
  ) {
    super(`session ${sessionId} is not being saved (${reason}): only ${durableLength} tokens are durable; the daemon retries`);
    this.name = "SessionNotSavedWarning";
  }
}

/** A token id outside the vocabulary, an empty append, bad sampling parameters... Nothing was changed. */
export class InvalidArgumentError extends KakeyaError {
  static override readonly code = Status.INVALID_ARGUMENT;
}

/** The session id is unknown: never created, closed, evicted (idle TTL / LRU) or failed. */
export class SessionNotFoundError extends KakeyaError {
  static override readonly code = Status.NOT_FOUND;
}

/** The daemon requires an API key and the call had none or a wrong one. */
export class UnauthenticatedError extends KakeyaError {
  static override readonly code = Status.UNAUTHENTICATED;
}

export class PermissionDeniedError extends KakeyaError {
  static override readonly code = Status.PERMISSION_DENIED;
}

/** The session's cache broke an invariant (it was freed) or the call needs prior state (empty history). */
export class FailedPreconditionError extends KakeyaError {
  static override readonly code = Status.FAILED_PRECONDITION;
}

/** The history would exceed the model context under the server's KV strategy. */
export class OutOfRangeError extends KakeyaError {
  static override readonly code = Status.OUT_OF_RANGE;
}

/** Every session slot is busy generating; retry later. */
export class ResourceExhaustedError extends KakeyaError {
  static override readonly code = Status.RESOURCE_EXHAUSTED;
}

/** The call was cancelled, e.g. by aborting its `AbortSignal` (then `cause` is the signal's reason). */
export class CancelledError extends KakeyaError {
  static override readonly code = Status.CANCELLED;
}

export class DeadlineExceededError extends KakeyaError {
  static override readonly code = Status.DEADLINE_EXCEEDED;
}

/** The daemon cannot be reached (not running, wrong target, connection lost). */
export class UnavailableError extends KakeyaError {
  static override readonly code = Status.UNAVAILABLE;
}

/** Trailing metadata key with which a daemon says another daemon holds the session. */
export const OWNER_KEY = "kakeya-session-owner";

/**
 * Another live daemon sharing the state directory holds the session (a proxy sent the call to a replica
 * that does not hold it, e.g. while a replica comes back). Nothing was done, and the daemon asked the
 * holder to let the session go. The SDK retries such calls for `ownerWaitMs` (a Client option) before
 * throwing this. `owner` names the holder. Mirrors Python's `kakeya.SessionOwnedElsewhereError`.
 */
export class SessionOwnedElsewhereError extends UnavailableError {
  get owner(): string {
    const v = this.metadata?.get(OWNER_KEY)[0];
    return v === undefined ? "" : String(v);
  }
}

/** `createSession({ sessionId })` named an id already in use (live or saved). */
export class AlreadyExistsError extends KakeyaError {
  static override readonly code = Status.ALREADY_EXISTS;
}

export class InternalError extends KakeyaError {
  static override readonly code = Status.INTERNAL;
}

const BY_CODE = new Map<Status, typeof KakeyaError>(
  [
    InvalidArgumentError,
    SessionNotFoundError,
    AlreadyExistsError,
    UnauthenticatedError,
    PermissionDeniedError,
    FailedPreconditionError,
    OutOfRangeError,
    ResourceExhaustedError,
    CancelledError,
    DeadlineExceededError,
    UnavailableError,
    InternalError,
  ].map((cls) => [cls.code, cls]),
);

interface StatusLike {
  code: number;
  details?: string;
  metadata?: Metadata;
}

function isStatusLike(err: unknown): err is StatusLike {
  return typeof err === "object" && err !== null && typeof (err as StatusLike).code === "number";
}

/** The typed error for a gRPC status (a grpc-js `ServiceError` or a `{ code, details }` object). */
export function fromStatus(status: StatusLike, cause?: unknown): KakeyaError {
  const owned = status.code === Status.UNAVAILABLE && (status.metadata?.get(OWNER_KEY).length ?? 0) > 0;
  const cls = owned ? SessionOwnedElsewhereError : (BY_CODE.get(status.code) ?? KakeyaError);
  const details = status.details || Status[status.code] || `status ${status.code}`;
  return new cls(details, { code: status.code, metadata: status.metadata, cause });
}

/**
 * Convert whatever a grpc-js call failed with into a `KakeyaError`. A call cancelled because
 * `signal` was aborted becomes a `CancelledError` whose `cause` is the abort reason.
 * Errors that are not gRPC statuses (bugs) pass through unchanged.
 */
export function toKakeyaError(err: unknown, signal?: AbortSignal): unknown {
  if (err instanceof KakeyaError) return err;
  if (signal?.aborted) return aborted(signal);
  if (isStatusLike(err)) return fromStatus(err, err);
  return err;
}

export function aborted(signal: AbortSignal): CancelledError {
  return new CancelledError("the call was cancelled by its AbortSignal", { cause: signal.reason });
}
