// A codec worker entry that cannot start (like a missing loader): it throws while loading.
throw new Error('cannot load the codec worker')
