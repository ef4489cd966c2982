// sha256-v1 chain keys in one call (docs/keys.md: key_i = SHA-256(key_{i-1} ‖ u32le(n) ‖ n × u32le(token))).
// A 128k-token prompt is 512 chunk keys; hashed one JS call each they cost 1.9–4.2 ms on the CI machine
// against ~0.4 ms for the same bytes, so the client's key memo hashes the whole chain here. SHA-256 is
// OpenSSL's, the one Node links and exports (EVP_Digest): no second implementation to trust.
#include <openssl/evp.h>

#include <cstring>

#include "common.h"

namespace kvgate {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the preimage's u32le words are copied as host words");

// sha256V1Chain(parent: Uint8Array(32), tokens: Uint32Array, chunkTokens, chunks, out: Uint8Array(32·chunks)):
// out[32i..32i+32) = key of chunk i of `tokens`, chained from `parent`. JS validates; bounds are re-checked.
static Napi::Value Sha256V1Chain(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 5 || !info[0].IsTypedArray() || !info[1].IsTypedArray() || !info[2].IsNumber() ||
      !info[3].IsNumber() || !info[4].IsTypedArray()) {
    ThrowNative(env, "sha256V1Chain(parent, tokens, chunkTokens, chunks, out): bad arguments");
  }
  auto parent = info[0].As<Napi::Uint8Array>();
  auto tokens = info[1].As<Napi::Uint32Array>();
  auto out = info[4].As<Napi::Uint8Array>();
  const double c = info[2].As<Napi::Number>().DoubleValue();
  const double n = info[3].As<Napi::Number>().DoubleValue();
  if (parent.TypedArrayType() != napi_uint8_array || tokens.TypedArrayType() != napi_uint32_array ||
      out.TypedArrayType() != napi_uint8_array || parent.ByteLength() != 32 || !(c >= 1 && c <= (1 << 20)) ||
      !(n >= 0 && n <= (1 << 24)) || c != static_cast<double>(static_cast<uint32_t>(c)) ||
      n != static_cast<double>(static_cast<uint32_t>(n)) ||
      tokens.ElementLength() < static_cast<size_t>(c) * static_cast<size_t>(n) ||
      out.ByteLength() < 32 * static_cast<size_t>(n)) {
    ThrowNative(env, "sha256V1Chain: sizes do not match (parent 32 bytes, chunks × chunkTokens tokens, 32 bytes out per chunk)");
  }
  const uint32_t chunk = static_cast<uint32_t>(c);
  const size_t chunks = static_cast<size_t>(n);
  std::vector<uint8_t> pre(36 + 4 * static_cast<size_t>(chunk));
  std::memcpy(pre.data() + 32, &chunk, 4);
  const EVP_MD* sha256 = EVP_sha256();
  const uint8_t* prev = parent.Data();
  uint8_t* dst = out.Data();
  for (size_t i = 0; i < chunks; i++) {
    std::memcpy(pre.data(), prev, 32);
    std::memcpy(pre.data() + 36, tokens.Data() + i * chunk, 4 * static_cast<size_t>(chunk));
    unsigned int len = 0;
    if (EVP_Digest(pre.data(), pre.size(), dst + 32 * i, &len, sha256, nullptr) != 1 || len != 32) {
      ThrowNative(env, "sha256V1Chain: EVP_Digest failed");
    }
    prev = dst + 32 * i;
  }
  return env.Undefined();
}

void InitKeys(Napi::Env env, Napi::Object exports) {
  exports.Set("sha256V1Chain", Napi::Function::New(env, Sha256V1Chain, "sha256V1Chain"));
}

}  // namespace kvgate
