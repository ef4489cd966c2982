// Small constructors for the HTTP-facing errors the routes raise, so every
// failure leaves as `{error:{code,message}}` with the right status.

import { InvalidArgumentError, KvgateError } from '../core/errors.ts'

export const badRequest = (message: string) => new InvalidArgumentError(message)
export const notFound = (message = 'no such chunk') =>
  new KvgateError('ERR_NOT_FOUND', message, { status: 404 })
export const payloadTooLarge = (message: string) =>
  new KvgateError('ERR_PAYLOAD_TOO_LARGE', message, { status: 413 })
export const unsupportedMediaType = (message: string) =>
  new KvgateError('ERR_UNSUPPORTED_MEDIA_TYPE', message, { status: 415 })
export const lengthRequired = () =>
  new KvgateError('ERR_INVALID_ARGUMENT', 'Content-Length is required for chunk uploads', { status: 411 })
