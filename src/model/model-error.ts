// The one error the model loader, tokenizer and forward pass raise: a KvgateError
// with code ERR_MODEL, so callers (demo, benchmarks) branch on one stable code.

import { KvgateError, type KvgateErrorOptions } from '../core/errors.ts'

/** A model or tokenizer file that cannot be used, or a call the model cannot serve. */
export class ModelError extends KvgateError {
  constructor(message: string, options: KvgateErrorOptions = {}) {
    super('ERR_MODEL', message, { status: 400, ...options })
    this.name = 'ModelError'
  }
}
