// The real-model toolkit: llama2.c checkpoint + tokenizer loading, a TypeScript
// forward pass whose KV cache exports/imports kvgate chunk tensors, and KV statistics.

export { sampledWindows } from './calibration-text.ts'
export {
  type MeanSe,
  meanSe,
  type PreparedWindow,
  type ProtocolOptions,
  type ProtocolResult,
  prepareWindows,
  protocolWindows,
  runProtocol,
} from './codec-protocol.ts'
export {
  findSharedData,
  type LoadedModel,
  loadCheckpointFile,
  loadStories260k,
  loadTokenizerFile,
  MODEL_FILE,
  type SharedDataLookup,
  type SharedDataPaths,
  TOKENIZER_FILE,
} from './files.ts'
export {
  argmax,
  attend,
  chunkTensorBytes,
  exportChunk,
  type GenerateOptions,
  type GenerateResult,
  importChunk,
  type KvCacheOptions,
  KvCacheState,
  MAX_POSITIONS,
  matvec,
  type PrefillOptions,
  type PrefillResult,
  Transformer,
} from './forward.ts'
export { HELD_OUT_STORIES } from './held-out-text.ts'
export {
  channelRms,
  deltaVarianceRatio,
  excessKurtosis,
  type KvPlane,
  outlierChannels,
  planeOf,
  type QuantizationErrorOptions,
  quantizationError,
  relativeRmse,
} from './kv-stats.ts'
export {
  LLAMA2C_HEADER_BYTES,
  type LlamaCheckpoint,
  type LlamaConfig,
  type LlamaWeights,
  llama2cFileBytes,
  type ParseCheckpointOptions,
  parseLlama2c,
  parseLlama2cHeader,
} from './llama2c.ts'
export { ModelError } from './model-error.ts'
export {
  type Agreement,
  type AttentionError,
  attentionOutputError,
  type CodecQualityReport,
  type EvaluateCodecOptions,
  evaluateCodec,
  type KvError,
  kvRelativeError,
  nextTokenAgreement,
  type PerplexityChange,
  perplexityChange,
  type RoundTrip,
  type RoundTripCacheOptions,
  type RoundTripCacheResult,
  type RoundTripInfo,
  roundTripCache,
  type UniformQuantOptions,
  uniformQuantRoundTrip,
} from './quality.ts'
export { SAMPLE_STORIES } from './sample-text.ts'
export { type SyntheticKvOptions, syntheticKv, Xoshiro128 } from './synthetic.ts'
export {
  BOS_ID,
  BYTE_OFFSET,
  type DecodeOptions,
  type EncodeOptions,
  EOS_ID,
  type ParseTokenizerOptions,
  parseTokenizer,
  Tokenizer,
} from './tokenizer.ts'
