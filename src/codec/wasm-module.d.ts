// workerd (and wrangler/esbuild with a wasm loader) import .wasm files as a
// compiled WebAssembly.Module.
declare module '*.wasm' {
  const module: WebAssembly.Module
  export default module
}
