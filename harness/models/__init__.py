"""Models: loading one from a hub id, a local directory, a packaged GGUF or a tiny random config
(:mod:`.loading`), and placing it on devices (:mod:`.placement`)."""
