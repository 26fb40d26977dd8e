"""Answering a slice's items: lm-eval wrapped once (:mod:`.evaluate`), the slices (:mod:`.slices`),
sequential rounds (:mod:`.sequential`), batched generation (:mod:`.generation`) and the code
sandbox (:mod:`.sandbox`)."""
