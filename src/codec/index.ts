// kvgate/codec: the runtime-neutral codec API. A loader must hand it the wasm
// module first: src/codec/node.ts (Node, sync) or initCodec(module) (workerd).

export {
  buildCalibration,
  type Calibration,
  CalibrationMissingError,
  MAX_CALIBRATION_BYTES,
  type ModelGeometry,
  openCalibration,
} from './calibration.ts'
export {
  type ChunkInfo,
  type DecodeLimits,
  decodeChunk,
  decodeChunkInto,
  decodeLayer,
  decodeSection,
  type EncodeOptions,
  encodeChunk,
} from './chunk-codec.ts'
export {
  CODEC_MODES,
  CODEC_VERSIONS,
  type CodecMode,
  DEFAULT_QUALITY,
  type LayerTargets,
  LOGIT_SPREAD,
  layerTargets,
  MAX_QUALITY,
  MIN_QUALITY,
  RD_LAMBDA,
} from './params.ts'
export { type CachegenSplit, LARGE_MODEL_SPLIT, lmcacheSplit } from './reference-cachegen.ts'
export { initCodec, isCodecReady } from './runtime.ts'
