// A codec worker entry that never finishes starting (a loader stuck on something that never
// comes): the thread stays alive and never says it is ready.
setInterval(() => {}, 1 << 30)
await new Promise(() => {})
