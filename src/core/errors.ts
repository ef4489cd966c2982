// Every error kvgate raises extends KvgateError and carries a stable string
// `code` (what programs branch on) and, where it crosses HTTP, a `status`.

/** Stable codes. Never renamed once released: clients and dashboards match on them. */
export type ErrorCode =
  | 'ERR_INVALID_ARGUMENT'
  | 'ERR_INVALID_KEY'
  | 'ERR_INVALID_NAMESPACE'
  | 'ERR_FORMAT_TRUNCATED'
  | 'ERR_FORMAT_BAD_MAGIC'
  | 'ERR_FORMAT_BAD_VERSION'
  | 'ERR_FORMAT_BAD_FIELD'
  | 'ERR_FORMAT_CHECKSUM'
  | 'ERR_FORMAT_TOO_LARGE'
  | 'ERR_CODEC'
  | 'ERR_CODEC_MISMATCH'
  | 'ERR_CALIBRATION_MISSING'
  | 'ERR_CODEC_DTYPE'
  | 'ERR_NOT_FOUND'
  | 'ERR_ALREADY_EXISTS'
  | 'ERR_PRECONDITION_FAILED'
  | 'ERR_UPLOAD_EXPIRED'
  | 'ERR_UNAUTHORIZED'
  | 'ERR_FORBIDDEN'
  | 'ERR_PAYLOAD_TOO_LARGE'
  | 'ERR_UNSUPPORTED_MEDIA_TYPE'
  | 'ERR_RANGE_NOT_SATISFIABLE'
  | 'ERR_STORE'
  | 'ERR_STORE_UNAVAILABLE'
  | 'ERR_STORE_FULL'
  | 'ERR_BUSY'
  | 'ERR_TIMEOUT'
  | 'ERR_CIRCUIT_OPEN'
  | 'ERR_NATIVE'
  | 'ERR_CUDA'
  | 'ERR_CONFIG'
  | 'ERR_MODEL'
  | 'ERR_CLOSED'
  | 'ERR_INTERNAL'

export interface KvgateErrorOptions {
  cause?: unknown
  /** HTTP status when this error crosses the gateway API. */
  status?: number
}

export class KvgateError extends Error {
  readonly code: ErrorCode
  readonly status: number

  constructor(code: ErrorCode, message: string, options: KvgateErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause })
    this.name = 'KvgateError'
    this.code = code
    this.status = options.status ?? 500
  }

  /** The JSON body every gateway error answers with. */
  toJSON(): { error: { code: ErrorCode; message: string } } {
    return { error: { code: this.code, message: this.message } }
  }
}

export class InvalidArgumentError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_INVALID_ARGUMENT', message, { status: 400, ...options })
    this.name = 'InvalidArgumentError'
  }
}

export class InvalidKeyError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_INVALID_KEY', message, { status: 400, ...options })
    this.name = 'InvalidKeyError'
  }
}

export class InvalidNamespaceError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_INVALID_NAMESPACE', message, { status: 400, ...options })
    this.name = 'InvalidNamespaceError'
  }
}

export type FormatErrorCode = Extract<ErrorCode, `ERR_FORMAT_${string}`>

/** A chunk object that cannot be trusted. Readers treat it as a miss. */
export class FormatError extends KvgateError {
  constructor(code: FormatErrorCode, message: string, options: KvgateErrorOptions = {}) {
    super(code, message, { status: code === 'ERR_FORMAT_TOO_LARGE' ? 413 : 400, ...options })
    this.name = 'FormatError'
  }
}

export class CodecError extends KvgateError {
  constructor(
    message: string,
    options: KvgateErrorOptions & {
      code?: 'ERR_CODEC' | 'ERR_CODEC_MISMATCH' | 'ERR_CALIBRATION_MISSING' | 'ERR_CODEC_DTYPE'
    } = {},
  ) {
    super(options.code ?? 'ERR_CODEC', message, { status: 400, ...options })
    this.name = 'CodecError'
  }
}

/**
 * The codec proved a stream bad: a section it refuses to decode (the decoder's own verdict), or
 * one that cannot hold what its CRC-checked header claims. Other CodecErrors (a wasm trap, an
 * allocation that failed, a limit of this reader, a worker that failed) say nothing about the
 * bytes: readers delete or report an object only on this error or a FormatError.
 */
export class CorruptStreamError extends CodecError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super(message, options)
    this.name = 'CorruptStreamError'
  }
}

/** Whether `e` is a verdict on the bytes themselves (format, checksum, identity, a corrupt stream). */
export function provesCorrupt(e: unknown): boolean {
  return e instanceof CorruptStreamError || (isKvgateError(e) && e.code.startsWith('ERR_FORMAT_'))
}

export class NotFoundError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_NOT_FOUND', message, { status: 404, ...options })
    this.name = 'NotFoundError'
  }
}

export class StoreError extends KvgateError {
  constructor(
    message: string,
    options: KvgateErrorOptions & {
      code?: 'ERR_STORE' | 'ERR_STORE_UNAVAILABLE' | 'ERR_STORE_FULL' | 'ERR_TIMEOUT'
    } = {},
  ) {
    super(options.code ?? 'ERR_STORE', message, { status: 502, ...options })
    this.name = 'StoreError'
  }
}

export class ConfigError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_CONFIG', message, { status: 500, ...options })
    this.name = 'ConfigError'
  }
}

/** True for any kvgate error, also across realms / duplicated module copies. */
export function isKvgateError(e: unknown): e is KvgateError {
  return (
    e instanceof KvgateError ||
    (typeof e === 'object' &&
      e !== null &&
      typeof (e as { code?: unknown }).code === 'string' &&
      'status' in e)
  )
}
