"""Token-level divergence of a candidate from its reference: teacher-forced distributions on the
same texts (:mod:`.scoring`) and their summaries, llama.cpp-style (:mod:`.token_stats`)."""
