"""Models: loading one from a hub id, a local directory, a packaged GGUF or a tiny random config
(:mod:`.loading`), placing it on devices (:mod:`.placement`), and hooks on its modules while
batches run through it (:mod:`.hooks`)."""
