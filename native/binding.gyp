# kvgate's native addon: pinned host memory, CUDA through a run-time dlopen of
# libcudart (no link-time CUDA), IPC handles and O_DIRECT file I/O.
{
  "targets": [
    {
      "target_name": "kvgate_native",
      "sources": ["src/addon.cc", "src/errors.cc", "src/memory.cc", "src/cuda.cc", "src/io.cc", "src/mmap.cc", "src/stream_copy.cc", "src/crc32.cc", "src/keys.cc"],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")"],
      "defines": [
        "NAPI_VERSION=8",
        "NODE_ADDON_API_DISABLE_DEPRECATED",
        "NAPI_CPP_EXCEPTIONS",
        "_GNU_SOURCE"
      ],
      "cflags!": ["-fno-exceptions", "-O3"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-O3"],
      "cflags": ["-O2"],
      "cflags_cc": ["-std=c++17", "-O2", "-fexceptions", "-Wall", "-Wextra", "-Wno-unused-parameter"],
      "libraries": ["-ldl", "-lpthread"],
      "configurations": {
        "Release": {
          "cflags!": ["-O3"],
          "cflags_cc!": ["-O3"]
        }
      }
    }
  ]
}
